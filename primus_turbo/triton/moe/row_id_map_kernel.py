"""The permute's row-id map in four launches (and a memset for indices); for indices none grows with E.

``dest[t, c]`` = the row of token t's route c in the expert-grouped buffer (tokens in order within an
expert), or -1. Columns c are the top-k slots (``indices`` [T, K], -1 = no route; ids < 0 or >= E are
dropped routes) or the experts (bool routing map [T, E]). The torch reference is
``permute_impl._build_row_id_map_torch``; these kernels reproduce it integer for integer, including a
token that names one expert twice (both routes get the row of the pair's second rank, as there).

Tokens are cut into NC chunks; ``tile_counts[e, j]`` = routes to expert e in chunk j.

1. Count. Indices: ``index_chunk_count_kernel``, grid (NC,), chunks of ``chunk_t`` whole tokens (~64 flat
   routes, one tile a program): one relaxed ``atomic_add`` of 1 per valid route into the zeroed column j
   (only program j touches it). Bool map: ``map_column_count_kernel``, grid (E, NT), one column of one
   chunk a program (the map is read once either way).
2. ``expert_chunk_scan_kernel``, grid (E / BLOCK_E,): per expert, base[e, j] = routes to e in chunks
   before j (a running scan along the expert's row, in tiles) and the total ``counts[e]``.
3. ``expert_offsets_kernel``, grid (1,): slots per expert (counts padded up to ``pad_multiple``, or
   ``capacity``), exclusive offsets, tokens_per_expert; an [E] scan in tiles of 4096.
4. Rows. Indices: ``index_row_id_kernel``, grid (NC,): rank = base[e, j] + the routes to e from the
   chunk's tokens up to and including this route's token - 1 (a pairwise [N, N] compare inside the
   program, N = the tile); dest = offsets[e] + rank. Bool map: ``map_row_id_kernel``, grid (E, NT):
   rank = base[e, j] + the running flag count - 1.
   Kept where the route is valid, dest < num_rows and (capacity mode) rank < capacity, else -1. Every
   entry of dest is written exactly once.

Integer atomics only, so the result is deterministic. Per-expert totals are summed by the scan, not
atomically by the count programs: one hot counter per expert serialised those adds (41 us of the
count kernel at 32768 x 6 x E64 on H200). For indices, launches 1 and 4 read the T x K ids once (4 also
gathers one base and one offset per route); the memset and the scan touch E x NC ints (128K at 4096
tokens top-8 x 256 experts), a share that grows as E x T x K / 64.

Measured on one H200 (whole map, do_bench_cudagraph, int64 topk indices, num_out = T x K, no padding; the
previous kernels, which compared every route with every expert at _TARGET_PROGRAMS = 2048, timed in the same
session): 4096 x 8 x E256 57.0 -> 10.1 us, 4096 x 6 x E64 12.1 -> 10.9, 32768 x 6 x E64 113.8 -> 19.2,
16384 x 8 x E256 217.1 -> 14.6, but 16384 x 2 x E8 5.7 -> 10.4 (five graph nodes of 1-3 us each instead
of three, and at E = 8 the old E-fold reads were cheap). The bool-map form is unchanged within ~1 us
(31.7 us at 4096 x E256, 46.4 at 32768 x E64): its programs read one byte of every E.
"""

from __future__ import annotations

import triton
import triton.language as tl

# -- index form [T, K] -----------------------------------------------------------------------------


@triton.jit
def _load_chunk_routes(idx_ptr, n_routes, chunk_routes, E, BLOCK_N: tl.constexpr):
    """Program j's routes (flat, token-major), their expert (-1 where dropped) and validity."""
    start = tl.program_id(0).to(tl.int64) * chunk_routes
    offs = tl.arange(0, BLOCK_N)
    in_chunk = offs < tl.minimum(chunk_routes, n_routes - start)
    idx = tl.load(idx_ptr + start + offs, mask=in_chunk, other=-1)
    valid = in_chunk & (idx >= 0) & (idx < E)
    expert = tl.where(valid, idx, -1).to(tl.int32)  # narrowed only once in range
    return start + offs, offs, expert, valid, in_chunk


@triton.jit
def index_chunk_count_kernel(idx_ptr, tile_counts_ptr, n_routes, chunk_routes, E, NC, BLOCK_N: tl.constexpr):
    j = tl.program_id(0)
    _, _, expert, valid, _ = _load_chunk_routes(idx_ptr, n_routes, chunk_routes, E, BLOCK_N)
    # the cells of column j are this program's alone, so these atomics meet only each other
    ptrs = tile_counts_ptr + expert.to(tl.int64) * NC + j
    tl.atomic_add(ptrs, tl.full((BLOCK_N,), 1, tl.int32), mask=valid, sem="relaxed")


@triton.jit
def index_row_id_kernel(
    idx_ptr,
    base_ptr,
    offsets_ptr,
    dest_ptr,
    n_routes,
    chunk_routes,
    K,
    E,
    NC,
    num_rows,
    capacity,
    HAS_CAPACITY: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    j = tl.program_id(0)
    flat, offs, expert, valid, in_chunk = _load_chunk_routes(idx_ptr, n_routes, chunk_routes, E, BLOCK_N)
    token = offs // K  # in the chunk, which starts on a token boundary
    # rank_in_chunk = routes to my expert from tokens <= mine, minus one (a token naming an expert twice
    # ranks both routes after the pair, as the reference's cumsum over a per-token count of 2 does).
    # With key = expert << 16 | token that is one unsigned range test per pair: key_j - (expert_i << 16)
    # <= token_i. Dropped routes get a key above every expert's range (E < 2^14, tokens < 2^16).
    key = tl.where(valid, (expert << 16) | token, 1 << 30)
    gap = (key[None, :] - (expert << 16)[:, None]).to(tl.uint32, bitcast=True)
    before = gap <= token.to(tl.uint32)[:, None]
    rank = tl.sum(before.to(tl.int32), axis=1) - 1
    rank += tl.load(base_ptr + expert.to(tl.int64) * NC + j, mask=valid, other=0)
    offset = tl.load(offsets_ptr + expert, mask=valid, other=0)
    dest = offset + rank
    keep = valid & (dest < num_rows)
    if HAS_CAPACITY:
        keep = keep & (rank < capacity)
    tl.store(dest_ptr + flat, tl.where(keep, dest, -1), mask=in_chunk)


# -- both forms ------------------------------------------------------------------------------------


@triton.jit
def expert_chunk_scan_kernel(tile_counts_ptr, base_ptr, counts_ptr, E, NC, BLOCK_E: tl.constexpr,
                             BLOCK_NC: tl.constexpr):  # fmt: skip
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = offs_e < E
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    offs_j = tl.arange(0, BLOCK_NC)
    for j0 in range(0, NC, BLOCK_NC):
        m2 = emask[:, None] & (j0 + offs_j[None, :] < NC)
        ptrs = offs_e.to(tl.int64)[:, None] * NC + (j0 + offs_j)[None, :]
        tiles = tl.load(tile_counts_ptr + ptrs, mask=m2, other=0)
        tl.store(base_ptr + ptrs, running[:, None] + tl.cumsum(tiles, axis=1) - tiles, mask=m2)
        running += tl.sum(tiles, axis=1)
    tl.store(counts_ptr + offs_e, running, mask=emask)


@triton.jit
def expert_offsets_kernel(
    counts_ptr,
    offsets_ptr,
    tokens_per_expert_ptr,
    E,
    pad_multiple,
    capacity,
    HAS_CAPACITY: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    carry = tl.zeros((), dtype=tl.int32)  # slots of the expert blocks already scanned
    for e0 in range(0, E, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)
        emask = offs_e < E
        counts = tl.load(counts_ptr + offs_e, mask=emask, other=0)
        if HAS_CAPACITY:
            slots = tl.where(emask, capacity, 0)
            tokens = tl.minimum(counts, capacity)
        else:
            slots = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
            tokens = slots
        tl.store(offsets_ptr + offs_e, carry + tl.cumsum(slots, axis=0) - slots, mask=emask)
        tl.store(tokens_per_expert_ptr + offs_e, tokens, mask=emask)
        carry += tl.sum(slots, axis=0)


# -- bool map form [T, C], C = E -------------------------------------------------------------------


@triton.jit
def map_column_count_kernel(map_ptr, tile_counts_ptr, T, C, chunk_t, BLOCK_T: tl.constexpr):
    e = tl.program_id(0)
    j = tl.program_id(1)
    t_start = j * chunk_t
    t_end = tl.minimum(t_start + chunk_t, T)
    count = tl.zeros((), dtype=tl.int32)
    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        flag = tl.load(map_ptr + offs_t.to(tl.int64) * C + e, mask=offs_t < t_end, other=0)
        count += tl.sum((flag != 0).to(tl.int32), axis=0)
    tl.store(tile_counts_ptr + e * tl.num_programs(1) + j, count)


@triton.jit
def map_row_id_kernel(
    map_ptr,
    base_ptr,
    offsets_ptr,
    dest_ptr,
    T,
    C,
    chunk_t,
    num_rows,
    capacity,
    HAS_CAPACITY: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    e = tl.program_id(0)
    j = tl.program_id(1)
    t_start = j * chunk_t
    t_end = tl.minimum(t_start + chunk_t, T)
    offset = tl.load(offsets_ptr + e)
    running = tl.load(base_ptr + e * tl.num_programs(1) + j)  # expert e's routes in chunks before j
    for t0 in range(t_start, t_end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tmask = offs_t < t_end
        ptrs = offs_t.to(tl.int64) * C + e
        hit = (tl.load(map_ptr + ptrs, mask=tmask, other=0) != 0).to(tl.int32)
        rank = running + tl.cumsum(hit, axis=0) - 1
        keep = (hit > 0) & (offset + rank < num_rows)
        if HAS_CAPACITY:
            keep = keep & (rank < capacity)
        tl.store(dest_ptr + ptrs, tl.where(keep, offset + rank, -1), mask=tmask)
        running += tl.sum(hit, axis=0)
