// MoE token permute / unpermute driven by a row-id map (the CUDA twin of
// primus_turbo/triton/moe/permute_kernel.py; same map, same results).
//
//   row_id_map [T, K] int32: destination row of token t's k-th route, or -1.
//   permute:   out[map[t,k]] = x[t]            (a byte copy: dtype-agnostic), out_probs[map] = probs[t,k]
//   unpermute: out[t] = sum_k y[map[t,k]] (* probs[t,k])   fp32 accumulation, no atomics
//
// One block per token. Permute reads each 16-byte chunk of the row once into registers and stores it
// to every destination, so HBM traffic is exactly (1 + K_routed) row bytes; the destinations sit in
// shared memory (K <= 1024). Rows whose byte size or pointers are not 16-byte aligned fall back to a
// 2-byte copy loop (every supported dtype is >= 2 bytes except FP8, whose rows are even-sized in practice).
#include <cuda_runtime.h>

#include <cstdint>

#include "primus_turbo/common.h"

namespace primus_turbo {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxK = 1024;

template <typename VecT>
__global__ void permute_rows_kernel(const VecT* __restrict__ x, const int32_t* __restrict__ row_id_map,
                                    const float* __restrict__ probs, VecT* __restrict__ out,
                                    float* __restrict__ out_probs, int64_t vecs_per_row, int K) {
    __shared__ int32_t dest[kMaxK];
    const int64_t t = blockIdx.x;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const int32_t d = row_id_map[t * K + k];
        dest[k] = d;
        if (probs != nullptr && d >= 0) out_probs[d] = probs[t * K + k];
    }
    __syncthreads();
    const VecT* src = x + t * vecs_per_row;
    for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
        const VecT v = src[i];
        for (int k = 0; k < K; ++k) {
            const int32_t d = dest[k];
            if (d >= 0) out[static_cast<int64_t>(d) * vecs_per_row + i] = v;
        }
    }
}

template <typename T, int VEC>
__global__ void unpermute_rows_kernel(const T* __restrict__ y, const int32_t* __restrict__ row_id_map,
                                      const float* __restrict__ probs, T* __restrict__ out, int64_t hidden, int K) {
    __shared__ int32_t src_rows[kMaxK];
    __shared__ float weights[kMaxK];
    const int64_t t = blockIdx.x;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        src_rows[k] = row_id_map[t * K + k];
        weights[k] = probs != nullptr ? probs[t * K + k] : 1.0f;
    }
    __syncthreads();
    using V = Vec<T, VEC>;
    const int64_t nvec = hidden / VEC;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
        for (int k = 0; k < K; ++k) {
            const int32_t s = src_rows[k];
            if (s < 0) continue;
            const V v = reinterpret_cast<const V*>(y + static_cast<int64_t>(s) * hidden)[i];
            const float w = weights[k];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] += to_float<T>(v.v[j]) * w;
        }
        V o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_float<T>(acc[j]);
        reinterpret_cast<V*>(out + t * hidden)[i] = o;
    }
}

template <typename T>
cudaError_t launch_unpermute(const void* y, const int32_t* map, const float* probs, void* out, int64_t T_,
                             int64_t hidden, int K, bool aligned, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    if (aligned && hidden % kVec == 0) {
        unpermute_rows_kernel<T, kVec><<<T_, kThreads, 0, stream>>>(static_cast<const T*>(y), map, probs,
                                                                     static_cast<T*>(out), hidden, K);
    } else {
        unpermute_rows_kernel<T, 1><<<T_, kThreads, 0, stream>>>(static_cast<const T*>(y), map, probs,
                                                                  static_cast<T*>(out), hidden, K);
    }
    return cudaGetLastError();
}

}  // namespace

int moe_permute_max_k() { return kMaxK; }

cudaError_t moe_permute_launch(const void* x, const int32_t* row_id_map, const float* probs, void* out,
                               float* out_probs, int64_t num_tokens, int64_t row_bytes, int K, bool aligned16,
                               cudaStream_t stream) {
    if (num_tokens == 0) return cudaSuccess;
    if (aligned16 && row_bytes % 16 == 0) {
        permute_rows_kernel<uint4><<<num_tokens, kThreads, 0, stream>>>(
            static_cast<const uint4*>(x), row_id_map, probs, static_cast<uint4*>(out), out_probs, row_bytes / 16, K);
    } else {
        permute_rows_kernel<uint16_t><<<num_tokens, kThreads, 0, stream>>>(
            static_cast<const uint16_t*>(x), row_id_map, probs, static_cast<uint16_t*>(out), out_probs,
            row_bytes / 2, K);
    }
    return cudaGetLastError();
}

cudaError_t moe_unpermute_launch(const void* y, const int32_t* row_id_map, const float* probs, void* out,
                                 int64_t num_tokens, int64_t hidden, int K, DType dtype, bool aligned16,
                                 cudaStream_t stream) {
    if (num_tokens == 0) return cudaSuccess;
    switch (dtype) {
        case DType::kFloat32:
            return launch_unpermute<float>(y, row_id_map, probs, out, num_tokens, hidden, K, aligned16, stream);
        case DType::kFloat16:
            return launch_unpermute<__half>(y, row_id_map, probs, out, num_tokens, hidden, K, aligned16, stream);
        case DType::kBFloat16:
            return launch_unpermute<__nv_bfloat16>(y, row_id_map, probs, out, num_tokens, hidden, K, aligned16,
                                                   stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace primus_turbo
