// Row-wise FP8 quantization with the transposed, column-scaled copy (see primus_turbo/quantization.h), and
// the tensor-wise one with its transposed copy (one scale: the cast kernels below with TW).
//
// Two reads of x, two kernels after one memset of the amax workspace:
//  1. amax: each block reduces a tile to per-row and per-column maxima and folds them into the
//     workspace with integer atomicMax (non-negative floats order like their bit patterns, and max is
//     order independent: the result is deterministic). (Staging the tile in shared memory with cp.async
//     instead measured 29% slower on H200: results/h200/sweep_grouped_fp8_quant_88617d7.txt.)
//  2. cast: each block turns a tile into q (row scales, vector stores) and, through shared memory,
//     into qt = the transposed tile with column scales, and writes the scale_inv entries its first
//     row/column of tiles owns. 2-byte inputs with cols % 8 == 0, rows % 16 == 0 and 16-byte aligned
//     tensors (every MoE / Linear activation and weight) take rowcol_cast_tile_kernel: 128 x 128 tiles,
//     8 x 8 elements per thread, paired FP8 conversions, 8-byte swizzled shared stores and 128-byte
//     segments of q and qt; anything else the generic 64 x 64 byte-wise kernel.
// The point over the Triton version is the host: one C++ op call instead of four Python kernel
// launches (~0.2 ms of host time per call on the H100 hosts, benchmark/NOTES.md session 8).
#include "primus_turbo/common.h"
#include "primus_turbo/fp8_cast.h"
#include "primus_turbo/quantization.h"

namespace primus_turbo {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kAmaxRows = 128;   // rows per amax block, at least; up to 4x that on tall tensors (launch_vec)
constexpr int kAmaxBlocks = 4224;  // ~8 waves of 4 blocks on 132 SMs: a taller block only while the grid keeps this
constexpr int kUnroll = 4;  // rows a warp loads before reducing them (loads in flight)
constexpr int kTile = 64;
constexpr int kPitch = kTile + 4;  // bytes per shared row of the transposed tile: 2-way bank conflicts at most

// (kThreads, 4): at most 64 registers, four blocks per SM (71 registers and three blocks without the bound)
template <typename T, int VEC, int ROWS>
__global__ void __launch_bounds__(kThreads, 4)
    rowcol_amax_kernel(const T* __restrict__ x, unsigned* __restrict__ row_amax, unsigned* __restrict__ col_amax,
                       int64_t rows, int64_t cols) {
    constexpr int kCols = 32 * VEC;
    __shared__ float col_part[kWarps][kCols];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * ROWS;
    const int64_t c = static_cast<int64_t>(blockIdx.y) * kCols + lane * VEC;
    const bool col_ok = c < cols;  // VEC > 1 only when cols % VEC == 0: the whole vector is in range
    float cmax[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) cmax[j] = 0.0f;
    for (int base = 0; base < ROWS; base += kWarps * kUnroll) {
        Vec<T, VEC> v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t r = r0 + base + u * kWarps + warp;
            if (col_ok && r < rows) v[u] = *reinterpret_cast<const Vec<T, VEC>*>(x + r * cols + c);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t r = r0 + base + u * kWarps + warp;
            if (r >= rows) break;  // warp uniform
            float rmax = 0.0f;
            if (col_ok) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    const float a = finite_abs(to_float(v[u].v[j]));
                    rmax = fmaxf(rmax, a);
                    cmax[j] = fmaxf(cmax[j], a);
                }
            }
            rmax = warp_max(rmax);
            if (lane == 0 && rmax > 0.0f) atomicMax(row_amax + r, __float_as_uint(rmax));
        }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) col_part[warp][lane * VEC + j] = cmax[j];
    __syncthreads();
    for (int i = threadIdx.x; i < kCols; i += kThreads) {
        float m = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m = fmaxf(m, col_part[w][i]);
        const int64_t col = static_cast<int64_t>(blockIdx.y) * kCols + i;
        if (col < cols && m > 0.0f) atomicMax(col_amax + col, __float_as_uint(m));
    }
}

// Row / column scale of one tile: TW (tensor-wise) reads the one amax word for every row and column.
template <bool TW>
__device__ __forceinline__ float tile_scale(const unsigned* amax, int64_t i, int64_t n, float fp8_max, bool pow2) {
    const float a = TW ? __uint_as_float(amax[0]) : (i < n ? __uint_as_float(amax[i]) : 0.0f);
    return fp8_scale_from_amax(a, fp8_max, pow2);
}

// VEC_T: qt rows are written as 16-byte vectors (rows % 16 == 0 and qt 16-byte aligned). TW: one scale
// for the tensor (row_amax = col_amax = its amax word; block (0, 0) writes scale_inv[0] only).
template <typename T, int VEC, bool E5M2, bool VEC_T, bool TW>
__global__ void __launch_bounds__(kThreads)
    rowcol_cast_kernel(const T* __restrict__ x, const unsigned* __restrict__ row_amax,
                       const unsigned* __restrict__ col_amax, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                       float* __restrict__ scale_inv, float* __restrict__ scale_inv_t, int64_t rows, int64_t cols,
                       bool pow2) {
    constexpr float kMax = fp8_max_of<E5M2>();
    constexpr int kVecPerRow = kTile / VEC;
    __shared__ float rscale[kTile], cscale[kTile];
    __shared__ __align__(16) uint8_t tile_t[kTile * kPitch];  // [col][row] of this tile
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTile, c0 = static_cast<int64_t>(blockIdx.y) * kTile;
    if (threadIdx.x < kTile) {
        const int64_t r = r0 + threadIdx.x;
        const float s = tile_scale<TW>(row_amax, r, rows, kMax, pow2);
        rscale[threadIdx.x] = s;
        if (TW ? (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) : (blockIdx.y == 0 && r < rows))
            scale_inv[TW ? 0 : r] = __fdiv_rn(1.0f, s);
    } else if (threadIdx.x < 2 * kTile) {
        const int i = threadIdx.x - kTile;
        const int64_t c = c0 + i;
        const float s = tile_scale<TW>(col_amax, c, cols, kMax, pow2);
        cscale[i] = s;
        if (!TW && blockIdx.x == 0 && c < cols) scale_inv_t[c] = __fdiv_rn(1.0f, s);
    }
    __syncthreads();
#pragma unroll
    for (int idx = threadIdx.x; idx < kTile * kVecPerRow; idx += kThreads) {
        const int i = idx / kVecPerRow, jv = idx % kVecPerRow;
        const int64_t r = r0 + i, c = c0 + jv * VEC;
        if (r < rows && c < cols) {
            const Vec<T, VEC> v = *reinterpret_cast<const Vec<T, VEC>*>(x + r * cols + c);
            Vec<uint8_t, VEC> out;
            const float rs = rscale[i];
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float f = to_float(v.v[j]);
                out.v[j] = to_fp8<E5M2>(f, rs, kMax);
                tile_t[(jv * VEC + j) * kPitch + i] = to_fp8<E5M2>(f, cscale[jv * VEC + j], kMax);
            }
            *reinterpret_cast<Vec<uint8_t, VEC>*>(q + r * cols + c) = out;
        }
    }
    __syncthreads();
    if constexpr (VEC_T) {  // 64 columns x 4 chunks of 16 rows: one 16-byte store per thread
        const int ci = threadIdx.x / 4, chunk = threadIdx.x % 4;
        const int64_t c = c0 + ci, r = r0 + chunk * 16;
        if (c < cols && r < rows) {  // rows % 16 == 0: the whole chunk is in range
            const auto* src = reinterpret_cast<const uint32_t*>(tile_t + ci * kPitch + chunk * 16);
            *reinterpret_cast<uint4*>(qt + c * rows + r) = make_uint4(src[0], src[1], src[2], src[3]);
        }
    } else {
        for (int idx = threadIdx.x; idx < kTile * kTile; idx += kThreads) {
            const int ci = idx / kTile, ri = idx % kTile;
            if (c0 + ci < cols && r0 + ri < rows) qt[(c0 + ci) * rows + r0 + ri] = tile_t[ci * kPitch + ri];
        }
    }
}

constexpr int kBig = 128;             // rowcol_cast_tile_kernel's tile: kBig x kBig elements
constexpr int kSlots = kBig / 8;      // 8-row slots per column of the transposed tile
static_assert(kThreads == kSlots * kSlots, "one thread per 8 x 8 sub-tile");

// Thread (ty, tx) owns rows ty*8.. and columns tx*8.. of the tile. Its q rows go straight to global
// memory (a warp writes two 128-byte row segments); its eight 8-row column pieces of qt go to shared
// memory as 8-byte words, slot ty of column c stored at slot ty ^ (c / 8) so that a half-warp's
// stores hit 16 distinct 8-byte bank pairs; then each column leaves as eight 16-byte chunks.
template <typename T, bool E5M2, bool TW>
__global__ void __launch_bounds__(kThreads, 4)  // <= 64 registers: 4 blocks, 128 KB of loads in flight per SM
    rowcol_cast_tile_kernel(const T* __restrict__ x, const unsigned* __restrict__ row_amax,
                            const unsigned* __restrict__ col_amax, uint8_t* __restrict__ q,
                            uint8_t* __restrict__ qt, float* __restrict__ scale_inv,
                            float* __restrict__ scale_inv_t, int64_t rows, int64_t cols, bool pow2) {
    constexpr float kMax = fp8_max_of<E5M2>();
    __shared__ float rscale[kBig], cscale[kBig];
    __shared__ uint2 tile_t[kBig * kSlots];  // [column][swizzled 8-row slot]
    const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kBig, c0 = static_cast<int64_t>(blockIdx.y) * kBig;
    const int t = threadIdx.x;
    if (t < kBig) {
        const int64_t r = r0 + t;
        const float s = tile_scale<TW>(row_amax, r, rows, kMax, pow2);
        rscale[t] = s;
        if (TW ? (blockIdx.x == 0 && blockIdx.y == 0 && t == 0) : (blockIdx.y == 0 && r < rows))
            scale_inv[TW ? 0 : r] = __fdiv_rn(1.0f, s);
    } else {
        const int i = t - kBig;
        const int64_t c = c0 + i;
        const float s = tile_scale<TW>(col_amax, c, cols, kMax, pow2);
        cscale[i] = s;
        if (!TW && blockIdx.x == 0 && c < cols) scale_inv_t[c] = __fdiv_rn(1.0f, s);
    }
    __syncthreads();
    const int tx = t % kSlots, ty = t / kSlots;
    const int64_t rb = r0 + ty * 8, cb = c0 + tx * 8;
    if (rb < rows && cb < cols) {  // rows % 16 == 0 and cols % 8 == 0: the whole 8 x 8 piece is in range
        Vec<T, 8> v[8];  // 64 inputs in 32 registers, widened to float where used
#pragma unroll
        for (int r = 0; r < 8; ++r) v[r] = *reinterpret_cast<const Vec<T, 8>*>(x + (rb + r) * cols + cb);
        auto f = [&](int r, int j, float s) { return to_float(v[r].v[j]) * s; };
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            const float s = rscale[ty * 8 + r];
            const uint32_t lo = fp8x4<E5M2>(f(r, 0, s), f(r, 1, s), f(r, 2, s), f(r, 3, s));
            const uint32_t hi = fp8x4<E5M2>(f(r, 4, s), f(r, 5, s), f(r, 6, s), f(r, 7, s));
            *reinterpret_cast<uint2*>(q + (rb + r) * cols + cb) = make_uint2(lo, hi);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float s = cscale[tx * 8 + j];
            const uint32_t lo = fp8x4<E5M2>(f(0, j, s), f(1, j, s), f(2, j, s), f(3, j, s));
            const uint32_t hi = fp8x4<E5M2>(f(4, j, s), f(5, j, s), f(6, j, s), f(7, j, s));
            tile_t[(tx * 8 + j) * kSlots + (ty ^ tx)] = make_uint2(lo, hi);
        }
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < kBig * kSlots / 2 / kThreads; ++it) {  // 16-byte chunks: 16 rows of one column
        const int id = it * kThreads + t, c = id / (kSlots / 2), h = id % (kSlots / 2);
        const int64_t col = c0 + c, row = r0 + 16 * h;
        if (col < cols && row < rows) {
            const int sw = c / 8;  // the storing thread's tx: logical slots 2h, 2h+1 sit at 2h ^ sw, 2h+1 ^ sw
            uint4 v = *reinterpret_cast<const uint4*>(&tile_t[c * kSlots + ((2 * h) ^ (sw & ~1))]);
            if (sw & 1) v = make_uint4(v.z, v.w, v.x, v.y);
            *reinterpret_cast<uint4*>(qt + col * rows + row) = v;
        }
    }
}

// ws: the row amaxes then the column amaxes, or (TW) the one tensor amax
template <typename T, int VEC, bool E5M2, bool TW>
cudaError_t launch_cast(const T* x, const unsigned* ws, uint8_t* q, uint8_t* qt, float* sinv, float* sinv_t,
                        int64_t rows, int64_t cols, bool pow2, bool vec_t, cudaStream_t stream) {
    const dim3 grid(ceil_div_int(rows, kTile), ceil_div_int(cols, kTile));
    const unsigned* col_ws = TW ? ws : ws + rows;
    if (vec_t)
        rowcol_cast_kernel<T, VEC, E5M2, true, TW>
            <<<grid, kThreads, 0, stream>>>(x, ws, col_ws, q, qt, sinv, sinv_t, rows, cols, pow2);
    else
        rowcol_cast_kernel<T, VEC, E5M2, false, TW>
            <<<grid, kThreads, 0, stream>>>(x, ws, col_ws, q, qt, sinv, sinv_t, rows, cols, pow2);
    return cudaGetLastError();
}

// The cast pass of both granularities: the 128 x 128 tile kernel where it applies, else the generic one.
template <typename T, int VEC, bool TW>
cudaError_t launch_casts(const T* x, const unsigned* ws, uint8_t* q, uint8_t* qt, float* sinv, float* sinv_t,
                         int64_t rows, int64_t cols, bool e5m2, bool pow2, bool vec_t, cudaStream_t stream) {
    if constexpr (sizeof(T) == 2 && VEC == 8) {  // cols % 8 == 0, 16-byte aligned
        if (vec_t) {                               // rows % 16 == 0
            const dim3 tiles(ceil_div_int(rows, kBig), ceil_div_int(cols, kBig));
            const unsigned* col_ws = TW ? ws : ws + rows;
            if (e5m2)
                rowcol_cast_tile_kernel<T, true, TW>
                    <<<tiles, kThreads, 0, stream>>>(x, ws, col_ws, q, qt, sinv, sinv_t, rows, cols, pow2);
            else
                rowcol_cast_tile_kernel<T, false, TW>
                    <<<tiles, kThreads, 0, stream>>>(x, ws, col_ws, q, qt, sinv, sinv_t, rows, cols, pow2);
            return cudaGetLastError();
        }
    }
    if (e5m2) return launch_cast<T, VEC, true, TW>(x, ws, q, qt, sinv, sinv_t, rows, cols, pow2, vec_t, stream);
    return launch_cast<T, VEC, false, TW>(x, ws, q, qt, sinv, sinv_t, rows, cols, pow2, vec_t, stream);
}

template <typename T, int VEC>
cudaError_t launch_vec(const void* xp, void* qp, void* qtp, float* sinv, float* sinv_t, unsigned* ws, int64_t rows,
                       int64_t cols, bool e5m2, bool pow2, bool vec_t, cudaStream_t stream) {
    const T* x = static_cast<const T*>(xp);
    // Each block's loads ramp up and drain once: on tall tensors (a grouped weight, 100k+ rows) blocks of
    // up to 4 x kAmaxRows rows amortize that while the grid still fills ~8 waves
    const int64_t col_blocks = ceil_div_int(cols, 32 * VEC);
    int rows_per_block = kAmaxRows;
    while (rows_per_block < 4 * kAmaxRows && ceil_div_int(rows, 2 * rows_per_block) * col_blocks >= kAmaxBlocks)
        rows_per_block *= 2;
    const dim3 grid(ceil_div_int(rows, rows_per_block), col_blocks);
    if (grid.y > 65535 || ceil_div_int(cols, kTile) > 65535) return cudaErrorInvalidConfiguration;
    if (rows_per_block == 4 * kAmaxRows)
        rowcol_amax_kernel<T, VEC, 4 * kAmaxRows><<<grid, kThreads, 0, stream>>>(x, ws, ws + rows, rows, cols);
    else if (rows_per_block == 2 * kAmaxRows)
        rowcol_amax_kernel<T, VEC, 2 * kAmaxRows><<<grid, kThreads, 0, stream>>>(x, ws, ws + rows, rows, cols);
    else
        rowcol_amax_kernel<T, VEC, kAmaxRows><<<grid, kThreads, 0, stream>>>(x, ws, ws + rows, rows, cols);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    return launch_casts<T, VEC, false>(x, ws, static_cast<uint8_t*>(qp), static_cast<uint8_t*>(qtp), sinv, sinv_t,
                                       rows, cols, e5m2, pow2, vec_t, stream);
}

template <typename T>
cudaError_t tw_casts(const void* xp, void* qp, void* qtp, float* sinv, const unsigned* ws, int64_t rows,
                     int64_t cols, bool e5m2, bool pow2, bool aligned, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    const T* x = static_cast<const T*>(xp);
    auto* q = static_cast<uint8_t*>(qp);
    auto* qt = static_cast<uint8_t*>(qtp);
    const bool vec_t = aligned && rows % 16 == 0;
    if (aligned && cols % kVec == 0)
        return launch_casts<T, kVec, true>(x, ws, q, qt, sinv, sinv, rows, cols, e5m2, pow2, vec_t, stream);
    return launch_casts<T, 1, true>(x, ws, q, qt, sinv, sinv, rows, cols, e5m2, pow2, vec_t, stream);
}

template <typename T>
cudaError_t launch_dtype(const void* x, void* q, void* qt, float* sinv, float* sinv_t, unsigned* ws, int64_t rows,
                         int64_t cols, bool e5m2, bool pow2, bool aligned, cudaStream_t stream) {
    constexpr int kVec = 16 / sizeof(T);
    const bool vec_t = aligned && rows % 16 == 0;
    if (aligned && cols % kVec == 0)
        return launch_vec<T, kVec>(x, q, qt, sinv, sinv_t, ws, rows, cols, e5m2, pow2, vec_t, stream);
    return launch_vec<T, 1>(x, q, qt, sinv, sinv_t, ws, rows, cols, e5m2, pow2, vec_t, stream);
}

}  // namespace

cudaError_t quantize_rowwise_transpose_fp8_launch(const void* x, void* q, void* qt, float* scale_inv,
                                                  float* scale_inv_t, void* workspace, int64_t rows, int64_t cols,
                                                  DType dtype, bool e5m2, bool pow2, bool aligned,
                                                  cudaStream_t stream) {
    if (rows == 0 || cols == 0) return cudaSuccess;
    auto* ws = static_cast<unsigned*>(workspace);
    const cudaError_t err = cudaMemsetAsync(ws, 0, static_cast<size_t>(rows + cols) * sizeof(unsigned), stream);
    if (err != cudaSuccess) return err;
    switch (dtype) {
        case DType::kFloat32:
            return launch_dtype<float>(x, q, qt, scale_inv, scale_inv_t, ws, rows, cols, e5m2, pow2, aligned, stream);
        case DType::kFloat16:
            return launch_dtype<__half>(x, q, qt, scale_inv, scale_inv_t, ws, rows, cols, e5m2, pow2, aligned, stream);
        case DType::kBFloat16:
            return launch_dtype<__nv_bfloat16>(x, q, qt, scale_inv, scale_inv_t, ws, rows, cols, e5m2, pow2, aligned,
                                               stream);
    }
    return cudaErrorInvalidValue;
}

cudaError_t quantize_tensorwise_transpose_fp8_launch(const void* x, void* q, void* qt, float* scale_inv,
                                                     void* workspace, int64_t rows, int64_t cols, DType dtype,
                                                     bool e5m2, bool pow2, bool aligned, cudaStream_t stream) {
    auto* amax = static_cast<unsigned*>(workspace);
    const cudaError_t err = tensor_amax_fp8_launch(x, amax, rows * cols, dtype, aligned, stream);
    if (err != cudaSuccess || rows == 0 || cols == 0) return err;
    if (ceil_div_int(cols, kTile) > 65535) return cudaErrorInvalidConfiguration;
    switch (dtype) {
        case DType::kFloat32:
            return tw_casts<float>(x, q, qt, scale_inv, amax, rows, cols, e5m2, pow2, aligned, stream);
        case DType::kFloat16:
            return tw_casts<__half>(x, q, qt, scale_inv, amax, rows, cols, e5m2, pow2, aligned, stream);
        case DType::kBFloat16:
            return tw_casts<__nv_bfloat16>(x, q, qt, scale_inv, amax, rows, cols, e5m2, pow2, aligned, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace primus_turbo
