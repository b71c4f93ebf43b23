"""Flash-attention backward: the delta = rowsum(dO * O) preprocess and the dQ kernel (one program
owns a query block; no atomics). Conventions: attention_kernel.py."""

from __future__ import annotations

import triton
import triton.language as tl

from primus_turbo.triton.attention.attention_kernel import (
    _key_ranges,
    _load_rows_dslice,
    _seq_bounds,
    _valid_mask,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    Out,
    DO,
    DELTA,
    CU_Q,
    stride_ob,
    stride_os,
    stride_oh,
    stride_db,
    stride_ds,
    stride_dh,
    stride_lb,
    stride_lh,
    seqlen_q,
    num_heads_q,
    D_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """delta = rowsum(dO * Out) in fp32, stored in the LSE layout."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    q_start, len_q = _seq_bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = (rows[:, None] < len_q) & (offs_d[None, :] < D_V)
    o = tl.load(
        Out
        + b.to(tl.int64) * stride_ob
        + (q_start + rows[:, None]).to(tl.int64) * stride_os
        + h * stride_oh
        + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO
        + b.to(tl.int64) * stride_db
        + (q_start + rows[:, None]).to(tl.int64) * stride_ds
        + h * stride_dh
        + offs_d[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(
        DELTA + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + rows,
        delta,
        mask=rows < len_q,
    )


@triton.jit
def _bwd_dq_inner(
    dq,
    dq1,
    q,
    q1,
    do,
    lse,
    delta,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    start_n,
    end_n,
    rows,
    len_k,
    off,
    window_left,
    window_right,
    qk_scale,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DQK1: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n in range(start_n, end_n, BLOCK_N):
        cols = n + offs_n
        kt_ptrs = k_base + cols[None, :] * stride_ks + offs_dqk[:, None]
        vt_ptrs = v_base + cols[None, :] * stride_vs + offs_dv[:, None]
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(cols[None, :] < len_k) & (offs_dqk[:, None] < D_QK), other=0.0)
            vt = tl.load(vt_ptrs, mask=(cols[None, :] < len_k) & (offs_dv[:, None] < D_V), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_dqk[:, None] < D_QK, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_dv[:, None] < D_V, other=0.0)
        qk = tl.dot(q, kt)
        if BLOCK_DQK1 > 0:
            kt1_ptrs = k_base + cols[None, :] * stride_ks + BLOCK_DQK + tl.arange(0, BLOCK_DQK1)[:, None]
            if MASKED:
                kt1 = tl.load(kt1_ptrs, mask=cols[None, :] < len_k, other=0.0)
            else:
                kt1 = tl.load(kt1_ptrs)
            qk = tl.dot(q1, kt1, qk)
        else:
            kt1 = kt
        qk = qk * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        if MASKED:
            valid = _valid_mask(rows, cols, len_k, off, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, vt)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)
        if BLOCK_DQK1 > 0:
            dq1 = tl.dot(ds.to(kt1.dtype), tl.trans(kt1), dq1)
    return dq, dq1


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    CU_Q,
    CU_K,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_lb,
    stride_lh,
    seqlen_q,
    seqlen_k,
    num_heads_q,
    group_size,
    qk_scale,
    sm_scale,
    window_left,
    window_right,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    BLOCK_DQK: tl.constexpr,
    BLOCK_DQK1: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Grid (cdiv(max_seqlen_q, BLOCK_M), batch * Hq): one query block, no atomics."""
    pid_m = tl.program_id(0)
    if HAS_RIGHT:  # causal: the last query blocks see the most keys, launch them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    hk = h // group_size
    q_start, len_q = _seq_bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    k_start, len_k = _seq_bounds(CU_K, b, seqlen_k, IS_VARLEN)
    m_start = pid_m * BLOCK_M
    if m_start < len_q:
        off = len_k - len_q
        rows = m_start + tl.arange(0, BLOCK_M)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_base = Q + b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + q_start.to(tl.int64) * stride_dos + h * stride_doh
        k_base = K + b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
        q = tl.load(
            q_base + rows[:, None] * stride_qs + offs_dqk[None, :],
            mask=(rows[:, None] < len_q) & (offs_dqk[None, :] < D_QK),
            other=0.0,
        )
        do = tl.load(
            do_base + rows[:, None] * stride_dos + offs_dv[None, :],
            mask=(rows[:, None] < len_q) & (offs_dv[None, :] < D_V),
            other=0.0,
        )
        l_off = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start + rows
        lse = tl.load(LSE + l_off, mask=rows < len_q, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + l_off, mask=rows < len_q, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
        q1 = _load_rows_dslice(q_base, rows, stride_qs, len_q, BLOCK_DQK, BLOCK_DQK1, q)
        if BLOCK_DQK1 > 0:
            dq1 = tl.zeros([BLOCK_M, BLOCK_DQK1], dtype=tl.float32)
        else:
            dq1 = tl.zeros([BLOCK_M, 16], dtype=tl.float32)  # unused placeholder
        lo, full_lo, full_hi, hi = _key_ranges(
            m_start, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        dq, dq1 = _bwd_dq_inner(
            dq,
            dq1,
            q,
            q1,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            lo,
            full_lo,
            rows,
            len_k,
            off,
            window_left,
            window_right,
            qk_scale,
            D_QK,
            D_V,
            BLOCK_DQK,
            BLOCK_DQK1,
            BLOCK_DV,
            BLOCK_N,
            True,
            HAS_LEFT,
            HAS_RIGHT,
        )
        dq, dq1 = _bwd_dq_inner(
            dq,
            dq1,
            q,
            q1,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            full_lo,
            full_hi,
            rows,
            len_k,
            off,
            window_left,
            window_right,
            qk_scale,
            D_QK,
            D_V,
            BLOCK_DQK,
            BLOCK_DQK1,
            BLOCK_DV,
            BLOCK_N,
            False,
            HAS_LEFT,
            HAS_RIGHT,
        )
        dq, dq1 = _bwd_dq_inner(
            dq,
            dq1,
            q,
            q1,
            do,
            lse,
            delta,
            k_base,
            v_base,
            stride_ks,
            stride_vs,
            full_hi,
            hi,
            rows,
            len_k,
            off,
            window_left,
            window_right,
            qk_scale,
            D_QK,
            D_V,
            BLOCK_DQK,
            BLOCK_DQK1,
            BLOCK_DV,
            BLOCK_N,
            True,
            HAS_LEFT,
            HAS_RIGHT,
        )
        dq = dq * sm_scale
        dq_base = DQ + b.to(tl.int64) * stride_dqb + q_start.to(tl.int64) * stride_dqs + h * stride_dqh
        tl.store(
            dq_base + rows[:, None] * stride_dqs + offs_dqk[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=(rows[:, None] < len_q) & (offs_dqk[None, :] < D_QK),
        )
        if BLOCK_DQK1 > 0:
            offs_d1 = BLOCK_DQK + tl.arange(0, BLOCK_DQK1)
            tl.store(
                dq_base + rows[:, None] * stride_dqs + offs_d1[None, :],
                (dq1 * sm_scale).to(DQ.dtype.element_ty),
                mask=rows[:, None] < len_q,
            )
