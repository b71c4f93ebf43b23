// RMSNorm CUDA launchers (csrc/kernels/normalization/rmsnorm.cu). Plain pointers + cudaStream_t,
// no torch types: the torch glue is csrc/pytorch/rmsnorm_bindings.cpp.
//
// Layout: x, residual, y, sum_out, dy, dx, dsum are contiguous [rows, hidden]; weight and dweight
// are [hidden]; rstd is fp32 [rows]. All tensors share one DType except rstd / workspace (fp32).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "primus_turbo/dtype.h"

namespace primus_turbo {

// Largest hidden size the kernels keep in registers (one row per warp or per block of <= 512
// threads, <= 4 16-byte vectors per thread, or 8 scalars when hidden is not a multiple of the
// vector width). Larger rows go to another backend (the Python dispatcher checks this).
// `aligned`: every pointer is 16-byte aligned (else the scalar path is used).
int64_t rmsnorm_max_hidden(int64_t hidden, DType dtype, bool aligned);

// y = x * rsqrt(mean(x^2) + eps) * (weight [+ 1 if zero_centered_gamma]); rstd[row] saved.
// residual != nullptr: the normalised input is s = x + residual (rounded to DType), written to sum_out.
cudaError_t rmsnorm_fwd_launch(const void* x, const void* residual, const void* weight, void* y, void* sum_out,
                               float* rstd, int64_t rows, int64_t hidden, float eps, bool zero_centered_gamma,
                               DType dtype, bool aligned, cudaStream_t stream);

// Number of fp32 rows of `hidden` the backward needs as dweight workspace (one per row group).
int64_t rmsnorm_bwd_workspace_rows(int64_t rows, int64_t hidden, DType dtype, bool aligned);

// dx = rstd * (w*dy - x_hat * mean(x_hat * w * dy)) [+ dsum]; dweight = sum_rows(dy * x_hat),
// reduced deterministically: per-row-group partials in `workspace`, then a second small kernel.
// dsum may be nullptr (no gradient flowing into the residual-sum output).
cudaError_t rmsnorm_bwd_launch(const void* dy, const void* x, const void* weight, const float* rstd,
                               const void* dsum, void* dx, void* dweight, float* workspace, int64_t rows,
                               int64_t hidden, bool zero_centered_gamma, DType dtype, bool aligned,
                               cudaStream_t stream);

}  // namespace primus_turbo
