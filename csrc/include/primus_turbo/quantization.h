// FP8 quantization CUDA launchers (csrc/kernels/quantization/quantize_rowwise*.cu). Plain pointers +
// cudaStream_t, no torch types: the torch glue is csrc/pytorch/quantization_bindings.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "primus_turbo/dtype.h"

namespace primus_turbo {

// Row-wise FP8 quantization of a contiguous [rows, cols] tensor: per row, amax = max |x| over the finite
// elements (inf/NaN ignored), scale = fp8_max / amax (IEEE division; 1 when amax == 0; capped at FLT_MAX;
// with pow2 only its exponent bits), q = fp8(clamp(x * scale, +-fp8_max)) rounded to nearest (NaN stays
// NaN), scale_inv[row] = 1 / scale. Bit for bit the Triton kernel's and the torch reference's rules.
// e5m2: float8_e5m2 output, else float8_e4m3fn. `aligned`: x and q 16-byte aligned (vector path).
cudaError_t quantize_rowwise_fp8_launch(const void* x, void* q, float* scale_inv, int64_t rows, int64_t cols,
                                        DType dtype, bool e5m2, bool pow2, bool aligned, cudaStream_t stream);

// The row-wise quantization above (q [rows, cols], scale_inv [rows]) and, in the same two reads of x, the
// transposed copy qt [cols, rows] scaled per column of x (scale_inv_t [cols]), same rules. workspace:
// (rows + cols) * 4 bytes of device memory (the amaxes; zeroed here on `stream`). `aligned`: x, q and qt
// 16-byte aligned. cudaErrorInvalidConfiguration when cols > 4194240 (grid limit).
cudaError_t quantize_rowwise_transpose_fp8_launch(const void* x, void* q, void* qt, float* scale_inv,
                                                  float* scale_inv_t, void* workspace, int64_t rows, int64_t cols,
                                                  DType dtype, bool e5m2, bool pow2, bool aligned,
                                                  cudaStream_t stream);

// Tensor-wise: amax = max |x| over the finite elements of the whole tensor, the same scale rules, one
// scale_inv (a single float). tensor_amax_fp8_launch zeroes *amax on `stream`, then folds the tensor's amax
// into it as the float's bit pattern (n elements of contiguous x; `aligned`: x 16-byte aligned).
cudaError_t tensor_amax_fp8_launch(const void* x, unsigned* amax, int64_t n, DType dtype, bool aligned,
                                   cudaStream_t stream);

// q (n elements, x's layout) and scale_inv[0]; workspace: 4 bytes of device memory (the amax).
cudaError_t quantize_tensorwise_fp8_launch(const void* x, void* q, float* scale_inv, void* workspace, int64_t n,
                                           DType dtype, bool e5m2, bool pow2, bool aligned, cudaStream_t stream);

// q [rows, cols] and its transpose qt [cols, rows], one scale (scale_inv[0]); workspace: 4 bytes; `aligned`:
// x, q and qt 16-byte aligned. cudaErrorInvalidConfiguration when cols > 4194240 (grid limit).
cudaError_t quantize_tensorwise_transpose_fp8_launch(const void* x, void* q, void* qt, float* scale_inv,
                                                     void* workspace, int64_t rows, int64_t cols, DType dtype,
                                                     bool e5m2, bool pow2, bool aligned, cudaStream_t stream);

}  // namespace primus_turbo
