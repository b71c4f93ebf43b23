// RMSNorm forward / backward for Hopper (sm_90), memory-bound: the goal is copy bandwidth.
//
// Forward of rows of 192-1024 16-byte vectors that split evenly over the threads (bf16 1536-8192
// columns): rmsnorm_fwd_row_kernel, one row per CTA and a grid of one CTA per row. Other rows, and the
// backward, as follows.
//
// Work split: a "row group" of `tpr` threads owns one row at a time. tpr = 32 (one warp per row,
// 4 rows per 128-thread CTA, shuffle-only reduction) for short rows; otherwise one CTA per row
// (tpr <= 512 threads, shuffle + shared-memory reduction); the backward packs 256 / tpr row groups
// per CTA for rows of <= 64 threads. Each thread holds <= VPT vectors of the
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
//
// This header holds what the forward (rmsnorm.cu) and the backward (rmsnorm_bwd.cu) share: the launch
// plan, the row reduction, the raw-vector element access and the persistent grid.
#pragma once

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
constexpr int kRowKernelCtas = 2;   // rmsnorm_fwd_row_kernel: registers capped for 2 CTAs of 512 per SM
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
    // Rows of 192-1024 vectors (bf16 1536-8192 columns) that split exactly into 2 vectors per thread:
    // one row per CTA, rmsnorm_fwd_row_kernel (two passes above 512 vectors). Its plan sweeps on H200
    // (benchmark/results/h200/sweep_rmsnorm_csrc_*.txt): 96-102% of the same-size copy, against 90-96%
    // for the persistent prefetching kernel (1536: 98-99% vs 93-94%; 1024 columns: a tie, 512: 76-82% vs
    // 93-96%, left to it); 1 vector a thread, or registers capped for more CTAs, slower.
    if (!backward && p.vectorized && n_vec >= 192 && n_vec <= 1024 && n_vec % 64 == 0) {
        p.row_kernel = true;
        p.vpt = 2;
        p.tpr = static_cast<int>(n_vec / 2);
    }
    if (backward) {
        // Plan sweep on H200 (sweep_rmsnorm_csrc_2edde60.txt, L2 flushed): at bf16 7168 columns VPT 4 with
        // the prefetch moved 82-88% of copy to 89-94% (8192: 86-94% -> 82-93%, kept at VPT 2); at 2048
        // columns one 128-thread row group per CTA (grid 792) moved 79-86% to 84-91% against two per CTA,
        // at 1536 one of 96 threads 76-79% to 82-87% (sweep_rmsnorm_csrc_9fd4943.txt; 512 / 1024: packed).
        if (p.vectorized && n_vec >= kBwdVpt4MinVec && n_vec < kBwdVpt4EndVec) {
            p.vpt = 4;
            p.tpr = static_cast<int>((n_vec + 4 * 32 - 1) / (4 * 32) * 32);
            p.bwd_vpt4_prefetch = true;
        }
        p.rpc = p.tpr > 64 ? 1 : std::max(1, std::min(kMaxRowsPerCta, kBwdCtaThreads / p.tpr));
        // rpc > 1 only when tpr <= 64, so rpc * hidden <= 256 * 16 floats: <= 16 KB, under the 48 KB default.
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

}  // namespace
}  // namespace primus_turbo

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
