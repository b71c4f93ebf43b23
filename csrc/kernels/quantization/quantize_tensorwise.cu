// Tensor-wise FP8 quantization (see primus_turbo/quantization.h for the numerics contract).
//
// One scale for the whole tensor: an amax kernel (grid-stride over 16-byte vectors, one block maximum
// folded into a single word with integer atomicMax: non-negative floats order like their bit patterns,
// so the result is deterministic), then a cast kernel that reads that word. The transposed copy reuses
// the row-wise transpose kernels with every row / column scale equal (quantize_rowwise_transpose.cu).
// The point over the Triton version is the host: one C++ op call instead of two Python kernel launches
// and their allocations per tensor (Float8Linear TENSORWISE at M=8192 N=K=4096 on H200: host 1.31 ms per
// fwd+bwd against 0.69 ms for the C++ ROWWISE path, benchmark/NOTES.md session 26).
#include "primus_turbo/common.h"
#include "primus_turbo/fp8_cast.h"
#include "primus_turbo/quantization.h"

namespace primus_turbo {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1056;  // 8 blocks of 256 threads on each of 132 SMs: one grid-stride wave

int grid_for(int64_t vectors) {
    const int64_t blocks = (vectors + kThreads - 1) / kThreads;
    return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) tensor_amax_kernel(const T* __restrict__ x, unsigned* __restrict__ amax,
                                                               int64_t n) {
    __shared__ float smem[kThreads / 32];
    const auto* xv = reinterpret_cast<const Vec<T, VEC>*>(x);
    const int64_t nvec = n / VEC;  // VEC > 1 only when n % VEC == 0
    float m = 0.0f;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < nvec;
         i += static_cast<int64_t>(gridDim.x) * kThreads) {
        const Vec<T, VEC> v = xv[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) m = fmaxf(m, finite_abs(to_float(v.v[j])));
    }
    m = block_max(m, smem);
    if (threadIdx.x == 0 && m > 0.0f) atomicMax(amax, __float_as_uint(m));
}

template <typename T, int VEC, bool E5M2>
__global__ void __launch_bounds__(kThreads)
    tensor_cast_kernel(const T* __restrict__ x, const unsigned* __restrict__ amax, uint8_t* __restrict__ q,
                       float* __restrict__ scale_inv, int64_t n, bool pow2) {
    constexpr float kMax = fp8_max_of<E5M2>();
    const float scale = fp8_scale_from_amax(__uint_as_float(*amax), kMax, pow2);
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.0f, scale);
    const auto* xv = reinterpret_cast<const Vec<T, VEC>*>(x);
    auto* qv = reinterpret_cast<Vec<uint8_t, VEC>*>(q);
    const int64_t nvec = n / VEC;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < nvec;
         i += static_cast<int64_t>(gridDim.x) * kThreads)
        qv[i] = cast_vec<E5M2>(xv[i], scale, kMax);
}

template <typename T, int VEC>
cudaError_t launch_amax(const void* x, unsigned* amax, int64_t n, cudaStream_t stream) {
    tensor_amax_kernel<T, VEC><<<grid_for(n / VEC), kThreads, 0, stream>>>(static_cast<const T*>(x), amax, n);
    return cudaGetLastError();
}

template <typename T>
cudaError_t amax_dtype(const void* x, unsigned* amax, int64_t n, bool aligned, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    if (aligned && n % kVec == 0) return launch_amax<T, kVec>(x, amax, n, stream);
    return launch_amax<T, 1>(x, amax, n, stream);
}

template <typename T, int VEC>
cudaError_t launch_cast(const void* x, const unsigned* amax, void* q, float* scale_inv, int64_t n, bool e5m2,
                        bool pow2, cudaStream_t stream) {
    const T* xt = static_cast<const T*>(x);
    auto* qb = static_cast<uint8_t*>(q);
    const int grid = grid_for(n / VEC);
    if (e5m2)
        tensor_cast_kernel<T, VEC, true><<<grid, kThreads, 0, stream>>>(xt, amax, qb, scale_inv, n, pow2);
    else
        tensor_cast_kernel<T, VEC, false><<<grid, kThreads, 0, stream>>>(xt, amax, qb, scale_inv, n, pow2);
    return cudaGetLastError();
}

template <typename T>
cudaError_t cast_dtype(const void* x, const unsigned* amax, void* q, float* scale_inv, int64_t n, bool e5m2,
                       bool pow2, bool aligned, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    if (aligned && n % kVec == 0) return launch_cast<T, kVec>(x, amax, q, scale_inv, n, e5m2, pow2, stream);
    return launch_cast<T, 1>(x, amax, q, scale_inv, n, e5m2, pow2, stream);
}

}  // namespace

cudaError_t tensor_amax_fp8_launch(const void* x, unsigned* amax, int64_t n, DType dtype, bool aligned,
                                   cudaStream_t stream) {
    const cudaError_t err = cudaMemsetAsync(amax, 0, sizeof(unsigned), stream);
    if (err != cudaSuccess || n == 0) return err;
    switch (dtype) {
        case DType::kFloat32:
            return amax_dtype<float>(x, amax, n, aligned, stream);
        case DType::kFloat16:
            return amax_dtype<__half>(x, amax, n, aligned, stream);
        case DType::kBFloat16:
            return amax_dtype<__nv_bfloat16>(x, amax, n, aligned, stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t quantize_tensorwise_fp8_launch(const void* x, void* q, float* scale_inv, void* workspace, int64_t n,
                                           DType dtype, bool e5m2, bool pow2, bool aligned, cudaStream_t stream) {
    auto* amax = static_cast<unsigned*>(workspace);
    cudaError_t err = tensor_amax_fp8_launch(x, amax, n, dtype, aligned, stream);
    if (err != cudaSuccess) return err;
    switch (dtype) {  // n == 0 still writes scale_inv (amax 0: scale 1)
        case DType::kFloat32:
            return cast_dtype<float>(x, amax, q, scale_inv, n, e5m2, pow2, aligned, stream);
        case DType::kFloat16:
            return cast_dtype<__half>(x, amax, q, scale_inv, n, e5m2, pow2, aligned, stream);
        case DType::kBFloat16:
            return cast_dtype<__nv_bfloat16>(x, amax, q, scale_inv, n, e5m2, pow2, aligned, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace primus_turbo
