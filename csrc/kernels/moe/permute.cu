// MoE token permute / unpermute driven by a row-id map (the CUDA twin of
// primus_turbo/triton/moe/permute_kernel.py; same map, same results).
//
//   row_id_map [T, K] int32: destination row of token t's k-th route, or -1.
//   permute:   out[map[t,k]] = x[t]            (a byte copy: dtype-agnostic), out_probs[map] = probs[t,k]
//   unpermute: out[t] = sum_k y[map[t,k]] (* probs[t,k])   fp32 accumulation, no atomics
//   Either may change the element type on the way (fp32 <-> fp16/bf16, round to nearest even): an fp32
//   residual stream is permuted straight into the experts' bf16 rows, and their bf16 outputs are summed
//   into fp32 tokens, without a separate cast pass over the K-times larger permuted buffer.
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

// Token t's destination rows into shared ``dest`` (and its probs to out_probs[dest], when given).
__device__ __forceinline__ void load_dests(const int32_t* __restrict__ row_id_map, const float* __restrict__ probs,
                                           float* __restrict__ out_probs, int64_t t, int K, int32_t* dest) {
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        const int32_t d = row_id_map[t * K + k];
        dest[k] = d;
        if (probs != nullptr && d >= 0) out_probs[d] = probs[t * K + k];
    }
    __syncthreads();
}

template <typename VecT>
__global__ void permute_rows_kernel(const VecT* __restrict__ x, const int32_t* __restrict__ row_id_map,
                                    const float* __restrict__ probs, VecT* __restrict__ out,
                                    float* __restrict__ out_probs, int64_t vecs_per_row, int K) {
    __shared__ int32_t dest[kMaxK];
    const int64_t t = blockIdx.x;
    load_dests(row_id_map, probs, out_probs, t, K, dest);
    const VecT* src = x + t * vecs_per_row;
    for (int64_t i = threadIdx.x; i < vecs_per_row; i += blockDim.x) {
        const VecT v = src[i];
        for (int k = 0; k < K; ++k) {
            const int32_t d = dest[k];
            if (d >= 0) out[static_cast<int64_t>(d) * vecs_per_row + i] = v;
        }
    }
}

template <typename TI, typename TO, int VEC>
__global__ void permute_cast_kernel(const TI* __restrict__ x, const int32_t* __restrict__ row_id_map,
                                    const float* __restrict__ probs, TO* __restrict__ out,
                                    float* __restrict__ out_probs, int64_t hidden, int K) {
    __shared__ int32_t dest[kMaxK];
    const int64_t t = blockIdx.x;
    load_dests(row_id_map, probs, out_probs, t, K, dest);
    using VI = Vec<TI, VEC>;
    using VO = Vec<TO, VEC>;
    const int64_t nvec = hidden / VEC;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        const VI v = reinterpret_cast<const VI*>(x + t * hidden)[i];
        VO o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_float<TO>(to_float<TI>(v.v[j]));
        for (int k = 0; k < K; ++k) {
            const int32_t d = dest[k];
            if (d >= 0) reinterpret_cast<VO*>(out + static_cast<int64_t>(d) * hidden)[i] = o;
        }
    }
}

template <typename TI, typename TO, int VEC>
__global__ void unpermute_rows_kernel(const TI* __restrict__ y, const int32_t* __restrict__ row_id_map,
                                      const float* __restrict__ probs, TO* __restrict__ out, int64_t hidden, int K) {
    __shared__ int32_t src_rows[kMaxK];
    __shared__ float weights[kMaxK];
    const int64_t t = blockIdx.x;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        src_rows[k] = row_id_map[t * K + k];
        weights[k] = probs != nullptr ? probs[t * K + k] : 1.0f;
    }
    __syncthreads();
    using VI = Vec<TI, VEC>;
    using VO = Vec<TO, VEC>;
    const int64_t nvec = hidden / VEC;
    for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) {
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] = 0.f;
        for (int k = 0; k < K; ++k) {
            const int32_t s = src_rows[k];
            if (s < 0) continue;
            const VI v = reinterpret_cast<const VI*>(y + static_cast<int64_t>(s) * hidden)[i];
            const float w = weights[k];
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc[j] += to_float<TI>(v.v[j]) * w;
        }
        VO o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_float<TO>(acc[j]);
        reinterpret_cast<VO*>(out + t * hidden)[i] = o;
    }
}

// Elements per access: 16 bytes of the wider type (same type: 16 bytes each way; fp32 <-> 16-bit: 16-byte
// fp32 and 8-byte 16-bit accesses).
template <typename TI, typename TO>
constexpr int vec_of() {
    return 16 / (sizeof(TI) > sizeof(TO) ? sizeof(TI) : sizeof(TO));
}

template <typename TI, typename TO>
cudaError_t launch_unpermute(const void* y, const int32_t* map, const float* probs, void* out, int64_t T_,
                             int64_t hidden, int K, bool aligned, cudaStream_t stream) {
    constexpr int kVec = vec_of<TI, TO>();
    const auto* in = static_cast<const TI*>(y);
    auto* o = static_cast<TO*>(out);
    if (aligned && hidden % kVec == 0) {
        unpermute_rows_kernel<TI, TO, kVec><<<T_, kThreads, 0, stream>>>(in, map, probs, o, hidden, K);
    } else {
        unpermute_rows_kernel<TI, TO, 1><<<T_, kThreads, 0, stream>>>(in, map, probs, o, hidden, K);
    }
    return cudaGetLastError();
}

template <typename TI, typename TO>
cudaError_t launch_permute_cast(const void* x, const int32_t* map, const float* probs, void* out, float* out_probs,
                                int64_t T_, int64_t hidden, int K, bool aligned, cudaStream_t stream) {
    constexpr int kVec = vec_of<TI, TO>();
    const auto* in = static_cast<const TI*>(x);
    auto* o = static_cast<TO*>(out);
    if (aligned && hidden % kVec == 0) {
        permute_cast_kernel<TI, TO, kVec><<<T_, kThreads, 0, stream>>>(in, map, probs, o, out_probs, hidden, K);
    } else {
        permute_cast_kernel<TI, TO, 1><<<T_, kThreads, 0, stream>>>(in, map, probs, o, out_probs, hidden, K);
    }
    return cudaGetLastError();
}

// Calls f.template operator()<TI, TO>() for the supported (input, output) type pairs: the same type, or fp32
// with fp16/bf16 either way. Returns cudaErrorInvalidValue for any other pair.
template <typename F>
cudaError_t with_types(DType in, DType out, const F& f) {
    if (in == out || in == DType::kFloat32 || out == DType::kFloat32) {
        switch (in) {
            case DType::kFloat32:
                switch (out) {
                    case DType::kFloat32: return f.template operator()<float, float>();
                    case DType::kFloat16: return f.template operator()<float, __half>();
                    case DType::kBFloat16: return f.template operator()<float, __nv_bfloat16>();
                }
                break;
            case DType::kFloat16:
                return out == DType::kFloat16 ? f.template operator()<__half, __half>()
                                              : f.template operator()<__half, float>();
            case DType::kBFloat16:
                return out == DType::kBFloat16 ? f.template operator()<__nv_bfloat16, __nv_bfloat16>()
                                               : f.template operator()<__nv_bfloat16, float>();
        }
    }
    return cudaErrorInvalidValue;
}

// with_types callbacks (C++17: no templated lambdas).
struct PermuteCast {
    const void* x;
    const int32_t* map;
    const float* probs;
    void* out;
    float* out_probs;
    int64_t tokens, hidden;
    int K;
    bool aligned;
    cudaStream_t stream;
    template <typename TI, typename TO>
    cudaError_t operator()() const {
        return launch_permute_cast<TI, TO>(x, map, probs, out, out_probs, tokens, hidden, K, aligned, stream);
    }
};

struct Unpermute {
    const void* y;
    const int32_t* map;
    const float* probs;
    void* out;
    int64_t tokens, hidden;
    int K;
    bool aligned;
    cudaStream_t stream;
    template <typename TI, typename TO>
    cudaError_t operator()() const {
        return launch_unpermute<TI, TO>(y, map, probs, out, tokens, hidden, K, aligned, stream);
    }
};

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

cudaError_t moe_permute_cast_launch(const void* x, const int32_t* row_id_map, const float* probs, void* out,
                                    float* out_probs, int64_t num_tokens, int64_t hidden, int K, DType in_dtype,
                                    DType out_dtype, bool aligned16, cudaStream_t stream) {
    if (num_tokens == 0) return cudaSuccess;
    if (in_dtype == out_dtype) return cudaErrorInvalidValue;  // a byte copy: moe_permute_launch
    return with_types(in_dtype, out_dtype,
                      PermuteCast{x, row_id_map, probs, out, out_probs, num_tokens, hidden, K, aligned16, stream});
}

cudaError_t moe_unpermute_launch(const void* y, const int32_t* row_id_map, const float* probs, void* out,
                                 int64_t num_tokens, int64_t hidden, int K, DType in_dtype, DType out_dtype,
                                 bool aligned16, cudaStream_t stream) {
    if (num_tokens == 0) return cudaSuccess;
    return with_types(in_dtype, out_dtype,
                      Unpermute{y, row_id_map, probs, out, num_tokens, hidden, K, aligned16, stream});
}

}  // namespace primus_turbo
