// FP8 GEMM through cuBLASLt with cached plans (csrc/kernels/gemm/gemm_fp8_cublaslt.cu). Plain pointers +
// cudaStream_t, no torch types: the torch glue is csrc/pytorch/gemm_bindings.cpp.
//
// Why: torch._scaled_mm runs the same cuBLASLt kernels for tensor-wise and row-wise (outer-vector) scales,
// but it builds the matmul descriptor and layouts and asks cuBLASLt's heuristic on every call. Here the
// descriptor, layouts and chosen algorithm are built once per problem and reused; a call only sets the two
// scale pointers and enqueues the kernel. Measured on H100 in a tight loop: 15-21 us of host per call vs
// 19-28 us for _scaled_mm (benchmark/NOTES.md, session 9; the 68-77 us first estimated were measured under
// GPU back-pressure or the profiler).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "primus_turbo/dtype.h"

namespace primus_turbo {

enum class Fp8GemmStatus : int {
    kOk = 0,
    kUnsupported = 1,  // cuBLASLt has no algorithm for this problem here (the caller picks another path)
    kError = 2,        // a cuBLASLt / CUDA call failed; `error` says which
};

// C[m, n] = (A[m, k] @ B[n, k]^T) * scales, A and B row-major FP8 (K contiguous, the only FP8 layout
// Hopper's tensor cores take), C row-major in out_dtype.
//   scale_mode 0 (tensor-wise): a_scale, b_scale point to one fp32 each.
//   scale_mode 1 (row-wise):    a_scale has m fp32 values (one per row of A), b_scale n (one per row of B).
// a_e5m2 / b_e5m2: float8_e5m2 operands (else float8_e4m3fn). fast_accum: cuBLASLt's FP8 fast accumulation.
// k and n must be multiples of 16 and the pointers 16-byte aligned (checked by the caller). workspace:
// gemm_fp8_cublaslt_workspace_bytes() of device memory ordered on `stream`. Thread-safe.
struct Fp8GemmProblem {
    int64_t m, n, k;
    bool a_e5m2, b_e5m2;
    DType out_dtype;
    int scale_mode;
    bool fast_accum;
};

Fp8GemmStatus gemm_fp8_cublaslt(const Fp8GemmProblem& problem, const void* a, const void* b, void* c,
                                const float* a_scale, const float* b_scale, void* workspace, int device,
                                cudaStream_t stream, std::string* error);

size_t gemm_fp8_cublaslt_workspace_bytes();

// Number of cached plans (for tests: one per distinct problem).
size_t gemm_fp8_cublaslt_plan_count();

}  // namespace primus_turbo
