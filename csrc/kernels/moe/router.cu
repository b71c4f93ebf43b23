// Backward of the fused MoE router: the CUDA twin of router_bwd_kernel in
// primus_turbo/triton/moe/router_kernel.py (same math; see that file for the forward's definitions).
//
//   dp = routing_map ? grad_probs * scaling : 0
//   SCORE 0 (softmax over the selected logits): p = softmax(selected logits), dl = p * (dp - <p, dp>)
//   SCORE 1 (softmax over all experts) / 2 (sigmoid): u = the unnormalised score of every expert;
//     NORM (probs = u_sel / (sum(u_sel) + 1e-20)): dp = selected ? (dp - <dp, q>) / denom : 0, q = u_sel / denom;
//     SCORE 1: dl = u * (dp - <u, dp>); SCORE 2: dl = dp * u * (1 - u)
//
// One warp per token row, EPL experts per lane (E <= 32 * EPL <= 1024), warp shuffles for the row sums:
// the kernel is a few microseconds at DeepSeek-V3 routing sizes. It exists for the host: launched from one
// C++ op it costs a fraction of a Triton launch, and the router backward is bound by its launch path
// (benchmark/ops/sweep_router.py: GPU 2-15 us, the op 63-78 us on H200).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "primus_turbo/common.h"

namespace primus_turbo {
namespace {

constexpr int kRowsPerBlock = 8;  // warps per block

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

template <typename T, int SCORE, bool NORM, int EPL>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    router_bwd_kernel(const T* __restrict__ grad_probs, const T* __restrict__ logits, const int8_t* __restrict__ map,
                      T* __restrict__ grad_logits, int64_t rows, int E, float scaling) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
    if (row >= rows) return;  // whole warps leave together: the shuffles below see full warps
    const int lane = threadIdx.x & 31;
    const int64_t base = row * E;
    float l[EPL], dp[EPL];
    bool chosen[EPL], valid[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int c = lane + 32 * i;
        valid[i] = c < E;
        chosen[i] = valid[i] && map[base + c] != 0;
        l[i] = valid[i] ? to_float(logits[base + c]) : -INFINITY;
        dp[i] = chosen[i] ? to_float(grad_probs[base + c]) * scaling : 0.f;
    }
    float dl[EPL];
    if constexpr (SCORE == 0) {
        float m = -INFINITY;
#pragma unroll
        for (int i = 0; i < EPL; ++i) m = chosen[i] ? fmaxf(m, l[i]) : m;
        m = warp_max(m);
        float s = 0.f;
        float p[EPL];
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            p[i] = chosen[i] ? __expf(l[i] - m) : 0.f;
            s += p[i];
        }
        s = warp_sum(s);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < EPL; ++i) {
            p[i] /= s;
            dot += p[i] * dp[i];
        }
        dot = warp_sum(dot);
#pragma unroll
        for (int i = 0; i < EPL; ++i) dl[i] = p[i] * (dp[i] - dot);
    } else {
        float u[EPL];
        if constexpr (SCORE == 1) {
            float m = -INFINITY;
#pragma unroll
            for (int i = 0; i < EPL; ++i) m = fmaxf(m, l[i]);
            m = warp_max(m);
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < EPL; ++i) {
                u[i] = valid[i] ? __expf(l[i] - m) : 0.f;
                s += u[i];
            }
            s = warp_sum(s);
#pragma unroll
            for (int i = 0; i < EPL; ++i) u[i] /= s;
        } else {
#pragma unroll
            for (int i = 0; i < EPL; ++i) u[i] = valid[i] ? 1.f / (1.f + __expf(-l[i])) : 0.f;
        }
        if constexpr (NORM) {
            float denom = 0.f;
#pragma unroll
            for (int i = 0; i < EPL; ++i) denom += chosen[i] ? u[i] : 0.f;
            denom = warp_sum(denom) + 1e-20f;
            float dq = 0.f;
#pragma unroll
            for (int i = 0; i < EPL; ++i) dq += chosen[i] ? dp[i] * (u[i] / denom) : 0.f;
            dq = warp_sum(dq);
#pragma unroll
            for (int i = 0; i < EPL; ++i) dp[i] = chosen[i] ? (dp[i] - dq) / denom : 0.f;
        }
        if constexpr (SCORE == 1) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < EPL; ++i) dot += u[i] * dp[i];
            dot = warp_sum(dot);
#pragma unroll
            for (int i = 0; i < EPL; ++i) dl[i] = u[i] * (dp[i] - dot);
        } else {
#pragma unroll
            for (int i = 0; i < EPL; ++i) dl[i] = dp[i] * u[i] * (1.f - u[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
        const int c = lane + 32 * i;
        if (c < E) grad_logits[base + c] = from_float<T>(dl[i]);
    }
}

template <typename T, int SCORE, bool NORM>
cudaError_t launch_epl(const void* gp, const void* logits, const int8_t* map, void* gl, int64_t rows, int E,
                       float scaling, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock));
    const dim3 block(32 * kRowsPerBlock);
    const auto* g = static_cast<const T*>(gp);
    const auto* x = static_cast<const T*>(logits);
    auto* out = static_cast<T*>(gl);
    if (E <= 32) {
        router_bwd_kernel<T, SCORE, NORM, 1><<<grid, block, 0, stream>>>(g, x, map, out, rows, E, scaling);
    } else if (E <= 64) {
        router_bwd_kernel<T, SCORE, NORM, 2><<<grid, block, 0, stream>>>(g, x, map, out, rows, E, scaling);
    } else if (E <= 128) {
        router_bwd_kernel<T, SCORE, NORM, 4><<<grid, block, 0, stream>>>(g, x, map, out, rows, E, scaling);
    } else if (E <= 256) {
        router_bwd_kernel<T, SCORE, NORM, 8><<<grid, block, 0, stream>>>(g, x, map, out, rows, E, scaling);
    } else if (E <= 512) {
        router_bwd_kernel<T, SCORE, NORM, 16><<<grid, block, 0, stream>>>(g, x, map, out, rows, E, scaling);
    } else {
        router_bwd_kernel<T, SCORE, NORM, 32><<<grid, block, 0, stream>>>(g, x, map, out, rows, E, scaling);
    }
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const void* gp, const void* logits, const int8_t* map, void* gl, int64_t rows, int E,
                         int score, bool norm, float scaling, cudaStream_t stream) {
    if (score == 0) return launch_epl<T, 0, false>(gp, logits, map, gl, rows, E, scaling, stream);
    if (score == 1)
        return norm ? launch_epl<T, 1, true>(gp, logits, map, gl, rows, E, scaling, stream)
                    : launch_epl<T, 1, false>(gp, logits, map, gl, rows, E, scaling, stream);
    return norm ? launch_epl<T, 2, true>(gp, logits, map, gl, rows, E, scaling, stream)
                : launch_epl<T, 2, false>(gp, logits, map, gl, rows, E, scaling, stream);
}

}  // namespace

int router_bwd_max_experts() { return 1024; }

cudaError_t router_bwd_launch(const void* grad_probs, const void* logits, const int8_t* routing_map,
                              void* grad_logits, int64_t rows, int E, int score, bool norm, float scaling,
                              DType dtype, cudaStream_t stream) {
    if (rows == 0 || E == 0) return cudaSuccess;
    if (E > router_bwd_max_experts() || score < 0 || score > 2) return cudaErrorInvalidValue;
    switch (dtype) {
        case DType::kFloat32:
            return launch_typed<float>(grad_probs, logits, routing_map, grad_logits, rows, E, score, norm, scaling,
                                       stream);
        case DType::kFloat16:
            return launch_typed<__half>(grad_probs, logits, routing_map, grad_logits, rows, E, score, norm, scaling,
                                        stream);
        case DType::kBFloat16:
            return launch_typed<__nv_bfloat16>(grad_probs, logits, routing_map, grad_logits, rows, E, score, norm,
                                               scaling, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace primus_turbo
