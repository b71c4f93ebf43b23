// Launch-plan sweep of the TURBO (csrc) RMSNorm kernels, bf16 (a diagnosis tool, not a benchmark of
// record). It includes csrc/kernels/normalization/rmsnorm{,_bwd}.cu, so it times the shipped kernels under
// plans other than make_plan()'s, and checks every plan's output against the shipped plan's.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc/include benchmark/ops/sweep_rmsnorm_csrc.cu -o /tmp/sweep_rms
//   /tmp/sweep_rms [rows x hidden ...]       (default: the bench_rmsnorm shapes)
//   SWEEP_HINTS=1 /tmp/sweep_rms ...          (only the forward cache-hint rounds, 4 vectors a thread)
//
// Timing as triton.testing.do_bench: per call, a 256 MB memset flushes L2, then CUDA events around the
// call alone; the median of 60 calls. GB/s counts each input read and each output written once.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../csrc/kernels/normalization/rmsnorm.cu"
#include "../../csrc/kernels/normalization/rmsnorm_bwd.cu"

using primus_turbo::Plan;
using T = __nv_bfloat16;
constexpr int kVec = 8;

#define CK(x)                                                                              \
    do {                                                                                   \
        cudaError_t e = (x);                                                               \
        if (e != cudaSuccess) {                                                            \
            std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
            std::exit(1);                                                                  \
        }                                                                                  \
    } while (0)

static void* g_flush = nullptr;
static double g_copy_gbps = 1.0;

template <typename F>
float median_ms(F launch) {
    std::vector<float> ms;
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 70; ++i) {
        CK(cudaMemsetAsync(g_flush, i, 256 << 20));
        CK(cudaEventRecord(a));
        launch();
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float t = 0.f;
        CK(cudaEventElapsedTime(&t, a, b));
        if (i >= 10) ms.push_back(t);
    }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

template <typename K>
int grid_for(K kernel, int threads, size_t smem, int64_t rows, int rpc, double scale) {
    int sms = 0, per_sm = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    const int64_t needed = (rows + rpc - 1) / rpc;
    const int64_t g = static_cast<int64_t>(sms * std::max(per_sm, 1) * scale);
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(needed, g)));
}

bool same(const T* a, const T* b, size_t n) {
    std::vector<uint16_t> ha(n), hb(n);
    CK(cudaMemcpy(ha.data(), a, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, n * 2, cudaMemcpyDeviceToHost));
    return std::memcmp(ha.data(), hb.data(), n * 2) == 0;
}

__global__ void fill_kernel(T* p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        uint32_t h = (uint32_t(i) ^ seed) * 2654435761u;
        h ^= h >> 13;
        p[i] = __float2bfloat16((h & 0xffff) / 32768.f - 1.f);
    }
}

template <int VPT, bool PF>
void fwd_variant(const char* name, int64_t rows, int hidden, T* x, T* w, T* y, T* y_ref, float* rstd,
                 double copy_gbps, double scale) {
    auto kernel = primus_turbo::rmsnorm_fwd_kernel<T, kVec, VPT, PF, false>;
    const int n_vec = hidden / kVec;
    int tpr = std::max(32, ((n_vec + VPT - 1) / VPT + 31) / 32 * 32);
    if (tpr > 512) return;
    const int rpc = tpr == 32 ? 4 : 1;
    const int grid = grid_for(kernel, tpr * rpc, 0, rows, rpc, scale);
    auto go = [&] { kernel<<<grid, dim3(tpr, rpc)>>>(x, nullptr, w, y, nullptr, rstd, rows, hidden, 1e-6f, false); };
    CK(cudaMemset(y, 0, rows * hidden * 2));
    go();
    const bool ok = same(y, y_ref, size_t(rows) * hidden);
    const float ms = median_ms(go);
    const double gbps = (2.0 * rows * hidden * 2 + rows * 4) / ms / 1e6;
    std::printf("| fwd %s VPT%d PF%d tpr%d rpc%d grid%d | %.1f | %.0f | %s |\n", name, VPT, int(PF), tpr, rpc, grid,
                ms * 1e3, 100 * gbps / copy_gbps, ok ? "ok" : "MISMATCH");
}

// rmsnorm_fwd_row_kernel (one row per CTA, exactly 2 vectors per thread), one pass or two. Until session 22
// it also took 4 or 8 vectors a thread under register caps of 1-4 CTAs of 512 per SM: all slower or
// equal (sweep_rmsnorm_csrc_{3f1d412,bd57f04,2edde60}.txt); the one-pass 4-vector kernel is "plain" below.
template <bool TWO_PASS>
void fwd_row_variant(int64_t rows, int hidden, T* x, T* w, T* y, T* y_ref, float* rstd, double copy_gbps) {
    auto kernel = primus_turbo::rmsnorm_fwd_row_kernel<T, TWO_PASS, false>;
    const int n_vec = hidden / kVec;
    if (n_vec % 64 != 0 || n_vec / 2 > 512) return;
    const int tpr = n_vec / 2;
    auto go = [&] { kernel<<<rows, tpr>>>(x, nullptr, w, y, nullptr, rstd, rows, hidden, 1e-6f, false); };
    CK(cudaMemset(y, 0, rows * hidden * 2));
    go();
    const bool ok = same(y, y_ref, size_t(rows) * hidden);
    const float ms = median_ms(go);
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, tpr, 0));
    const double gbps = (2.0 * rows * hidden * 2 + rows * 4) / ms / 1e6;
    std::printf("| fwd row kernel %s tpr%d (%d CTAs/SM) | %.1f | %.0f | %s |\n", TWO_PASS ? "two-pass" : "one-pass",
                tpr, per_sm, ms * 1e3, 100 * gbps / copy_gbps, ok ? "ok" : "MISMATCH");
}

// The forward row kernel (no residual) with cache hints (session 22): LOAD 0 plain, 1 __ldcs (evict-first),
// 2 __ldcg (L2 only), 3 ld.global.nc.L1::no_allocate; STORE 0 plain, 1 __stcs (streaming), 2 __stcg.
// torch.compile's forward moves 100-102% of the copy at 7168 / 8192 columns against this kernel's 96-98%.
template <int LOAD>
__device__ __forceinline__ uint4 load_hint(const uint4* p) {
    if constexpr (LOAD == 1) return __ldcs(p);
    if constexpr (LOAD == 2) return __ldcg(p);
    if constexpr (LOAD == 3) {
        uint4 v;
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
        return v;
    }
    return *p;
}
template <int STORE>
__device__ __forceinline__ void store_hint(uint4* p, uint4 v) {
    if constexpr (STORE == 1) {
        __stcs(p, v);
    } else if constexpr (STORE == 2) {
        __stcg(p, v);
    } else {
        *p = v;
    }
}

template <int VPT, int LOAD, int STORE>
__global__ void __launch_bounds__(512, 2) fwd_hint_kernel(const T* __restrict__ x, const T* w, T* __restrict__ y,
                                                          float* __restrict__ rstd_out, int hidden, float eps) {
    using V = primus_turbo::Vec<T, kVec>;
    __shared__ float smem[32];
    const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
    uint4 v[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
        v[i] = load_hint<LOAD>(reinterpret_cast<const uint4*>(x + offset) + threadIdx.x + i * blockDim.x);
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i)
#pragma unroll
        for (int j = 0; j < kVec; ++j)
            sum_sq += primus_turbo::elem<T, kVec>(v[i], j) * primus_turbo::elem<T, kVec>(v[i], j);
    sum_sq = primus_turbo::row_sum(sum_sq, smem);
    const float rstd = rsqrtf(sum_sq / hidden + eps);
    if (threadIdx.x == 0) rstd_out[blockIdx.x] = rstd;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        const uint4 wv = reinterpret_cast<const uint4*>(w)[idx];
        V out;
#pragma unroll
        for (int j = 0; j < kVec; ++j)
            out.v[j] = primus_turbo::from_float<T>(primus_turbo::elem<T, kVec>(v[i], j) * rstd *
                                                   primus_turbo::elem<T, kVec>(wv, j));
        store_hint<STORE>(reinterpret_cast<uint4*>(y + offset) + idx, *reinterpret_cast<const uint4*>(&out));
    }
}

// torch.compile's two-pass scheme was measured here as fwd_2pass_kernel (plain loads, L2 hints, L1 + L2 hints;
// 2 or 4 vectors a thread; sweep_2pass_a3b2942.txt) and shipped as rmsnorm_fwd_row_kernel<T, true, ...>.

// Hint variants of the one-pass 4-vector row kernel (shipped until session 22) against the shipped plan,
// interleaved over 3 rounds (rows of 513-1024 vectors). Result: all slower or equal (sweep_hints_9f320db.txt).
void fwd_hint_variants(int64_t rows, int hidden, T* x, T* w, T* y, T* y_ref, float* rstd, double copy_gbps) {
    const int n_vec = hidden / kVec;
    if (n_vec <= 512 || n_vec > 1024 || n_vec % 128 != 0) return;
    const int tpr = n_vec / 4;
    using K = void (*)(const T*, const T*, T*, float*, int, float);
    const std::pair<const char*, K> variants[] = {
        {"plain", fwd_hint_kernel<4, 0, 0>},       {"ldcs", fwd_hint_kernel<4, 1, 0>},
        {"ldcg", fwd_hint_kernel<4, 2, 0>},        {"nc.no_allocate", fwd_hint_kernel<4, 3, 0>},
        {"stcs", fwd_hint_kernel<4, 0, 1>},        {"stcg", fwd_hint_kernel<4, 0, 2>},
        {"ldcs+stcs", fwd_hint_kernel<4, 1, 1>},   {"no_allocate+stcs", fwd_hint_kernel<4, 3, 1>},
    };
    for (int round = 0; round < 3; ++round) {
        const float ship_ms = median_ms([&] {
            CK(primus_turbo::rmsnorm_fwd_launch(x, nullptr, w, y, nullptr, rstd, rows, hidden, 1e-6f, false,
                                                primus_turbo::DType::kBFloat16, true, 0));
        });
        std::printf("| fwd hints round %d: shipped | %.1f | %.0f | |\n", round, ship_ms * 1e3,
                    100 * (4.0 * rows * hidden) / ship_ms / 1e6 / copy_gbps);
        for (const auto& [name, kernel] : variants) {
            auto go = [&, kernel = kernel] { kernel<<<rows, tpr>>>(x, w, y, rstd, hidden, 1e-6f); };
            CK(cudaMemset(y, 0, rows * hidden * 2));
            go();
            const bool ok = same(y, y_ref, size_t(rows) * hidden);
            const float ms = median_ms(go);
            std::printf("| fwd hints round %d: %s | %.1f | %.0f | %s |\n", round, name, ms * 1e3,
                        100 * (4.0 * rows * hidden) / ms / 1e6 / copy_gbps, ok ? "ok" : "MISMATCH");
        }
    }
}

// dweight_reduce_kernel with UNROLL independent accumulators per thread (UNROLL loads in flight instead of
// one), summed in a fixed order: still deterministic (session 22).
// PDL: launched as a programmatic dependent of the backward kernel (griddepcontrol.wait before any read of
// the partials), so its launch overlaps that kernel's tail.
template <int UNROLL, bool PDL = false>
__global__ void __launch_bounds__(1024) reduce_unrolled_kernel(const float* __restrict__ partial,
                                                               T* __restrict__ dweight, int64_t groups,
                                                               int hidden) {
    if constexpr (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
    __shared__ double tile[32][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    double acc[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc[u] = 0.0;
    if (col < hidden) {
        int64_t g = threadIdx.y;
        for (; g + 32 * (UNROLL - 1) < groups; g += 32 * UNROLL) {
            float v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) v[u] = partial[(g + 32 * u) * hidden + col];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc[u] += static_cast<double>(v[u]);
        }
        for (; g < groups; g += 32) acc[0] += static_cast<double>(partial[g * hidden + col]);
    }
    double mine = 0.0;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) mine += acc[u];
    tile[threadIdx.y][threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.y == 0 && col < hidden) {
        double total = 0.0;
#pragma unroll
        for (int k = 0; k < 32; ++k) total += tile[k][threadIdx.x];
        dweight[col] = primus_turbo::from_float<T>(static_cast<float>(total));
    }
}

// The dweight reduction alone (shipped and unrolled) over the shipped plan's partial rows; then the whole
// backward (shipped kernel) with the reduction launched plainly or as a programmatic dependent (PDL).
void reduce_rows(int64_t rows, int hidden, T* dy, T* x, T* w, float* rstd, T* dx, T* dw, float* ws) {
    const primus_turbo::Plan p = primus_turbo::make_plan(hidden, primus_turbo::DType::kBFloat16, true, true);
    auto main_kernel = primus_turbo::bwd_kernel_for<T>(p, false);
    const int groups = primus_turbo::persistent_grid(main_kernel, p, rows);
    const dim3 grid((hidden + 31) / 32), block(32, 32);
    const float ship =
        median_ms([&] { primus_turbo::dweight_reduce_kernel<T><<<grid, block>>>(ws, dw, groups, hidden); });
    const float u4 = median_ms([&] { reduce_unrolled_kernel<4><<<grid, block>>>(ws, dw, groups, hidden); });
    const float u8 = median_ms([&] { reduce_unrolled_kernel<8><<<grid, block>>>(ws, dw, groups, hidden); });
    std::printf("| bwd dweight reduction alone (%d partial rows): shipped / unroll 4 / unroll 8 | %.1f / %.1f / "
                "%.1f | | |\n", groups, ship * 1e3, u4 * 1e3, u8 * 1e3);
    auto launch_main = [&] {
        main_kernel<<<groups, dim3(p.tpr, p.rpc), p.smem>>>(dy, x, w, rstd, nullptr, dx, ws, rows, hidden, false);
    };
    const float plain = median_ms([&] {
        launch_main();
        reduce_unrolled_kernel<4><<<grid, block>>>(ws, dw, groups, hidden);
    });
    const float pdl = median_ms([&] {
        launch_main();
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        CK(cudaLaunchKernelEx(&cfg, reduce_unrolled_kernel<4, true>, static_cast<const float*>(ws), dw,
                              static_cast<int64_t>(groups), hidden));
    });
    // check: the PDL reduction's dweight equals the shipped reduction's over the same partials
    T* dw_ref = nullptr;
    CK(cudaMalloc(&dw_ref, hidden * 2));
    primus_turbo::dweight_reduce_kernel<T><<<grid, block>>>(ws, dw_ref, groups, hidden);
    const bool ok = same(dw, dw_ref, hidden);
    CK(cudaFree(dw_ref));
    const double bytes = 3.0 * rows * hidden * 2 + rows * 4;
    std::printf("| bwd shipped kernel + reduction (unroll 4): plain / PDL | %.1f / %.1f | %.0f / %.0f | %s |\n",
                plain * 1e3, pdl * 1e3, 100 * bytes / plain / 1e6 / g_copy_gbps, 100 * bytes / pdl / 1e6 / g_copy_gbps,
                ok ? "ok" : "MISMATCH");
}

// The residual backward (dsum read): the shipped kernel (dsum loaded at the store) against the same body
// with dsum's loads issued before the row reduction (EARLY_DSUM), VPT 2 (80 registers) or 4 (128).
template <bool EARLY>
__global__ void __maxnreg__(80)
    bwd_dsum2_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* w, const float* __restrict__ rstd,
                     const T* __restrict__ dsum, T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int hidden,
                     bool zcg) {
    primus_turbo::rmsnorm_bwd_body<T, kVec, 2, true, EARLY>(dy, x, w, rstd, dsum, dx, ws, rows, hidden, zcg);
}
template <bool EARLY>
__global__ void __launch_bounds__(256, 2)
    bwd_dsum4_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* w, const float* __restrict__ rstd,
                     const T* __restrict__ dsum, T* __restrict__ dx, float* __restrict__ ws, int64_t rows, int hidden,
                     bool zcg) {
    primus_turbo::rmsnorm_bwd_body<T, kVec, 4, true, EARLY>(dy, x, w, rstd, dsum, dx, ws, rows, hidden, zcg);
}

void dsum_rows(int64_t rows, int hidden, T* dy, T* x, T* w, float* rstd, T* dsum, T* dx, T* dx_ref, T* dw,
               float* ws) {
    const primus_turbo::Plan p = primus_turbo::make_plan(hidden, primus_turbo::DType::kBFloat16, true, true);
    if (p.vpt != 2 && !p.bwd_vpt4_prefetch) return;
    const double bytes = 4.0 * rows * hidden * 2 + rows * 4;
    CK(primus_turbo::rmsnorm_bwd_launch(dy, x, w, rstd, dsum, dx_ref, dw, ws, rows, hidden, false,
                                        primus_turbo::DType::kBFloat16, true, 0));
    const float ship = median_ms([&] {
        CK(primus_turbo::rmsnorm_bwd_launch(dy, x, w, rstd, dsum, dx, dw, ws, rows, hidden, false,
                                            primus_turbo::DType::kBFloat16, true, 0));
    });
    for (int variant = 0; variant < 2; ++variant) {
        using K = void (*)(const T*, const T*, const T*, const float*, const T*, T*, float*, int64_t, int, bool);
        K kernel = p.vpt == 2 ? (variant ? (K)bwd_dsum2_kernel<true> : (K)bwd_dsum2_kernel<false>)
                              : (variant ? (K)bwd_dsum4_kernel<true> : (K)bwd_dsum4_kernel<false>);
        const int grid = grid_for(kernel, p.tpr * p.rpc, p.smem, rows, p.rpc, 1.0);
        auto go = [&] {
            kernel<<<grid, dim3(p.tpr, p.rpc), p.smem>>>(dy, x, w, rstd, dsum, dx, ws, rows, hidden, false);
            primus_turbo::dweight_reduce_kernel<T><<<(hidden + 31) / 32, dim3(32, 32)>>>(ws, dw, grid, hidden);
        };
        CK(cudaMemset(dx, 0, rows * hidden * 2));
        go();
        const bool ok = same(dx, dx_ref, size_t(rows) * hidden);
        const float ms = median_ms(go);
        std::printf("| bwd +dsum VPT%d %s (grid %d) vs shipped | %.1f vs %.1f | %.0f vs %.0f | %s |\n", p.vpt,
                    variant ? "dsum early" : "dsum at store", grid, ms * 1e3, ship * 1e3,
                    100 * bytes / ms / 1e6 / g_copy_gbps, 100 * bytes / ship / 1e6 / g_copy_gbps,
                    ok ? "ok" : "MISMATCH");
    }
}

// The backward body under other launch shapes: VPT vectors per thread, PF = prefetch of the next row,
// registers capped by __launch_bounds__(MAXT, MINB) (the shipped VPT 2 kernel uses __maxnreg__(80)).
template <int VPT, bool PF, int MAXT, int MINB>
__global__ void __launch_bounds__(MAXT, MINB) bwd_lb_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                            const T* w, const float* __restrict__ rstd,
                                                            const T* __restrict__ dsum, T* __restrict__ dx,
                                                            float* __restrict__ ws, int64_t rows, int hidden,
                                                            bool zcg) {
    primus_turbo::rmsnorm_bwd_body<T, kVec, VPT, PF>(dy, x, w, rstd, dsum, dx, ws, rows, hidden, zcg);
}

using BwdK = void (*)(const T*, const T*, const T*, const float*, const T*, T*, float*, int64_t, int, bool);

// One backward launch shape: tpr threads per row group (the plan's rule for VPT), rpc row groups per CTA,
// a persistent grid of `scale` x the resident CTAs.
void bwd_run(const char* name, BwdK kernel, int vpt, int max_threads, int64_t rows, int hidden, int rpc,
             double scale, T* dy, T* x, T* w, float* rstd, T* dx, T* dx_ref, T* dw, float* ws, double copy_gbps) {
    const int n_vec = hidden / kVec;
    const int tpr = std::max(32, ((n_vec + vpt - 1) / vpt + 31) / 32 * 32);
    if (tpr * rpc > max_threads || (rpc > 1 && tpr > 128)) return;
    const size_t smem = rpc > 1 ? sizeof(float) * rpc * hidden : 0;
    if (smem > 48 * 1024) return;
    const int grid = grid_for(kernel, tpr * rpc, smem, rows, rpc, scale);
    if (grid > 4096) return;  // the workspace holds 4096 partial rows
    cudaFuncAttributes attr;
    CK(cudaFuncGetAttributes(&attr, kernel));
    auto go = [&] {
        kernel<<<grid, dim3(tpr, rpc), smem>>>(dy, x, w, rstd, nullptr, dx, ws, rows, hidden, false);
        primus_turbo::dweight_reduce_kernel<T><<<(hidden + 31) / 32, dim3(32, 32)>>>(ws, dw, grid, hidden);
    };
    CK(cudaMemset(dx, 0, rows * hidden * 2));
    go();
    const bool ok = dx_ref == nullptr || same(dx, dx_ref, size_t(rows) * hidden);
    const float ms = median_ms(go);
    const double gbps = (3.0 * rows * hidden * 2 + rows * 4) / ms / 1e6;
    std::printf("| bwd %s VPT%d tpr%d rpc%d grid%d (x%.2f, %d regs, %d B spill) | %.1f | %.0f | %s |\n", name, vpt,
                tpr, rpc, grid, scale, attr.numRegs, int(attr.localSizeBytes), ms * 1e3, 100 * gbps / copy_gbps,
                ok ? "ok" : "MISMATCH");
}

// The backward variants of one shape (session 22): the shipped VPT 2 kernel (80 registers) with one or
// more row groups per CTA and grids past the resident CTAs; VPT 2 and 4, with and without the prefetch,
// under register caps for 1-4 CTAs.
void bwd_variants(int64_t rows, int hidden, T* dy, T* x, T* w, float* rstd, T* dx, T* dx_ref, T* dw, float* ws,
                  double copy_gbps) {
#define BWD(name, K, VPT, MAXT, RPC, SCALE) \
    bwd_run(name, K, VPT, MAXT, rows, hidden, RPC, SCALE, dy, x, w, rstd, dx, dx_ref, dw, ws, copy_gbps)
    const BwdK shipped = primus_turbo::rmsnorm_bwd_vpt2_kernel<T, kVec, false>;
    for (int rpc : {1, 2, 4, 8})
        for (double scale : {1.0, 2.0}) BWD("vpt2 maxnreg80", shipped, 2, 512, rpc, scale);
    const int n_vec = hidden / kVec;
    if (n_vec / 2 <= 128) {  // VPT 2 rows of 128 threads: caps for 3-8 CTAs of 128
        BWD("vpt2 PF lb(128,4)", (bwd_lb_kernel<2, true, 128, 4>), 2, 128, 1, 1.0);
        BWD("vpt2 PF lb(128,6)", (bwd_lb_kernel<2, true, 128, 6>), 2, 128, 1, 1.0);
        BWD("vpt2 PF lb(128,8)", (bwd_lb_kernel<2, true, 128, 8>), 2, 128, 1, 1.0);
        BWD("vpt4 PF lb(128,4)", (bwd_lb_kernel<4, true, 128, 4>), 4, 128, 2, 1.0);
        BWD("vpt1 PF lb(256,4)", (bwd_lb_kernel<1, true, 256, 4>), 1, 256, 1, 1.0);
    } else if (n_vec / 2 <= 256) {
        BWD("vpt2 PF lb(256,2)", (bwd_lb_kernel<2, true, 256, 2>), 2, 256, 1, 1.0);
        BWD("vpt2 PF lb(256,3)", (bwd_lb_kernel<2, true, 256, 3>), 2, 256, 1, 1.0);
        BWD("vpt2 PF lb(256,4)", (bwd_lb_kernel<2, true, 256, 4>), 2, 256, 1, 1.0);
        BWD("vpt4 PF lb(128,4)", (bwd_lb_kernel<4, true, 128, 4>), 4, 128, 1, 1.0);
        BWD("vpt4 PF lb(128,6)", (bwd_lb_kernel<4, true, 128, 6>), 4, 128, 1, 1.0);
        BWD("vpt4 PF lb(128,6)", (bwd_lb_kernel<4, true, 128, 6>), 4, 128, 1, 2.0);
    } else {  // 7168 / 8192 columns: VPT 2 fits 1 CTA of 448-512 threads at 80 registers
        BWD("vpt2 PF lb(512,1)", (bwd_lb_kernel<2, true, 512, 1>), 2, 512, 1, 1.0);
        BWD("vpt2 PF lb(512,2)", (bwd_lb_kernel<2, true, 512, 2>), 2, 512, 1, 1.0);
        BWD("vpt2 noPF lb(512,2)", (bwd_lb_kernel<2, false, 512, 2>), 2, 512, 1, 1.0);
        BWD("vpt4 PF lb(256,2)", (bwd_lb_kernel<4, true, 256, 2>), 4, 256, 1, 1.0);
        BWD("vpt4 PF lb(256,3)", (bwd_lb_kernel<4, true, 256, 3>), 4, 256, 1, 1.0);
        BWD("vpt4 PF lb(256,4)", (bwd_lb_kernel<4, true, 256, 4>), 4, 256, 1, 1.0);
        BWD("vpt4 noPF lb(256,3)", (bwd_lb_kernel<4, false, 256, 3>), 4, 256, 1, 1.0);
    }
#undef BWD
}

int main(int argc, char** argv) {
    std::vector<std::pair<int64_t, int>> shapes;
    for (int i = 1; i < argc; ++i) {
        long long r = 0;
        int h = 0;
        if (std::sscanf(argv[i], "%lldx%d", &r, &h) == 2) shapes.push_back({r, h});
    }
    if (shapes.empty())
        for (int64_t r : {8192, 16384, 32768})
            for (int h : {2048, 4096, 7168, 8192}) shapes.push_back({r, h});
    CK(cudaMalloc(&g_flush, 256 << 20));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("# TURBO RMSNorm plan sweep, bf16, %s; times in us, %% of the same-size copy\n", prop.name);
    for (const auto& shape : shapes) {
        const int64_t rows = shape.first;
        const int hidden = shape.second;
        const size_t n = size_t(rows) * hidden;
        T *x, *y, *y_ref, *w, *dy, *dx, *dx_ref, *dw, *buf;
        float *rstd, *ws;
        CK(cudaMalloc(&x, n * 2));
        CK(cudaMalloc(&y, n * 2));
        CK(cudaMalloc(&y_ref, n * 2));
        CK(cudaMalloc(&dy, n * 2));
        CK(cudaMalloc(&dx, n * 2));
        CK(cudaMalloc(&dx_ref, n * 2));
        CK(cudaMalloc(&buf, n * 2));
        CK(cudaMalloc(&w, hidden * 2));
        CK(cudaMalloc(&dw, hidden * 2));
        CK(cudaMalloc(&rstd, rows * 4));
        CK(cudaMalloc(&ws, size_t(4096) * hidden * 4));
        auto free_all = [&] {
            for (void* p : {(void*)x, (void*)y, (void*)y_ref, (void*)dy, (void*)dx, (void*)dx_ref, (void*)buf,
                            (void*)w, (void*)dw, (void*)rstd, (void*)ws})
                CK(cudaFree(p));
        };
        fill_kernel<<<1024, 256>>>(x, n, 1);
        fill_kernel<<<1024, 256>>>(dy, n, 2);
        fill_kernel<<<8, 256>>>(w, hidden, 3);
        const float copy_ms = median_ms([&] { CK(cudaMemcpyAsync(buf, x, n * 2, cudaMemcpyDeviceToDevice)); });
        const double copy_gbps = 2.0 * n * 2 / copy_ms / 1e6;
        std::printf("\n### %lld x %d: copy %.1f us, %.0f GB/s\n\n| plan | us | %%copy | check |\n|---|---|---|---|\n",
                    (long long)rows, hidden, copy_ms * 1e3, copy_gbps);
        const bool aligned = true;
        CK(primus_turbo::rmsnorm_fwd_launch(x, nullptr, w, y_ref, nullptr, rstd, rows, hidden, 1e-6f, false,
                                            primus_turbo::DType::kBFloat16, aligned, 0));
        const float ship_ms = median_ms([&] {
            CK(primus_turbo::rmsnorm_fwd_launch(x, nullptr, w, y, nullptr, rstd, rows, hidden, 1e-6f, false,
                                                primus_turbo::DType::kBFloat16, aligned, 0));
        });
        std::printf("| fwd shipped plan | %.1f | %.0f | ok |\n", ship_ms * 1e3,
                    100 * (2.0 * n * 2 + rows * 4) / ship_ms / 1e6 / copy_gbps);
        if (std::getenv("SWEEP_HINTS") != nullptr) {  // the cache-hint rounds only
            fwd_hint_variants(rows, hidden, x, w, y, y_ref, rstd, copy_gbps);
            free_all();
            continue;
        }
        // 1 vector per thread and a cap of 4 CTAs: measured slower at every shape (sweep_rmsnorm_csrc_3f1d412.txt).
        fwd_row_variant<false>(rows, hidden, x, w, y, y_ref, rstd, copy_gbps);
        fwd_row_variant<true>(rows, hidden, x, w, y, y_ref, rstd, copy_gbps);
        for (double scale : {1.0}) {
            fwd_variant<2, true>("", rows, hidden, x, w, y, y_ref, rstd, copy_gbps, scale);
            fwd_variant<4, true>("", rows, hidden, x, w, y, y_ref, rstd, copy_gbps, scale);
            fwd_variant<2, false>("", rows, hidden, x, w, y, y_ref, rstd, copy_gbps, scale);
            fwd_variant<4, false>("", rows, hidden, x, w, y, y_ref, rstd, copy_gbps, scale);
            fwd_variant<8, false>("", rows, hidden, x, w, y, y_ref, rstd, copy_gbps, scale);
        }
        const int64_t ws_rows = primus_turbo::rmsnorm_bwd_workspace_rows(rows, hidden, primus_turbo::DType::kBFloat16,
                                                                         aligned);
        CK(primus_turbo::rmsnorm_bwd_launch(dy, x, w, rstd, nullptr, dx_ref, dw, ws, rows, hidden, false,
                                            primus_turbo::DType::kBFloat16, aligned, 0));
        const float bship_ms = median_ms([&] {
            CK(primus_turbo::rmsnorm_bwd_launch(dy, x, w, rstd, nullptr, dx, dw, ws, rows, hidden, false,
                                                primus_turbo::DType::kBFloat16, aligned, 0));
        });
        std::printf("| bwd shipped plan (grid %lld) | %.1f | %.0f | ok |\n", (long long)ws_rows, bship_ms * 1e3,
                    100 * (3.0 * n * 2 + rows * 4) / bship_ms / 1e6 / copy_gbps);
        g_copy_gbps = copy_gbps;
        reduce_rows(rows, hidden, dy, x, w, rstd, dx, dw, ws);
        fill_kernel<<<1024, 256>>>(buf, n, 4);  // buf: dsum
        dsum_rows(rows, hidden, dy, x, w, rstd, buf, dx, dx_ref, dw, ws);
        bwd_variants(rows, hidden, dy, x, w, rstd, dx, dx_ref, dw, ws, copy_gbps);
        free_all();
    }
    return 0;
}
