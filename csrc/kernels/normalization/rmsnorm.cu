// RMSNorm forward kernels and launch (the plan and the design notes: rmsnorm_common.cuh).
#include "rmsnorm_common.cuh"

namespace primus_turbo {
namespace {

// PREFETCH: the loads of the row group's next row (row + groups) are issued into a second register
// buffer before the current row is reduced and written, so HBM reads overlap the barriers and stores.
// RESIDUAL = false compiles the residual path out (residual must be nullptr): the prefetch kernels
// are instantiated both ways, since the residual's two buffers would cost every launch ~60 registers.
template <typename T, int VEC, int VPT, bool PREFETCH, bool RESIDUAL = true>
__global__ void __launch_bounds__(kMaxThreadsPerRow)
    rmsnorm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ residual, const T* weight,
                       T* __restrict__ y, T* __restrict__ sum_out, float* __restrict__ rstd_out, int64_t rows,
                       int hidden, float eps, bool zero_centered_gamma) {
    using V = Vec<T, VEC>;
    __shared__ float smem[32];
    const int n_vec = hidden / VEC;
    const float w_shift = zero_centered_gamma ? 1.f : 0.f;
    const int64_t groups = static_cast<int64_t>(gridDim.x) * blockDim.y;
    const bool has_residual = RESIDUAL && residual != nullptr;
    // x (and with PREFETCH the residual) of `row` into registers; a row past the end loads nothing.
    auto load_row = [&](int64_t row, V(&xs)[VPT], V(&rs)[VPT]) {
        if (row >= rows) return;
        const V* x_row = reinterpret_cast<const V*>(x + row * hidden);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int idx = threadIdx.x + i * blockDim.x;
            if (idx < n_vec) {
                xs[i] = x_row[idx];
                if (PREFETCH && has_residual) rs[i] = reinterpret_cast<const V*>(residual + row * hidden)[idx];
            }
        }
    };
    auto process_row = [&](int64_t row, V(&v)[VPT], const V(&r)[VPT]) {
        float sum_sq = 0.f;
        if (has_residual) {
            const V* r_row = reinterpret_cast<const V*>(residual + row * hidden);
            V* s_row = reinterpret_cast<V*>(sum_out + row * hidden);
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int idx = threadIdx.x + i * blockDim.x;
                if (idx < n_vec) {
                    const V rv = PREFETCH ? r[i] : r_row[idx];
#pragma unroll
                    for (int j = 0; j < VEC; ++j) v[i].v[j] = from_float<T>(to_float(v[i].v[j]) + to_float(rv.v[j]));
                    s_row[idx] = v[i];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            if (threadIdx.x + i * blockDim.x < n_vec) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) sum_sq += to_float(v[i].v[j]) * to_float(v[i].v[j]);
            }
        }
        sum_sq = row_sum(sum_sq, smem);
        const float rstd = rsqrtf(sum_sq / hidden + eps);
        if (threadIdx.x == 0) rstd_out[row] = rstd;
        V* y_row = reinterpret_cast<V*>(y + row * hidden);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int idx = threadIdx.x + i * blockDim.x;
            if (idx < n_vec) {
                // weight is re-read per row (an L1 hit) rather than held in VPT more vector registers:
                // fewer registers -> more resident CTAs -> more bytes in flight per SM.
                const V w = reinterpret_cast<const V*>(weight)[idx];
                V out;
#pragma unroll
                for (int j = 0; j < VEC; ++j)
                    out.v[j] = from_float<T>(to_float(v[i].v[j]) * rstd * (to_float(w.v[j]) + w_shift));
                y_row[idx] = out;
            }
        }
    };
    int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
    if constexpr (PREFETCH) {
        V v[VPT], r[VPT];
        load_row(row, v, r);
        for (; row < rows; row += groups) {
            V v_next[VPT], r_next[VPT];
            load_row(row + groups, v_next, r_next);
            process_row(row, v, r);
#pragma unroll
            for (int i = 0; i < VPT; ++i) v[i] = v_next[i], r[i] = r_next[i];
        }
    } else {
        for (; row < rows; row += groups) {
            V v[VPT], r[VPT];  // r: unused (the residual is read while adding)
            load_row(row, v, r);
            process_row(row, v, r);
        }
    }
}

// L1 + L2 eviction-priority hints of the two-pass row kernel, as Triton emits for eviction_policy.
template <bool LAST>
__device__ __forceinline__ uint4 load_evict(const uint4* p) {
    uint4 v;
    uint64_t pol;
    if constexpr (LAST) {
        asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
        asm("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    } else {
        asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        asm("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
    }
    return v;
}

// One row per CTA, every thread holding exactly 2 16-byte vectors of it (hidden == VEC * 2 * blockDim.x,
// which the plan checks): no bounds checks and no loop, a grid of `rows` CTAs that the hardware refills
// as CTAs retire; __launch_bounds__(kMaxThreadsPerRow, kRowKernelCtas) caps the registers at 64.
// TWO_PASS = false (rows of <= 512 vectors): the row is held in registers as raw 16-byte words (see Raw).
// TWO_PASS (513-1024 vectors): torch.compile's scheme, the sum of squares from loads that keep the row in
// L1 / L2 (evict_last), then y from a second read of x (and residual) that the caches serve (evict_first;
// HBM reads x once). Plan sweeps on H200 (L2 flushed, benchmark/results/h200/): one pass 96-99% of copy at
// 2048-8192 columns; at 7168 / 8192 two passes moved 96-99% (4 vectors a thread, one pass) to 100-102%.
template <typename T, bool TWO_PASS, bool RESIDUAL>
__global__ void __launch_bounds__(kMaxThreadsPerRow, kRowKernelCtas)
    rmsnorm_fwd_row_kernel(const T* __restrict__ x, const T* __restrict__ residual, const T* weight,
                           T* __restrict__ y, T* __restrict__ sum_out, float* __restrict__ rstd_out, int64_t rows,
                           int hidden, float eps, bool zero_centered_gamma) {
    constexpr int VEC = 16 / sizeof(T), VPT = 2;
    using V = Vec<T, VEC>;
    __shared__ float smem[32];
    const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
    const uint4* x_row = reinterpret_cast<const uint4*>(x + offset);
    const uint4* r_row = RESIDUAL ? reinterpret_cast<const uint4*>(residual + offset) : nullptr;
    // Vector i of the row (x + residual rounded to T, as the unfused ops); the pass selects the hints.
    auto load = [&](int i, auto first_pass) {
        constexpr bool kFirst = decltype(first_pass)::value;
        const int idx = threadIdx.x + i * blockDim.x;
        uint4 v = TWO_PASS ? load_evict<kFirst>(x_row + idx) : x_row[idx];
        if constexpr (RESIDUAL) {
            const uint4 r = TWO_PASS ? load_evict<kFirst>(r_row + idx) : r_row[idx];
            V s;
#pragma unroll
            for (int j = 0; j < VEC; ++j) s.v[j] = from_float<T>(elem<T, VEC>(v, j) + elem<T, VEC>(r, j));
            v = *reinterpret_cast<const uint4*>(&s);
            if (kFirst) reinterpret_cast<uint4*>(sum_out + offset)[idx] = v;
        }
        return v;
    };
    uint4 v[VPT];
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        v[i] = load(i, std::true_type{});
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum_sq += elem<T, VEC>(v[i], j) * elem<T, VEC>(v[i], j);
    }
    sum_sq = row_sum(sum_sq, smem);
    const float rstd = rsqrtf(sum_sq / hidden + eps);
    if (threadIdx.x == 0) rstd_out[blockIdx.x] = rstd;
    const float w_shift = zero_centered_gamma ? 1.f : 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        if constexpr (TWO_PASS) v[i] = load(i, std::false_type{});
        const uint4 w = reinterpret_cast<const uint4*>(weight)[idx];
        V out;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            out.v[j] = from_float<T>(elem<T, VEC>(v[i], j) * rstd * (elem<T, VEC>(w, j) + w_shift));
        reinterpret_cast<V*>(y + offset)[idx] = out;
    }
}

template <typename T>
using FwdKernel = void (*)(const T*, const T*, const T*, T*, T*, float*, int64_t, int, float, bool);

template <typename T>
FwdKernel<T> fwd_kernel_for(const Plan& p, bool residual) {
    constexpr int kVec = 16 / sizeof(T);
    if (p.row_kernel && p.tpr > 256)  // rows of > 512 vectors: two passes
        return residual ? rmsnorm_fwd_row_kernel<T, true, true> : rmsnorm_fwd_row_kernel<T, true, false>;
    if (p.row_kernel)
        return residual ? rmsnorm_fwd_row_kernel<T, false, true> : rmsnorm_fwd_row_kernel<T, false, false>;
    if (!p.vectorized) return rmsnorm_fwd_kernel<T, 1, kScalarVpt, false>;
    if (p.vpt == 2)
        return residual ? rmsnorm_fwd_kernel<T, kVec, 2, true, true> : rmsnorm_fwd_kernel<T, kVec, 2, true, false>;
    return residual ? rmsnorm_fwd_kernel<T, kVec, kVecVpt, true, true>
                    : rmsnorm_fwd_kernel<T, kVec, kVecVpt, true, false>;
}

template <typename T>
cudaError_t fwd_typed(const void* x, const void* residual, const void* weight, void* y, void* sum_out,
                      float* rstd, int64_t rows, int64_t hidden, float eps, bool zcg, const Plan& p,
                      cudaStream_t stream) {
    auto kernel = fwd_kernel_for<T>(p, residual != nullptr);
    const int grid = p.row_kernel ? static_cast<int>(rows) : persistent_grid(kernel, p, rows);
    kernel<<<grid, dim3(p.tpr, p.rpc), 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(weight),
        static_cast<T*>(y), static_cast<T*>(sum_out), rstd, rows, static_cast<int>(hidden), eps, zcg);
    return cudaGetLastError();
}

}  // namespace

int64_t rmsnorm_max_hidden(int64_t hidden, DType dtype, bool aligned) {
    const Plan p = make_plan(hidden, dtype, aligned);
    return int64_t{kMaxThreadsPerRow} * (p.vectorized ? kVecVpt : kScalarVpt) * p.vec;
}

cudaError_t rmsnorm_fwd_launch(const void* x, const void* residual, const void* weight, void* y, void* sum_out,
                               float* rstd, int64_t rows, int64_t hidden, float eps, bool zero_centered_gamma,
                               DType dtype, bool aligned, cudaStream_t stream) {
    if (rows == 0 || hidden == 0) return cudaSuccess;
    if (hidden > rmsnorm_max_hidden(hidden, dtype, aligned) || (residual != nullptr) != (sum_out != nullptr))
        return cudaErrorInvalidValue;
    Plan p = make_plan(hidden, dtype, aligned, /*backward=*/false);
    p.row_kernel = p.row_kernel && rows <= INT32_MAX;  // its grid is one CTA per row
    PT_DISPATCH_DTYPE(dtype, T, {
        return fwd_typed<T>(x, residual, weight, y, sum_out, rstd, rows, hidden, eps, zero_centered_gamma, p,
                            stream);
    })
}

}  // namespace primus_turbo
