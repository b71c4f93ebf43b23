// The permute's row-id map for int indices [T, K] (the CUDA twin of the index form in
// primus_turbo/triton/moe/row_id_map_kernel.py; integer-equal to it and to the torch reference).
//
//   dest[t, k] = row of token t's k-th route in the expert-grouped buffer (tokens in order within an
//   expert), or -1 (id < 0 or >= E, dropped by capacity, or past num_rows).
//
// Same four launches as the Triton kernels, issued from one host call. H200, 4096 x 8 x E256: ~10 us of GPU
// time either way; host 47 us per map against 123 us for the Triton launches (bench_moe_ops, session 15).
// Tokens are cut into NC chunks of chunk_t whole tokens (~64 routes, one warp or two per chunk).
//   1. count: one atomicAdd per valid route into tile_counts[e, j] (zeroed by the caller; integer atomics,
//      so the result is deterministic);
//   2. chunk scan, one block per expert: base[e, j] = routes to e in chunks before j, counts[e] = total;
//   3. offsets, one block: slots (counts padded up to pad_multiple, or capacity), exclusive offsets,
//      tokens_per_expert;
//   4. rows, one block per chunk: rank = base[e, j] + routes to e from the chunk's tokens up to and
//      including the route's own token - 1 (a token naming an expert twice ranks both routes after the
//      pair, as the reference does); dest = offsets[e] + rank where kept.
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

namespace primus_turbo {
namespace {

constexpr int kScanThreads = 256;
constexpr int kOffsetThreads = 1024;

template <typename IdxT>
__device__ __forceinline__ int32_t expert_of(const IdxT* idx, int64_t flat, int E) {
    const int64_t v = static_cast<int64_t>(idx[flat]);
    return (v >= 0 && v < E) ? static_cast<int32_t>(v) : -1;
}

template <typename IdxT>
__global__ void chunk_count_kernel(const IdxT* __restrict__ idx, int32_t* __restrict__ tile_counts,
                                   int64_t n_routes, int chunk_routes, int E, int NC) {
    const int j = blockIdx.x;
    const int64_t flat = static_cast<int64_t>(j) * chunk_routes + threadIdx.x;
    if (static_cast<int>(threadIdx.x) >= chunk_routes || flat >= n_routes) return;
    const int32_t e = expert_of(idx, flat, E);
    if (e >= 0) atomicAdd(&tile_counts[static_cast<int64_t>(e) * NC + j], 1);
}

__global__ void chunk_scan_kernel(const int32_t* __restrict__ tile_counts, int32_t* __restrict__ base,
                                  int32_t* __restrict__ counts, int NC) {
    using Scan = cub::BlockScan<int32_t, kScanThreads>;
    __shared__ typename Scan::TempStorage tmp;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * NC;
    int32_t carry = 0;  // the same in every thread: each step adds the block total
    for (int j0 = 0; j0 < NC; j0 += kScanThreads) {
        const int j = j0 + threadIdx.x;
        const int32_t v = j < NC ? tile_counts[row + j] : 0;
        int32_t excl, total;
        Scan(tmp).ExclusiveSum(v, excl, total);
        if (j < NC) base[row + j] = carry + excl;
        carry += total;
        __syncthreads();  // tmp is reused by the next step
    }
    if (threadIdx.x == 0) counts[blockIdx.x] = carry;
}

__global__ void offsets_kernel(const int32_t* __restrict__ counts, int32_t* __restrict__ offsets,
                               int32_t* __restrict__ tokens_per_expert, int E, int pad_multiple, int capacity) {
    using Scan = cub::BlockScan<int32_t, kOffsetThreads>;
    __shared__ typename Scan::TempStorage tmp;
    int32_t carry = 0;
    for (int e0 = 0; e0 < E; e0 += kOffsetThreads) {
        const int e = e0 + threadIdx.x;
        int32_t slots = 0, tokens = 0;
        if (e < E) {
            const int32_t c = counts[e];
            if (capacity >= 0) {
                slots = capacity;
                tokens = c < capacity ? c : capacity;
            } else {
                slots = (c + pad_multiple - 1) / pad_multiple * pad_multiple;
                tokens = slots;
            }
        }
        int32_t excl, total;
        Scan(tmp).ExclusiveSum(slots, excl, total);
        if (e < E) {
            offsets[e] = carry + excl;
            tokens_per_expert[e] = tokens;
        }
        carry += total;
        __syncthreads();
    }
}

template <typename IdxT>
__global__ void rows_kernel(const IdxT* __restrict__ idx, const int32_t* __restrict__ base,
                            const int32_t* __restrict__ offsets, int32_t* __restrict__ dest, int64_t n_routes,
                            int chunk_routes, int K, int E, int NC, int64_t num_rows, int capacity) {
    extern __shared__ int32_t chunk_expert[];  // chunk_routes entries
    const int j = blockIdx.x;
    const int i = threadIdx.x;
    const int64_t start = static_cast<int64_t>(j) * chunk_routes;
    const int64_t left = n_routes - start;
    const int n = left < chunk_routes ? static_cast<int>(left) : chunk_routes;
    const int32_t e = i < n ? expert_of(idx, start + i, E) : -1;
    if (i < chunk_routes) chunk_expert[i] = e;
    __syncthreads();
    if (i >= n) return;
    int32_t out = -1;
    if (e >= 0) {
        const int upto = min(n, (i / K + 1) * K);  // routes of the chunk's tokens up to mine
        int32_t rank = -1;
        for (int q = 0; q < upto; ++q) rank += chunk_expert[q] == e;
        rank += base[static_cast<int64_t>(e) * NC + j];
        const int64_t d = static_cast<int64_t>(offsets[e]) + rank;
        if (d < num_rows && (capacity < 0 || rank < capacity)) out = static_cast<int32_t>(d);
    }
    dest[start + i] = out;
}

template <typename IdxT>
cudaError_t launch(const IdxT* idx, int32_t* tile_counts, int32_t* base, int32_t* counts, int32_t* offsets,
                   int32_t* tokens_per_expert, int32_t* dest, int64_t T, int K, int E, int chunk_t,
                   int64_t num_rows, int pad_multiple, int capacity, cudaStream_t stream) {
    const int64_t n_routes = T * K;
    const int chunk_routes = chunk_t * K;
    const int NC = static_cast<int>((T + chunk_t - 1) / chunk_t);
    const int threads = (chunk_routes + 31) / 32 * 32;
    chunk_count_kernel<IdxT><<<NC, threads, 0, stream>>>(idx, tile_counts, n_routes, chunk_routes, E, NC);
    chunk_scan_kernel<<<E, kScanThreads, 0, stream>>>(tile_counts, base, counts, NC);
    offsets_kernel<<<1, kOffsetThreads, 0, stream>>>(counts, offsets, tokens_per_expert, E, pad_multiple, capacity);
    rows_kernel<IdxT><<<NC, threads, chunk_routes * sizeof(int32_t), stream>>>(
        idx, base, offsets, dest, n_routes, chunk_routes, K, E, NC, num_rows, capacity);
    return cudaGetLastError();
}

}  // namespace

// tile_counts must be zeroed, [E, NC] with NC = ceil(T / chunk_t); base [E, NC]; counts, offsets and
// tokens_per_expert [E]; dest [T, K]. chunk_t * K <= 1024; capacity < 0: no capacity; pad_multiple >= 1.
cudaError_t moe_row_id_map_launch(const void* idx, bool idx_is_int64, int32_t* tile_counts, int32_t* base,
                                  int32_t* counts, int32_t* offsets, int32_t* tokens_per_expert, int32_t* dest,
                                  int64_t T, int K, int E, int chunk_t, int64_t num_rows, int pad_multiple,
                                  int capacity, cudaStream_t stream) {
    if (T == 0 || K == 0 || E == 0) return cudaSuccess;
    if (idx_is_int64) {
        return launch(static_cast<const int64_t*>(idx), tile_counts, base, counts, offsets, tokens_per_expert, dest,
                      T, K, E, chunk_t, num_rows, pad_multiple, capacity, stream);
    }
    return launch(static_cast<const int32_t*>(idx), tile_counts, base, counts, offsets, tokens_per_expert, dest, T,
                  K, E, chunk_t, num_rows, pad_multiple, capacity, stream);
}

}  // namespace primus_turbo
