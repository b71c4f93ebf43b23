"""Intranode expert-parallel kernels over symmetric memory: ranks write straight into peers' buffers.

Peers' workspaces are reached through their base addresses (``peer_ptrs`` [W] int64, from
torch symmetric memory); every region offset is in bytes from that base. The host never waits:
row counts live on the device and the kernels mask by them. Grids are persistent with at most
``num_programs`` programs (bounded SMs, like DeepEP's ``num_sms``), each looping over tiles of BLOCK_R
tokens/rows (many rows in flight per program).
No @triton.jit helpers (see activation_kernel.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ep_layout_kernel(
    idx_ptr,  # [T, K] global expert ids (-1 = no route), with FROM_INDICES
    in_rank_ptr,  # [T, W] bool as uint8, without FROM_INDICES (DeepEP's is_token_in_rank)
    pos_ptr,  # [T, W] int32 out: position of token t among the tokens this rank sends to w, or -1
    peer_ptrs,  # [W] int64: workspace base address of every rank
    counts_off,  # byte offset of the [W, W] int64 count matrix in every workspace
    rank,
    T,
    W,
    K,
    experts_per_rank,
    FROM_INDICES: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program w: scan the tokens in order, number the ones that go to rank w, then publish the count into
    counts[rank, w] of every rank's workspace (the caller's barriers order it with the readers)."""
    w = tl.program_id(0)
    tt = tl.arange(0, BLOCK_T)
    kk = tl.arange(0, BLOCK_K)
    carry = tl.zeros((), dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        tok = t0 + tt
        tmask = tok < T
        tok64 = tok.to(tl.int64)
        if FROM_INDICES:
            m = tmask[:, None] & (kk < K)[None, :]
            e = tl.load(idx_ptr + tok64[:, None] * K + kk[None, :], mask=m, other=-1).to(tl.int32)
            hit = (e >= 0) & (e >= w * experts_per_rank) & (e < (w + 1) * experts_per_rank)
            inr = tl.max(hit.to(tl.int32), axis=1)
        else:
            inr = (tl.load(in_rank_ptr + tok64 * W + w, mask=tmask, other=0) != 0).to(tl.int32)
        pos = carry + tl.cumsum(inr, axis=0) - inr
        tl.store(pos_ptr + tok64 * W + w, tl.where(inr > 0, pos, -1), mask=tmask)
        carry += tl.sum(inr, axis=0)
    for p in range(W):
        dst = (tl.load(peer_ptrs + p) + counts_off).to(tl.pointer_type(tl.int64))
        tl.store(dst + rank * W + w, carry.to(tl.int64))


@triton.jit
def ep_dispatch_push_kernel(
    x_ptr,
    idx_ptr,
    probs_ptr,
    scale_ptr,
    pos_ptr,  # [T, W] int32 from ep_layout_kernel
    counts_ptr,  # [W, W] int64 count matrix (every rank's row published)
    row_map_ptr,  # [T, W] int32 out (WRITE_MAP): row of token t in this rank's rank-major send layout, or -1
    peer_ptrs,  # [W] int64: workspace base address of every rank
    rank,
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
    WRITE_MAP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """A tile of BLOCK_R tokens per step: each [BLOCK_R, BLOCK_H] slice of x is loaded once and stored
    to every destination rank that receives the token (many rows in flight per program: one row at a
    time left the push latency-bound). Token t lands on rank w at row base_w + pos[t, w], where base_w =
    rows earlier ranks send to w; its send-layout row (for combine) is send_off_w + pos[t, w]."""
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    hh = tl.arange(0, BLOCK_H)
    ww = tl.arange(0, BLOCK_W)
    kmask = kk < K
    for t0 in range(tl.program_id(0) * BLOCK_R, T, tl.num_programs(0) * BLOCK_R):
        tok = t0 + rr
        tmask = tok < T
        tok64 = tok.to(tl.int64)
        tk_mask = tmask[:, None] & kmask[None, :]
        experts = tl.load(idx_ptr + tok64[:, None] * K + kk[None, :], mask=tk_mask, other=-1).to(tl.int32)
        if HAS_PROBS:
            probs = tl.load(probs_ptr + tok64[:, None] * K + kk[None, :], mask=tk_mask, other=0.0)
            probs = probs.to(tl.float32)
        for w in range(W):
            base = tl.sum(tl.load(counts_ptr + ww * W + w, mask=(ww < rank) & (ww < W), other=0), axis=0)
            pos = tl.load(pos_ptr + tok64 * W + w, mask=tmask, other=-1)
            ok = pos >= 0
            if WRITE_MAP:
                send_off = tl.sum(tl.load(counts_ptr + rank * W + ww, mask=ww < w, other=0), axis=0)
                tl.store(
                    row_map_ptr + tok64 * W + w, tl.where(ok, send_off + pos, -1).to(tl.int32), mask=tmask
                )
            dst = (base + pos).to(tl.int64)
            peer = tl.load(peer_ptrs + w)
            local = experts - w * experts_per_rank
            is_local = (experts >= 0) & (local >= 0) & (local < experts_per_rank)
            rk_mask = ok[:, None] & kmask[None, :]
            idx_dst = (peer + idx_off).to(tl.pointer_type(tl.int32)) + dst[:, None] * K + kk[None, :]
            tl.store(idx_dst, tl.where(is_local, local, -1), mask=rk_mask)
            if HAS_PROBS:
                p_dst = (peer + probs_off).to(tl.pointer_type(tl.float32)) + dst[:, None] * K + kk[None, :]
                tl.store(p_dst, tl.where(is_local, probs, 0.0), mask=rk_mask)
            if HAS_SCALE:
                s_dst = (peer + scale_off).to(tl.pointer_type(tl.float32)) + dst[:, None] * S
                for s0 in range(0, S, BLOCK_K):
                    so = s0 + kk
                    sm = ok[:, None] & (so < S)[None, :]
                    sv = tl.load(scale_ptr + tok64[:, None] * S + so[None, :], mask=sm)
                    tl.store(s_dst + so[None, :], sv, mask=sm)
        for start in range(0, H, BLOCK_H):
            offs = start + hh
            hmask = offs < H
            v = tl.load(x_ptr + tok64[:, None] * H + offs[None, :], mask=tmask[:, None] & hmask[None, :])
            for w in range(W):
                base = tl.sum(tl.load(counts_ptr + ww * W + w, mask=(ww < rank) & (ww < W), other=0), axis=0)
                pos = tl.load(pos_ptr + tok64 * W + w, mask=tmask, other=-1)
                dst = (base + pos).to(tl.int64)
                x_dst = (tl.load(peer_ptrs + w) + x_off).to(tl.pointer_type(x_ptr.dtype.element_ty))
                m = (pos >= 0)[:, None] & hmask[None, :]
                tl.store(x_dst + dst[:, None] * H + offs[None, :], v, mask=m)


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
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Row j of this rank's receive buffer came from source s (rows [base_s, base_s + counts[s, rank]));
    it goes back to s's combine buffer at s's send-layout row send_off_s[rank] + j - base_s. BLOCK_R rows
    per step, each with its own source."""
    ww = tl.arange(0, BLOCK_W)
    wmask = ww < W
    to_me = tl.load(counts_ptr + ww * W + rank, mask=wmask, other=0)  # [W]: counts[s, rank]
    base_end = tl.cumsum(to_me, axis=0)  # inclusive prefix over sources
    total = tl.sum(to_me, axis=0)
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    hh = tl.arange(0, BLOCK_H)
    for j0 in range(tl.program_id(0) * BLOCK_R, total, tl.num_programs(0) * BLOCK_R):
        j = j0 + rr
        jmask = j < total
        src = tl.sum((base_end[None, :] <= j[:, None]).to(tl.int32), axis=1)  # [R]
        src = tl.where(jmask, src, 0)
        base = tl.sum(tl.where(ww[None, :] < src[:, None], to_me[None, :], 0), axis=1)
        # send_off_s[rank] = rows s sent to ranks before me = sum_{w < rank} counts[s, w]
        row_s = tl.load(
            counts_ptr + src[:, None] * W + ww[None, :], mask=(ww < rank)[None, :] & wmask[None, :], other=0
        )
        dst = (tl.sum(row_s, axis=1) + j - base).to(tl.int64)
        peer = tl.load(peer_ptrs + src)
        j64 = j.to(tl.int64)
        y_dst = (peer + y_off).to(tl.pointer_type(y_ptr.dtype.element_ty))
        for start in range(0, H, BLOCK_H):
            offs = start + hh
            m = jmask[:, None] & (offs < H)[None, :]
            v = tl.load(y_ptr + j64[:, None] * H + offs[None, :], mask=m)
            tl.store(y_dst[:, None] + dst[:, None] * H + offs[None, :], v, mask=m)
        if HAS_W:
            km = jmask[:, None] & (kk < K)[None, :]
            wv = tl.load(w_ptr + j64[:, None] * K + kk[None, :], mask=km)
            w_dst = (peer + w_off).to(tl.pointer_type(tl.float32))
            tl.store(w_dst[:, None] + dst[:, None] * K + kk[None, :], wv, mask=km)


@triton.jit
def ep_recv_finalize_kernel(
    ws_x_ptr,
    ws_idx_ptr,
    ws_probs_ptr,
    out_x_ptr,
    out_idx_ptr,
    out_probs_ptr,
    tpe_ptr,  # [experts_per_rank] int32, zeroed: received rows per local expert (HAS_TPE)
    counts_ptr,
    rank,
    W,
    R,
    H,
    K,
    HAS_PROBS: tl.constexpr,
    HAS_TPE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Copy the received rows out of the workspace (so the next call can reuse it); rows past the
    received total get index -1 and prob 0 and unspecified data (the receive tensors are worst-case
    sized; nothing reads those rows since their indices are -1). With HAS_TPE it also counts the received
    (row, local expert) routes per expert (integer atomics: the same result in any order)."""
    ww = tl.arange(0, BLOCK_W)
    total = tl.sum(tl.load(counts_ptr + ww * W + rank, mask=ww < W, other=0), axis=0)
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    hh = tl.arange(0, BLOCK_H)
    for j0 in range(tl.program_id(0) * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
        j = j0 + rr
        j64 = j.to(tl.int64)
        valid = j < total
        for start in range(0, H, BLOCK_H):
            offs = start + hh
            m = valid[:, None] & (offs < H)[None, :]
            v = tl.load(ws_x_ptr + j64[:, None] * H + offs[None, :], mask=m)
            # rows past the total stay unwritten
            tl.store(out_x_ptr + j64[:, None] * H + offs[None, :], v, mask=m)
        in_r = (j < R)[:, None] & (kk < K)[None, :]
        km = valid[:, None] & (kk < K)[None, :]
        idx = tl.load(ws_idx_ptr + j64[:, None] * K + kk[None, :], mask=km, other=-1)
        tl.store(
            out_idx_ptr + j64[:, None] * K + kk[None, :], idx.to(out_idx_ptr.dtype.element_ty), mask=in_r
        )
        if HAS_TPE:
            ones = tl.full((BLOCK_R, BLOCK_K), 1, tl.int32)
            tl.atomic_add(tpe_ptr + idx, ones, mask=km & (idx >= 0), sem="relaxed")
        if HAS_PROBS:
            p = tl.load(ws_probs_ptr + j64[:, None] * K + kk[None, :], mask=km, other=0.0)
            tl.store(out_probs_ptr + j64[:, None] * K + kk[None, :], p, mask=in_r)


def ep_blocks(hidden: int, topk: int, world: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_H, BLOCK_K, BLOCK_W): ~16K elements of x per tile step (32 KB of bf16 in flight per
    program), columns in chunks of at most 1024."""
    block_h = min(1024, triton.next_power_of_2(max(hidden, 16)))
    block_r = max(1, min(64, 16384 // block_h))
    return block_r, block_h, triton.next_power_of_2(max(topk, 16)), triton.next_power_of_2(max(world, 2))
