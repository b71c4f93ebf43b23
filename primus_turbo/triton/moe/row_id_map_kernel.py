"""The permute's row-id map in three launches instead of ~15 small torch ops.

``dest[t, c]`` = the row of token t's route c in the expert-grouped buffer (tokens in order within an
expert), or -1. Columns c are the top-k slots (``indices`` [T, K], -1 = no route) or the experts
(bool routing map [T, E]). The torch reference is ``permute_impl._build_row_id_map_torch``; these
kernels reproduce it integer for integer.

1. ``expert_rank_kernel``, grid (E,): program e walks the tokens in BLOCK_T tiles, marks the routes to
   e, and writes each one's rank among them (a running count plus an in-tile scan) into ``rank`` (laid
   out like ``dest``), and the total into ``counts[e]``. One program per expert keeps the scan serial
   over tokens without a grid-wide sync; T x K x E compares are cheap next to the torch path's
   launches (4096 x 8 x 256 = 8.4 M).
2. ``expert_offsets_kernel``, grid (1,): slots per expert (counts, padded up to ``pad_multiple`` or
   ``capacity``), exclusive offsets, tokens_per_expert.
3. ``row_id_map_kernel``, grid (cdiv(T, BLOCK_T),): dest = offsets[expert] + rank where the route is
   kept (rank < capacity, dest < num_rows), else -1.

On H100 (bench_moe_ops, session 9, 4096 tokens x 256 experts top-8) the permute forward with the torch map
took 0.376 ms against 0.20 ms for its kernel alone; with these kernels the forward takes 0.28 ms.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_rank_kernel(
    routing_ptr,
    rank_ptr,
    counts_ptr,
    T,
    C,
    IS_MAP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0)
    offs_c = tl.arange(0, BLOCK_C)
    running = tl.zeros((), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tmask = offs_t < T
        if IS_MAP:
            # column e of the [T, E] map: one flag per token
            flag = tl.load(routing_ptr + offs_t.to(tl.int64) * C + e, mask=tmask, other=0)
            hit = (flag != 0).to(tl.int32)
            rank = running + tl.cumsum(hit, axis=0) - 1
            tl.store(rank_ptr + offs_t.to(tl.int64) * C + e, rank, mask=tmask & (hit > 0))
            running += tl.sum(hit, axis=0)
        else:
            ptrs = offs_t.to(tl.int64)[:, None] * C + offs_c[None, :]
            m2 = tmask[:, None] & (offs_c[None, :] < C)
            idx = tl.load(routing_ptr + ptrs, mask=m2, other=-1)
            match = (idx == e) & m2
            hit = tl.sum(match.to(tl.int32), axis=1)  # a token routes to e at most once
            rank = running + tl.cumsum(hit, axis=0) - 1
            rank2 = tl.broadcast_to(rank[:, None], (BLOCK_T, BLOCK_C))
            tl.store(rank_ptr + ptrs, rank2, mask=match)
            running += tl.sum(hit, axis=0)
    tl.store(counts_ptr + e, running)


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
    offs = tl.arange(0, BLOCK_E)
    emask = offs < E
    counts = tl.load(counts_ptr + offs, mask=emask, other=0)
    if HAS_CAPACITY:
        slots = tl.where(emask, capacity, 0)
        tokens = tl.minimum(counts, capacity)
    else:
        slots = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
        tokens = slots
    offsets = tl.cumsum(slots, axis=0) - slots
    tl.store(offsets_ptr + offs, offsets, mask=emask)
    tl.store(tokens_per_expert_ptr + offs, tokens, mask=emask)


@triton.jit
def row_id_map_kernel(
    routing_ptr,
    rank_ptr,
    offsets_ptr,
    dest_ptr,
    T,
    C,
    E,
    num_rows,
    capacity,
    IS_MAP: tl.constexpr,
    HAS_CAPACITY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.arange(0, BLOCK_C)
    m2 = (offs_t[:, None] < T) & (offs_c[None, :] < C)
    ptrs = offs_t.to(tl.int64)[:, None] * C + offs_c[None, :]
    if IS_MAP:
        routed = tl.load(routing_ptr + ptrs, mask=m2, other=0) != 0
        expert = tl.broadcast_to(offs_c[None, :], (BLOCK_T, BLOCK_C))
    else:
        expert = tl.load(routing_ptr + ptrs, mask=m2, other=-1)
        routed = (expert >= 0) & (expert < E)
    rank = tl.load(rank_ptr + ptrs, mask=m2 & routed, other=0)
    offset = tl.load(offsets_ptr + expert, mask=m2 & routed, other=0)
    dest = offset + rank
    keep = routed & (dest < num_rows)
    if HAS_CAPACITY:
        keep = keep & (rank < capacity)
    tl.store(dest_ptr + ptrs, tl.where(keep, dest, -1), mask=m2)
