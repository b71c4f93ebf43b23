// RMSNorm forward / backward for Hopper (sm_90), memory-bound: the goal is copy bandwidth.
//
// Forward of rows of 256-1024 16-byte vectors that split evenly over the threads (bf16 2048-8192
// columns): rmsnorm_fwd_row_kernel, one row per CTA and a grid of one CTA per row. Other rows, and the
// backward, as follows.
//
// Work split: a "row group" of `tpr` threads owns one row at a time. tpr = 32 (one warp per row,
// 4 rows per 128-thread CTA, shuffle-only reduction) for short rows; otherwise one CTA per row
// (tpr <= 512 threads, shuffle + shared-memory reduction); the backward packs 256 / tpr row groups
// per CTA for rows of < 128 threads. Each thread holds <= VPT vectors of the
// row in registers, so x is read from HBM exactly once per pass. VEC elements = 16 bytes per access
// (LDG.128) when hidden % VEC == 0 and every pointer is 16-byte aligned, else scalar accesses with
// 8 elements per thread. CTAs loop over rows (grid = SMs x occupancy): in the backward this keeps
// the per-column dweight partial sums in registers across rows, summed over the CTA's row groups
// in shared memory, written once per CTA and reduced by a second kernel in a fixed order (no
// atomics: bitwise run-to-run reproducible).
//
// 512 threads max per row: the backward keeps x, dy (as T) and dweight partials (fp32) in
// registers, 60-128 regs/thread; __launch_bounds__(512) caps it at 128 (ptxas -v, nvcc 13.0: no
// spills except 8 B in the bf16 vectorized backward). The forward needs 40-64 (weight re-read from L1).
//
// Prefetch (H200, benchmark/NOTES.md): on the vectorized path a row group loads its NEXT row into a
// second register buffer before reducing and storing the current one (bwd 72-74% -> 80-83% of copy,
// fwd 82-87% -> 84-90%). Rows that fit use VPT 2; the VPT 2 backward is capped at 80 registers (3 CTAs
// of 256 per SM at hidden 4096). Not kept: dweight partials in shared memory (VPT 4 + prefetch), 76-78%.

#include <algorithm>
#include <type_traits>

#include "primus_turbo/common.h"
#include "primus_turbo/rmsnorm.h"

namespace primus_turbo {
namespace {

constexpr int kMaxThreadsPerRow = 512;
constexpr int kWarpRowsPerCta = 4;  // forward rows per CTA when tpr == 32
constexpr int kMaxRowsPerCta = 8;   // backward: rows per CTA = 256 / tpr (>= 256 threads), <= 8
constexpr int kBwdCtaThreads = 256;
constexpr int kVecVpt = 4;          // 16-byte vectors per thread (vectorized path)
constexpr int kScalarVpt = 8;       // elements per thread (scalar path)
constexpr int kRowKernelCtas = 2;   // rmsnorm_fwd_row_kernel: register cap for >= 2 CTAs of 512 per SM
// Backward rows of 819-1023 vectors (bf16 6552-8184 columns): VPT 2 at 80 registers fits one CTA per SM
constexpr int kBwdVpt4MinVec = 819, kBwdVpt4EndVec = 1024;

struct Plan {
    bool vectorized;
    int vec;  // elements per access
    int vpt;  // vectors per thread
    int tpr;  // threads per row
    int rpc;  // rows (row groups) per CTA
    size_t smem;  // dynamic shared memory (backward: dweight partials of the CTA's row groups)
    bool row_kernel;  // forward: rmsnorm_fwd_row_kernel (one row per CTA, exactly vpt vectors per thread)
    bool bwd_vpt4_prefetch;  // backward: rmsnorm_bwd_vpt4_kernel
};

int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

Plan make_plan(int64_t hidden, DType dtype, bool aligned, bool backward = false) {
    Plan p{};
    const int full_vec = 16 / dtype_size(dtype);
    p.vectorized = aligned && hidden % full_vec == 0;
    p.vec = p.vectorized ? full_vec : 1;
    p.vpt = p.vectorized ? kVecVpt : kScalarVpt;
    const int64_t n_vec = hidden / p.vec;
    if (p.vectorized && n_vec <= int64_t{kMaxThreadsPerRow} * 2) p.vpt = 2;  // the vectorized path prefetches
    const int64_t threads = std::max<int64_t>(32, ((n_vec + p.vpt - 1) / p.vpt + 31) / 32 * 32);
    p.tpr = static_cast<int>(std::min<int64_t>(threads, 1 << 20));
    p.rpc = p.tpr == 32 ? kWarpRowsPerCta : 1;
    p.smem = 0;
    // Rows of 256-1024 vectors (bf16 2048-8192 columns) that split exactly into 2 vectors per thread
    // (<= 512 vectors) or 4 (more): one row per CTA, rmsnorm_fwd_row_kernel. Its plan sweep on H200
    // (benchmark/results/h200/sweep_rmsnorm_csrc_*.txt): 96-99% of the same-size copy at 2048-8192
    // columns, against 90-96% for the persistent prefetching kernel; 1 or more than 4 vectors per
    // thread, or registers capped for more CTAs per SM, were slower.
    if (!backward && p.vectorized && n_vec >= 256 && n_vec <= 1024) {
        const int row_vpt = n_vec <= 512 ? 2 : 4;
        if (n_vec % (32 * row_vpt) == 0) {
            p.row_kernel = true;
            p.vpt = row_vpt;
            p.tpr = static_cast<int>(n_vec / row_vpt);
        }
    }
    if (backward) {
        // Plan sweep on H200 (sweep_rmsnorm_csrc_2edde60.txt, L2 flushed): at bf16 7168 columns VPT 4 with
        // the prefetch moved 82-88% of copy to 89-94% (8192: 86-94% -> 82-93%, kept at VPT 2); at 2048
        // columns one 128-thread row group per CTA (grid 792) moved 79-86% to 84-91% against two per CTA.
        if (p.vectorized && n_vec >= kBwdVpt4MinVec && n_vec < kBwdVpt4EndVec) {
            p.vpt = 4;
            p.tpr = static_cast<int>((n_vec + 4 * 32 - 1) / (4 * 32) * 32);
            p.bwd_vpt4_prefetch = true;
        }
        p.rpc = p.tpr >= 128 ? 1 : std::max(1, std::min(kMaxRowsPerCta, kBwdCtaThreads / p.tpr));
        // rpc > 1 only when tpr <= 128, so rpc * hidden <= 256 * 32 floats: <= 32 KB, under the 48 KB default.
        p.smem = p.rpc > 1 ? sizeof(float) * p.rpc * hidden : 0;
    }
    return p;
}

// Sum over the row group; `smem` is this row group's 32-float slice. tpr == 32: shuffles only (row
// groups of a CTA never synchronise, so they may run different row counts). tpr > 32: block-wide
// barriers, so every thread of the CTA must call it equally often (forward: one row group per CTA;
// backward: row groups walk rows in lock step).
__device__ __forceinline__ float row_sum(float v, float* smem) {
    v = warp_sum(v);
    if (blockDim.x == 32) return v;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    __syncthreads();  // smem may still be read by the previous row's reduction
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    return warp_sum(lane < n_warps ? smem[lane] : 0.f);
}

// Row buffers of the prefetch / VPT 2 kernels hold raw 16-byte words (uint4), read element-wise in place
// (bf16: a shift or mask of its 32-bit word): held as Vec<T, VEC>, the compiler splits the 16-bit
// elements into registers of their own right after the load, which waits for the load there (no
// prefetch) and doubles the registers of the row.
template <typename V>
using Raw = typename std::conditional<sizeof(V) == 16, uint4, V>::type;

template <typename T, int VEC>
__device__ __forceinline__ float elem(const Vec<T, VEC>& v, int j) {
    return to_float(v.v[j]);
}
template <typename T, int VEC>
__device__ __forceinline__ float elem(const uint4& raw, int j) {  // j: a constant after unrolling
    const int k = j * static_cast<int>(sizeof(T)) / 4;
    const uint32_t w = k == 0 ? raw.x : k == 1 ? raw.y : k == 2 ? raw.z : raw.w;
    if constexpr (sizeof(T) == 4) {
        return __uint_as_float(w);
    } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        return __uint_as_float(j & 1 ? w & 0xffff0000u : w << 16);
    } else {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(j & 1 ? w >> 16 : w & 0xffffu)));
    }
}

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

// One row per CTA, every thread holding exactly VPT 16-byte vectors of it (hidden == VEC * VPT *
// blockDim.x, which the plan checks): no bounds checks and no loop, a grid of `rows` CTAs that the
// hardware refills as CTAs retire, and __launch_bounds__(kMaxThreadsPerRow, MIN_CTAS) caps the
// registers so that MIN_CTAS CTAs of 512 threads fit on an SM. This is torch.compile's scheme for
// these rows (one row per program, a compile-time row length, num_stages 1: its forward moves 100-102%
// of the same-size copy at 7168 / 8192 columns) with the row held in registers instead of re-read from
// L2. The row is kept as raw 16-byte words (see Raw): 4 registers per vector, not 8. MIN_CTAS 2 (<= 64
// registers) measured best: a cap of 4 CTAs (32 registers) spills or serialises the loads.
template <typename T, int VPT, int MIN_CTAS, bool RESIDUAL>
__global__ void __launch_bounds__(kMaxThreadsPerRow, MIN_CTAS)
    rmsnorm_fwd_row_kernel(const T* __restrict__ x, const T* __restrict__ residual, const T* weight,
                           T* __restrict__ y, T* __restrict__ sum_out, float* __restrict__ rstd_out, int64_t rows,
                           int hidden, float eps, bool zero_centered_gamma) {
    constexpr int VEC = 16 / sizeof(T);
    using V = Vec<T, VEC>;
    __shared__ float smem[32];
    const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
    uint4 v[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i) v[i] = reinterpret_cast<const uint4*>(x + offset)[threadIdx.x + i * blockDim.x];
    if constexpr (RESIDUAL) {
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int idx = threadIdx.x + i * blockDim.x;
            const uint4 r = reinterpret_cast<const uint4*>(residual + offset)[idx];
            V s;
#pragma unroll
            for (int j = 0; j < VEC; ++j) s.v[j] = from_float<T>(elem<T, VEC>(v[i], j) + elem<T, VEC>(r, j));
            v[i] = *reinterpret_cast<const uint4*>(&s);
            reinterpret_cast<uint4*>(sum_out + offset)[idx] = v[i];
        }
    }
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int j = 0; j < VEC; ++j) sum_sq += elem<T, VEC>(v[i], j) * elem<T, VEC>(v[i], j);
    sum_sq = row_sum(sum_sq, smem);
    const float rstd = rsqrtf(sum_sq / hidden + eps);
    if (threadIdx.x == 0) rstd_out[blockIdx.x] = rstd;
    const float w_shift = zero_centered_gamma ? 1.f : 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        const uint4 w = reinterpret_cast<const uint4*>(weight)[idx];
        V out;
#pragma unroll
        for (int j = 0; j < VEC; ++j)
            out.v[j] = from_float<T>(elem<T, VEC>(v[i], j) * rstd * (elem<T, VEC>(w, j) + w_shift));
        reinterpret_cast<V*>(y + offset)[idx] = out;
    }
}

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
template <typename T, int VEC, int VPT, bool PREFETCH>
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
        const V* ds_row = dsum == nullptr ? nullptr : reinterpret_cast<const V*>(dsum + row * hidden);
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
            const int idx = threadIdx.x + i * blockDim.x;
            if (idx < n_vec) {
                const V w = reinterpret_cast<const V*>(weight)[idx];
                V ds;
                if (ds_row != nullptr) ds = ds_row[idx];
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
template <typename T, int VEC>
__global__ void __maxnreg__(80) rmsnorm_bwd_vpt2_kernel(PT_BWD_PARAMS) {
    rmsnorm_bwd_body<T, VEC, 2, true>(PT_BWD_ARGS);
}

// VPT 4 + prefetch for rows of kBwdVpt4MinVec..kBwdVpt4EndVec vectors: 128 registers, two CTAs per SM.
template <typename T, int VEC>
__global__ void __launch_bounds__(256, 2) rmsnorm_bwd_vpt4_kernel(PT_BWD_PARAMS) {
    rmsnorm_bwd_body<T, VEC, 4, true>(PT_BWD_ARGS);
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

// Persistent grid: at most the CTAs that are resident at once.
template <typename Kernel>
int persistent_grid(Kernel kernel, const Plan& p, int64_t rows) {
    int device = 0, sms = 132, per_sm = 1;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, p.tpr * p.rpc, p.smem);
    const int64_t needed = (rows + p.rpc - 1) / p.rpc;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, int64_t{sms} * std::max(per_sm, 1))));
}

// The instantiation a plan runs (one place, so the workspace size and the launch agree on the grid).
template <typename T>
using FwdKernel = void (*)(const T*, const T*, const T*, T*, T*, float*, int64_t, int, float, bool);
template <typename T>
using BwdKernel = void (*)(const T*, const T*, const T*, const float*, const T*, T*, float*, int64_t, int, bool);

template <typename T>
FwdKernel<T> fwd_kernel_for(const Plan& p, bool residual) {
    constexpr int kVec = 16 / sizeof(T);
    if (p.row_kernel && p.vpt == 2)
        return residual ? rmsnorm_fwd_row_kernel<T, 2, kRowKernelCtas, true>
                        : rmsnorm_fwd_row_kernel<T, 2, kRowKernelCtas, false>;
    if (p.row_kernel)
        return residual ? rmsnorm_fwd_row_kernel<T, 4, kRowKernelCtas, true>
                        : rmsnorm_fwd_row_kernel<T, 4, kRowKernelCtas, false>;
    if (!p.vectorized) return rmsnorm_fwd_kernel<T, 1, kScalarVpt, false>;
    if (p.vpt == 2)
        return residual ? rmsnorm_fwd_kernel<T, kVec, 2, true, true> : rmsnorm_fwd_kernel<T, kVec, 2, true, false>;
    return residual ? rmsnorm_fwd_kernel<T, kVec, kVecVpt, true, true>
                    : rmsnorm_fwd_kernel<T, kVec, kVecVpt, true, false>;
}

template <typename T>
BwdKernel<T> bwd_kernel_for(const Plan& p) {
    constexpr int kVec = 16 / sizeof(T);
    if (!p.vectorized) return rmsnorm_bwd_kernel<T, 1, kScalarVpt>;
    if (p.vpt == 2) return rmsnorm_bwd_vpt2_kernel<T, kVec>;
    if (p.bwd_vpt4_prefetch) return rmsnorm_bwd_vpt4_kernel<T, kVec>;
    return rmsnorm_bwd_kernel<T, kVec, kVecVpt>;  // rows > 2 x 512 vectors: no room for the prefetch
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

template <typename T>
cudaError_t bwd_typed(const void* dy, const void* x, const void* weight, const float* rstd, const void* dsum,
                      void* dx, void* dweight, float* workspace, int64_t rows, int64_t hidden, bool zcg,
                      const Plan& p, cudaStream_t stream) {
    auto kernel = bwd_kernel_for<T>(p);
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

int64_t rmsnorm_max_hidden(int64_t hidden, DType dtype, bool aligned) {
    const Plan p = make_plan(hidden, dtype, aligned);
    return int64_t{kMaxThreadsPerRow} * (p.vectorized ? kVecVpt : kScalarVpt) * p.vec;
}

#define PT_DISPATCH_DTYPE(dtype, T, ...)                  \
    switch (dtype) {                                      \
        case DType::kFloat32: {                           \
            using T = float;                              \
            __VA_ARGS__                                   \
        }                                                 \
        case DType::kFloat16: {                           \
            using T = __half;                             \
            __VA_ARGS__                                   \
        }                                                 \
        case DType::kBFloat16: {                          \
            using T = __nv_bfloat16;                      \
            __VA_ARGS__                                   \
        }                                                 \
        default:                                          \
            return cudaErrorInvalidValue;                 \
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

int64_t rmsnorm_bwd_workspace_rows(int64_t rows, int64_t hidden, DType dtype, bool aligned) {
    if (rows == 0 || hidden == 0) return 0;
    const Plan p = make_plan(hidden, dtype, aligned, /*backward=*/true);
    switch (dtype) {
        case DType::kFloat32:
            return persistent_grid(bwd_kernel_for<float>(p), p, rows);
        case DType::kFloat16:
            return persistent_grid(bwd_kernel_for<__half>(p), p, rows);
        default:
            return persistent_grid(bwd_kernel_for<__nv_bfloat16>(p), p, rows);
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
