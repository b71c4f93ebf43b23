"""Intranode expert-parallel kernels over symmetric memory: ranks write straight into peers' buffers.

Peers' workspaces are reached through their base addresses (``peer_ptrs`` [W] int64, from
torch symmetric memory); every region offset is in bytes from that base. The host never waits:
row counts live on the device and the kernels mask by them. Grids are persistent with at most
``num_programs`` programs (bounded SMs, like DeepEP's ``num_sms``), each looping over tokens/rows.
No @triton.jit helpers (see activation_kernel.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ep_dispatch_push_kernel(
    x_ptr,
    idx_ptr,
    probs_ptr,
    scale_ptr,
    row_map_ptr,  # [T, W] int32: row of token t in this rank's rank-major send layout, or -1
    send_off_ptr,  # [W] int32: first send-layout row of destination w
    base_ptr,  # [W] int32: first receive row reserved for this rank on destination w
    peer_ptrs,  # [W] int64: workspace base address of every rank
    T,
    W,
    H,
    K,
    S,
    experts_per_rank,
    x_off,
    idx_off,
    probs_off,
    scale_off,
    HAS_PROBS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        t64 = t.to(tl.int64)
        experts = tl.load(idx_ptr + t64 * K + kk, mask=kmask, other=-1).to(tl.int32)
        if HAS_PROBS:
            probs = tl.load(probs_ptr + t64 * K + kk, mask=kmask, other=0.0).to(tl.float32)
        for w in range(W):
            row = tl.load(row_map_ptr + t64 * W + w)
            if row >= 0:
                dst = (tl.load(base_ptr + w) + row - tl.load(send_off_ptr + w)).to(tl.int64)
                peer = tl.load(peer_ptrs + w)
                x_dst = (peer + x_off).to(tl.pointer_type(x_ptr.dtype.element_ty)) + dst * H
                for start in range(0, H, BLOCK_H):
                    offs = start + tl.arange(0, BLOCK_H)
                    v = tl.load(x_ptr + t64 * H + offs, mask=offs < H)
                    tl.store(x_dst + offs, v, mask=offs < H)
                local = experts - w * experts_per_rank
                is_local = (experts >= 0) & (local >= 0) & (local < experts_per_rank)
                idx_dst = (peer + idx_off).to(tl.pointer_type(tl.int32)) + dst * K
                tl.store(idx_dst + kk, tl.where(is_local, local, -1), mask=kmask)
                if HAS_PROBS:
                    p_dst = (peer + probs_off).to(tl.pointer_type(tl.float32)) + dst * K
                    tl.store(p_dst + kk, tl.where(is_local, probs, 0.0), mask=kmask)
                if HAS_SCALE:
                    s_dst = (peer + scale_off).to(tl.pointer_type(tl.float32)) + dst * S
                    for s0 in range(0, S, BLOCK_K):
                        so = s0 + kk
                        sv = tl.load(scale_ptr + t64 * S + so, mask=so < S)
                        tl.store(s_dst + so, sv, mask=so < S)


@triton.jit
def ep_combine_push_kernel(
    y_ptr,  # [R, H] rows received by this rank (expert outputs), R = receive capacity
    w_ptr,  # [R, K] fp32 topk weights to send back (optional)
    counts_ptr,  # [W, W] int64 count matrix: counts[s, d] = rows s sent to d
    peer_ptrs,
    rank,
    W,
    H,
    K,
    y_off,
    w_off,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Row j of this rank's receive buffer came from source s (rows [base_s, base_s + counts[s, rank]));
    it goes back to s's combine buffer at s's send-layout row send_off_s[rank] + j - base_s."""
    ww = tl.arange(0, BLOCK_W)
    wmask = ww < W
    to_me = tl.load(counts_ptr + ww * W + rank, mask=wmask, other=0)  # [W]: counts[s, rank]
    base_end = tl.cumsum(to_me, axis=0)  # inclusive prefix over sources
    total = tl.sum(to_me, axis=0)
    kk = tl.arange(0, BLOCK_K)
    for j in range(tl.program_id(0), total, tl.num_programs(0)):
        src = tl.sum((base_end <= j).to(tl.int32), axis=0)
        base = tl.sum(tl.where(ww < src, to_me, 0), axis=0)
        row_s = tl.load(counts_ptr + src * W + ww, mask=wmask & (ww < rank), other=0)
        dst = (tl.sum(row_s, axis=0) + j - base).to(tl.int64)
        peer = tl.load(peer_ptrs + src)
        y_dst = (peer + y_off).to(tl.pointer_type(y_ptr.dtype.element_ty)) + dst * H
        j64 = j.to(tl.int64)
        for start in range(0, H, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            v = tl.load(y_ptr + j64 * H + offs, mask=offs < H)
            tl.store(y_dst + offs, v, mask=offs < H)
        if HAS_W:
            wv = tl.load(w_ptr + j64 * K + kk, mask=kk < K)
            w_dst = (peer + w_off).to(tl.pointer_type(tl.float32)) + dst * K
            tl.store(w_dst + kk, wv, mask=kk < K)


@triton.jit
def ep_recv_finalize_kernel(
    ws_x_ptr,
    ws_idx_ptr,
    ws_probs_ptr,
    out_x_ptr,
    out_idx_ptr,
    out_probs_ptr,
    counts_ptr,
    rank,
    W,
    R,
    H,
    K,
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Copy the received rows out of the workspace (so the next call can reuse it); rows past the
    received total get index -1 and prob 0 and unspecified data (the receive tensors are worst-case
    sized; nothing reads those rows since their indices are -1)."""
    ww = tl.arange(0, BLOCK_W)
    total = tl.sum(tl.load(counts_ptr + ww * W + rank, mask=ww < W, other=0), axis=0)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    for j in range(tl.program_id(0), R, tl.num_programs(0)):
        j64 = j.to(tl.int64)
        valid = j < total
        for start in range(0, H, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            m = (offs < H) & valid
            v = tl.load(ws_x_ptr + j64 * H + offs, mask=m, other=0.0)
            tl.store(out_x_ptr + j64 * H + offs, v, mask=m)  # rows past the total stay unwritten
        idx = tl.load(ws_idx_ptr + j64 * K + kk, mask=kmask & valid, other=-1)
        tl.store(out_idx_ptr + j64 * K + kk, idx.to(out_idx_ptr.dtype.element_ty), mask=kmask)
        if HAS_PROBS:
            p = tl.load(ws_probs_ptr + j64 * K + kk, mask=kmask & valid, other=0.0)
            tl.store(out_probs_ptr + j64 * K + kk, p, mask=kmask)


def ep_blocks(hidden: int, topk: int, world: int) -> tuple[int, int, int]:
    block_h = min(4096, triton.next_power_of_2(max(hidden, 16)))
    return block_h, triton.next_power_of_2(max(topk, 16)), triton.next_power_of_2(max(world, 2))
