// Row-wise FP8 quantization (see primus_turbo/quantization.h for the numerics contract).
//
// One block per row. Rows up to 4 vectors per thread (8192 bf16 elements at 256 threads) are read once
// into registers; longer rows take two passes, the cast pass re-reading the row from L2. Inputs move as
// 16-byte vectors when the row length and both pointers allow it. The point of this kernel over the
// Triton one is the host: one C++ op call instead of a Python launch path, which dominates a training
// step's FP8 overhead on a slow host (benchmark/NOTES.md, session 7).
#include "primus_turbo/common.h"
#include "primus_turbo/fp8_cast.h"
#include "primus_turbo/quantization.h"

namespace primus_turbo {
namespace {

constexpr int kMaxThreads = 256;

// NV > 0: the row is read once into registers (NV vectors per thread, rows up to blockDim * NV * VEC
// elements). NV == 0: any length, two passes (the second from L2).
template <typename T, int VEC, int NV, bool E5M2>
__global__ void __launch_bounds__(kMaxThreads) quantize_rowwise_kernel(const T* __restrict__ x,
                                                                       uint8_t* __restrict__ q,
                                                                       float* __restrict__ scale_inv, int64_t cols,
                                                                       bool pow2) {
    __shared__ float smem[kMaxThreads / 32];
    const int64_t row = blockIdx.x;
    const int64_t nvec = cols / VEC;
    const auto* xv = reinterpret_cast<const Vec<T, VEC>*>(x + row * cols);
    auto* qv = reinterpret_cast<Vec<uint8_t, VEC>*>(q + row * cols);
    constexpr float kMax = fp8_max_of<E5M2>();

    float amax = 0.0f;
    if constexpr (NV > 0) {
        Vec<T, VEC> v[NV];
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
            if (i < nvec) {
                v[k] = xv[i];
#pragma unroll
                for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, finite_abs(to_float(v[k].v[j])));
            }
        }
        const float scale = fp8_scale_from_amax(block_max(amax, smem), kMax, pow2);
        if (threadIdx.x == 0) scale_inv[row] = __fdiv_rn(1.0f, scale);
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int64_t i = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
            if (i < nvec) {
                qv[i] = cast_vec<E5M2>(v[k], scale, kMax);
            }
        }
    } else {
        for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
            const Vec<T, VEC> v = xv[i];
#pragma unroll
            for (int j = 0; j < VEC; ++j) amax = fmaxf(amax, finite_abs(to_float(v.v[j])));
        }
        const float scale = fp8_scale_from_amax(block_max(amax, smem), kMax, pow2);
        if (threadIdx.x == 0) scale_inv[row] = __fdiv_rn(1.0f, scale);
        for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
            qv[i] = cast_vec<E5M2>(xv[i], scale, kMax);
        }
    }
}

template <typename T, int VEC, int NV>
cudaError_t launch_kernel(const T* x, uint8_t* q, float* scale_inv, int64_t rows, int64_t cols, int threads,
                          bool e5m2, bool pow2, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(rows));
    if (e5m2)
        quantize_rowwise_kernel<T, VEC, NV, true><<<grid, threads, 0, stream>>>(x, q, scale_inv, cols, pow2);
    else
        quantize_rowwise_kernel<T, VEC, NV, false><<<grid, threads, 0, stream>>>(x, q, scale_inv, cols, pow2);
    return cudaGetLastError();
}

template <typename T, int VEC>
cudaError_t launch_typed(const void* x, void* q, float* scale_inv, int64_t rows, int64_t cols, bool e5m2,
                         bool pow2, cudaStream_t stream) {
    const int64_t nvec = cols / VEC;
    // the fewest vectors per thread (1, 2, 4) that hold the row, then just enough warps: 7168 bf16
    // columns take 224 threads x 4 vectors, not 256 threads with an eighth of them idle half the time
    const int64_t nv = nvec <= kMaxThreads ? 1 : (nvec <= 2 * kMaxThreads ? 2 : 4);
    int threads = static_cast<int>(((nvec + nv - 1) / nv + 31) / 32 * 32);
    threads = threads < 32 ? 32 : (threads > kMaxThreads ? kMaxThreads : threads);
    const int64_t per_thread = (nvec + threads - 1) / threads;
    const T* xt = static_cast<const T*>(x);
    uint8_t* qt = static_cast<uint8_t*>(q);
    if (per_thread <= 1) return launch_kernel<T, VEC, 1>(xt, qt, scale_inv, rows, cols, threads, e5m2, pow2, stream);
    if (per_thread <= 2) return launch_kernel<T, VEC, 2>(xt, qt, scale_inv, rows, cols, threads, e5m2, pow2, stream);
    if (per_thread <= 4) return launch_kernel<T, VEC, 4>(xt, qt, scale_inv, rows, cols, threads, e5m2, pow2, stream);
    return launch_kernel<T, VEC, 0>(xt, qt, scale_inv, rows, cols, threads, e5m2, pow2, stream);
}

template <typename T>
cudaError_t launch_dtype(const void* x, void* q, float* scale_inv, int64_t rows, int64_t cols, bool e5m2,
                         bool pow2, bool aligned, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);  // 16-byte loads; the fp8 store is kVec bytes
    if (aligned && cols % kVec == 0) return launch_typed<T, kVec>(x, q, scale_inv, rows, cols, e5m2, pow2, stream);
    return launch_typed<T, 1>(x, q, scale_inv, rows, cols, e5m2, pow2, stream);
}

}  // namespace

cudaError_t quantize_rowwise_fp8_launch(const void* x, void* q, float* scale_inv, int64_t rows, int64_t cols,
                                        DType dtype, bool e5m2, bool pow2, bool aligned, cudaStream_t stream) {
    if (rows == 0) return cudaSuccess;
    switch (dtype) {
        case DType::kFloat32:
            return launch_dtype<float>(x, q, scale_inv, rows, cols, e5m2, pow2, aligned, stream);
        case DType::kFloat16:
            return launch_dtype<__half>(x, q, scale_inv, rows, cols, e5m2, pow2, aligned, stream);
        case DType::kBFloat16:
            return launch_dtype<__nv_bfloat16>(x, q, scale_inv, rows, cols, e5m2, pow2, aligned, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace primus_turbo
