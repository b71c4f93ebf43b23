// RMSNorm backward kernels and launch (the plan and the design notes: rmsnorm_common.cuh).
#include "rmsnorm_common.cuh"

namespace primus_turbo {
namespace {

// The backward's loads of one row: this thread's x and dy vectors, and rstd (returned); nothing (0)
// for a row past the end. A function, not a lambda: a lambda changes the scheduling of the default
// fp32 kernel.
template <typename T, typename B, int VPT>
__device__ __forceinline__ float load_bwd_row(const T* __restrict__ x, const T* __restrict__ dy,
                                              const float* __restrict__ rstd_in, int64_t row, int64_t rows,
                                              int hidden, B (&xs)[VPT], B (&dys)[VPT]) {
    const bool valid = row < rows;
    const int n_vec = hidden / static_cast<int>(sizeof(B) / sizeof(T));
    const B* x_row = reinterpret_cast<const B*>(x + row * hidden);
    const B* dy_row = reinterpret_cast<const B*>(dy + row * hidden);
    const float rstd = valid ? rstd_in[row] : 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        if (valid && idx < n_vec) {
            xs[i] = x_row[idx];
            dys[i] = dy_row[idx];
        }
    }
    return rstd;
}

// One long function on purpose: the register-cached row (x, dy) and dweight partials must stay
// in one scope so the compiler keeps them in registers.
//
// A CTA holds blockDim.y row groups that walk rows in lock step (row block = blockDim.y rows, the
// same trip count for every thread, so __syncthreads is legal for tpr > 32). At the end the row
// groups' dweight partials are summed in shared memory ([blockDim.y, hidden] fp32, dynamic) and
// the CTA writes ONE partial row: partials = grid, not grid x rows-per-CTA (for hidden 2048 this
// cuts the workspace traffic from ~10% to ~1% of the backward's bytes).
//
// PREFETCH: as in the forward (x, dy, rstd of row + block_stride; dsum is still read at the store).
// EARLY_DSUM: dsum's loads are issued before the row reduction instead of at the store, so they overlap
// its barriers. The prefetch kernels run it when dsum is given (the residual backward; harness A/B on H200,
// sweep_rmsnorm_csrc_ca6d49a.txt: 16384 x 2048 / 4096 / 7168 82.9 / 150.6 / 295.0 -> 79.7 / 146.3 /
// 269.3 us, bitwise the same dx); without dsum they keep the store-time read (its registers unspent).
template <typename T, int VEC, int VPT, bool PREFETCH, bool EARLY_DSUM = false>
__device__ __forceinline__ void rmsnorm_bwd_body(const T* __restrict__ dy, const T* __restrict__ x, const T* weight,
                                                 const float* __restrict__ rstd_in, const T* __restrict__ dsum,
                                                 T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows,
                                                 int hidden, bool zero_centered_gamma) {
    using V = Vec<T, VEC>;
    __shared__ float red_smem[kMaxRowsPerCta][32];
    extern __shared__ float dw_smem[];  // [blockDim.y, hidden] when blockDim.y > 1
    const int n_vec = hidden / VEC;
    const float w_shift = zero_centered_gamma ? 1.f : 0.f;
    const float inv_hidden = 1.f / hidden;
    // dweight partials: fp64 for fp32 data (a CTA sums rows / grid products per column; fp32 drifted
    // past the fp32 tolerance at 32768 rows), fp32 for 16-bit data (registers; their tolerance is 100x).
    using Acc = typename std::conditional<std::is_same<T, float>::value, double, float>::type;
    Acc dw[VPT][VEC];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) dw[i][j] = Acc(0);
    // Row groups walk rows in lock step: the loop runs on the row block's base, the same for the CTA.
    // PREFETCH: x_pf / dy_pf / rstd_pf hold the row group's next row, loaded one row ahead (the copies
    // into x_pf at the end of an iteration wait for those loads, after this row's barriers and stores;
    // unrolling by two to alternate buffers instead was measured in SASS: the copies stay).
    const int64_t block_stride = static_cast<int64_t>(gridDim.x) * blockDim.y;
    using Buf = typename std::conditional<PREFETCH, Raw<V>, V>::type;  // a row's x / dy vectors
    Buf x_pf[VPT], dy_pf[VPT];
    float rstd_pf = 0.f;
    if constexpr (PREFETCH)
        rstd_pf = load_bwd_row(x, dy, rstd_in, static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y, rows,
                               hidden, x_pf, dy_pf);
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.y; base < rows; base += block_stride) {
        const int64_t row = base + threadIdx.y;
        const bool valid = row < rows;  // a short last row block: idle groups still reach the barriers
        Buf xv[VPT], dyv[VPT];
        float rstd;
        if constexpr (PREFETCH) {
            // Load into fresh arrays, then rename: loading into x_pf itself would make the compiler
            // merge each (predicated) load with x_pf's old value right away, i.e. wait for it.
            Buf x_next[VPT], dy_next[VPT];
            rstd = rstd_pf;
            rstd_pf = load_bwd_row(x, dy, rstd_in, row + block_stride, rows, hidden, x_next, dy_next);
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                xv[i] = x_pf[i], dyv[i] = dy_pf[i];
                x_pf[i] = x_next[i], dy_pf[i] = dy_next[i];
            }
        } else {
            rstd = load_bwd_row(x, dy, rstd_in, row, rows, hidden, xv, dyv);
        }
        const V* ds_row = dsum == nullptr ? nullptr : reinterpret_cast<const V*>(dsum + row * hidden);
        Raw<V> ds_early[VPT];
        if constexpr (EARLY_DSUM) {
#pragma unroll
            for (int i = 0; i < VPT; ++i) {
                const int idx = threadIdx.x + i * blockDim.x;
                if (valid && ds_row != nullptr && idx < n_vec)
                    ds_early[i] = reinterpret_cast<const Raw<V>*>(ds_row)[idx];
            }
        }
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int idx = threadIdx.x + i * blockDim.x;
            if (valid && idx < n_vec) {
                // weight has no __restrict__ so it is re-read (L1 hit) per row instead of being hoisted
                // into 16-32 more registers, which spills the bf16 kernel.
                const V w = reinterpret_cast<const V*>(weight)[idx];
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float x_hat = elem<T, VEC>(xv[i], j) * rstd;
                    const float g = elem<T, VEC>(dyv[i], j);
                    dot += x_hat * g * (to_float(w.v[j]) + w_shift);
                }
            }
        }
        const float mean_dot = row_sum(dot, red_smem[threadIdx.y]) * inv_hidden;
        if (!valid) continue;
        V* dx_row = reinterpret_cast<V*>(dx + row * hidden);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int idx = threadIdx.x + i * blockDim.x;
            if (idx < n_vec) {
                const V w = reinterpret_cast<const V*>(weight)[idx];
                V ds;
                if constexpr (EARLY_DSUM) {
                    ds = *reinterpret_cast<const V*>(&ds_early[i]);
                } else if (ds_row != nullptr) {
                    ds = ds_row[idx];
                }
                V out;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float x_hat = elem<T, VEC>(xv[i], j) * rstd;
                    const float dy_j = elem<T, VEC>(dyv[i], j);
                    dw[i][j] += static_cast<Acc>(dy_j) * x_hat;  // here, not in pass 1: shorter live ranges
                    float g = rstd * (dy_j * (to_float(w.v[j]) + w_shift) - x_hat * mean_dot);
                    if (ds_row != nullptr) g += to_float(ds.v[j]);
                    out.v[j] = from_float<T>(g);
                }
                dx_row[idx] = out;
            }
        }
    }
    float* partial = dw_partial + static_cast<int64_t>(blockIdx.x) * hidden;
    float* mine = blockDim.y == 1 ? partial : dw_smem + threadIdx.y * hidden;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        if (idx < n_vec) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) mine[idx * VEC + j] = static_cast<float>(dw[i][j]);
        }
    }
    if (blockDim.y == 1) return;
    __syncthreads();
    const int n_threads = blockDim.x * blockDim.y;
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < hidden; c += n_threads) {
        float total = 0.f;
        for (int g = 0; g < blockDim.y; ++g) total += dw_smem[g * hidden + c];
        partial[c] = total;
    }
}

#define PT_BWD_PARAMS                                                                                 \
    const T* __restrict__ dy, const T* __restrict__ x, const T* weight, const float* __restrict__ rstd_in, \
        const T* __restrict__ dsum, T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows,      \
        int hidden, bool zero_centered_gamma
#define PT_BWD_ARGS dy, x, weight, rstd_in, dsum, dx, dw_partial, rows, hidden, zero_centered_gamma

template <typename T, int VEC, int VPT>
__global__ void __launch_bounds__(kMaxThreadsPerRow) rmsnorm_bwd_kernel(PT_BWD_PARAMS) {
    rmsnorm_bwd_body<T, VEC, VPT, false>(PT_BWD_ARGS);
}

// VPT 2 + prefetch: the register cap sets the occupancy (80: 3 CTAs of 256 threads per SM at hidden
// 4096; A/B on H200: caps 64 (no prefetch room) and 72 (spills) measured 67-77% of copy, 80: 80-83%).
template <typename T, int VEC, bool EARLY_DSUM>
__global__ void __maxnreg__(80) rmsnorm_bwd_vpt2_kernel(PT_BWD_PARAMS) {
    rmsnorm_bwd_body<T, VEC, 2, true, EARLY_DSUM>(PT_BWD_ARGS);
}

// VPT 4 + prefetch for rows of kBwdVpt4MinVec..kBwdVpt4EndVec vectors: 128 registers, two CTAs per SM.
template <typename T, int VEC, bool EARLY_DSUM>
__global__ void __launch_bounds__(256, 2) rmsnorm_bwd_vpt4_kernel(PT_BWD_PARAMS) {
    rmsnorm_bwd_body<T, VEC, 4, true, EARLY_DSUM>(PT_BWD_ARGS);
}

// dweight[c] = sum_g partial[g, c]: a 32x32 CTA, coalesced over columns, fixed summation order,
// summed in fp64 (the buffer is small: grid x hidden floats; fp64 adds cost nothing here).
template <typename T>
__global__ void __launch_bounds__(1024) dweight_reduce_kernel(const float* __restrict__ partial,
                                                               T* __restrict__ dweight, int64_t groups,
                                                               int hidden) {
    __shared__ double tile[32][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (col < hidden)
        for (int64_t g = threadIdx.y; g < groups; g += 32) acc += static_cast<double>(partial[g * hidden + col]);
    tile[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < hidden) {
        double total = 0.0;
#pragma unroll
        for (int k = 0; k < 32; ++k) total += tile[k][threadIdx.x];
        dweight[col] = from_float<T>(static_cast<float>(total));
    }
}

template <typename T>
using BwdKernel = void (*)(const T*, const T*, const T*, const float*, const T*, T*, float*, int64_t, int, bool);

template <typename T>
BwdKernel<T> bwd_kernel_for(const Plan& p, bool has_dsum) {
    constexpr int kVec = 16 / sizeof(T);
    if (!p.vectorized) return rmsnorm_bwd_kernel<T, 1, kScalarVpt>;
    if (p.vpt == 2)
        return has_dsum ? rmsnorm_bwd_vpt2_kernel<T, kVec, true> : rmsnorm_bwd_vpt2_kernel<T, kVec, false>;
    if (p.bwd_vpt4_prefetch)
        return has_dsum ? rmsnorm_bwd_vpt4_kernel<T, kVec, true> : rmsnorm_bwd_vpt4_kernel<T, kVec, false>;
    return rmsnorm_bwd_kernel<T, kVec, kVecVpt>;  // rows > 2 x 512 vectors: no room for the prefetch
}

template <typename T>
cudaError_t bwd_typed(const void* dy, const void* x, const void* weight, const float* rstd, const void* dsum,
                      void* dx, void* dweight, float* workspace, int64_t rows, int64_t hidden, bool zcg,
                      const Plan& p, cudaStream_t stream) {
    auto kernel = bwd_kernel_for<T>(p, dsum != nullptr);
    const int grid = persistent_grid(kernel, p, rows);
    kernel<<<grid, dim3(p.tpr, p.rpc), p.smem, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(weight), rstd,
        static_cast<const T*>(dsum), static_cast<T*>(dx), workspace, rows, static_cast<int>(hidden), zcg);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    dweight_reduce_kernel<T><<<ceil_div_int(hidden, 32), dim3(32, 32), 0, stream>>>(
        workspace, static_cast<T*>(dweight), int64_t{grid}, static_cast<int>(hidden));
    return cudaGetLastError();
}

}  // namespace

int64_t rmsnorm_bwd_workspace_rows(int64_t rows, int64_t hidden, DType dtype, bool aligned) {
    if (rows == 0 || hidden == 0) return 0;
    const Plan p = make_plan(hidden, dtype, aligned, /*backward=*/true);
    // the larger grid of the two variants (their register caps are the same, so their grids are too)
    auto rows_for = [&](auto kernel_without, auto kernel_with) {
        return std::max(persistent_grid(kernel_without, p, rows), persistent_grid(kernel_with, p, rows));
    };
    switch (dtype) {
        case DType::kFloat32:
            return rows_for(bwd_kernel_for<float>(p, false), bwd_kernel_for<float>(p, true));
        case DType::kFloat16:
            return rows_for(bwd_kernel_for<__half>(p, false), bwd_kernel_for<__half>(p, true));
        default:
            return rows_for(bwd_kernel_for<__nv_bfloat16>(p, false), bwd_kernel_for<__nv_bfloat16>(p, true));
    }
}

cudaError_t rmsnorm_bwd_launch(const void* dy, const void* x, const void* weight, const float* rstd,
                               const void* dsum, void* dx, void* dweight, float* workspace, int64_t rows,
                               int64_t hidden, bool zero_centered_gamma, DType dtype, bool aligned,
                               cudaStream_t stream) {
    if (rows == 0 || hidden == 0) return cudaSuccess;  // the glue zero-fills dweight
    if (hidden > rmsnorm_max_hidden(hidden, dtype, aligned)) return cudaErrorInvalidValue;
    const Plan p = make_plan(hidden, dtype, aligned, /*backward=*/true);
    PT_DISPATCH_DTYPE(dtype, T, {
        return bwd_typed<T>(dy, x, weight, rstd, dsum, dx, dweight, workspace, rows, hidden, zero_centered_gamma,
                            p, stream);
    })
}

}  // namespace primus_turbo
