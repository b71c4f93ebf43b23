"""Flash-attention backward, dK/dV: one program owns a key block and loops over the q heads of its
GQA group and over query blocks (no atomics). Conventions: attention_kernel.py."""

from __future__ import annotations

import triton
import triton.language as tl

from primus_turbo.triton.attention.attention_kernel import _load_rows_dslice, _seq_bounds


@triton.jit
def _bwd_dkdv_inner(
    dk,
    dk1,
    dv,
    k,
    k1,
    v,
    q_base,
    do_base,
    l_base,
    d_base,
    stride_qs,
    stride_dos,
    start_m,
    end_m,
    cols,
    len_q,
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
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for m in range(start_m, end_m, BLOCK_M):
        rows = m + offs_m
        qt_ptrs = q_base + rows[None, :] * stride_qs + offs_dqk[:, None]
        do_ptrs = do_base + rows[:, None] * stride_dos + offs_dv[None, :]
        if MASKED:
            qt = tl.load(qt_ptrs, mask=(rows[None, :] < len_q) & (offs_dqk[:, None] < D_QK), other=0.0)
            do = tl.load(do_ptrs, mask=(rows[:, None] < len_q) & (offs_dv[None, :] < D_V), other=0.0)
            lse = tl.load(l_base + rows, mask=rows < len_q, other=float("inf"))
            delta = tl.load(d_base + rows, mask=rows < len_q, other=0.0)
        else:
            qt = tl.load(qt_ptrs, mask=offs_dqk[:, None] < D_QK, other=0.0)
            do = tl.load(do_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
            lse = tl.load(l_base + rows)
            delta = tl.load(d_base + rows)
        # transposed scores: [BLOCK_N, BLOCK_M], lse is natural-log so scale it to base 2
        qkt = tl.dot(k, qt)
        if BLOCK_DQK1 > 0:
            qt1_ptrs = q_base + rows[None, :] * stride_qs + BLOCK_DQK + tl.arange(0, BLOCK_DQK1)[:, None]
            if MASKED:
                qt1 = tl.load(qt1_ptrs, mask=rows[None, :] < len_q, other=0.0)
            else:
                qt1 = tl.load(qt1_ptrs)
            qkt = tl.dot(k1, qt1, qkt)
        else:
            qt1 = qt
        qkt = qkt * qk_scale
        pt = tl.math.exp2(qkt - lse[None, :] * 1.4426950408889634)
        if MASKED:
            valid_t = cols[:, None] < len_k
            if HAS_LEFT:
                valid_t = valid_t & (cols[:, None] >= rows[None, :] + off - window_left)
            if HAS_RIGHT:
                valid_t = valid_t & (cols[:, None] <= rows[None, :] + off + window_right)
            pt = tl.where(valid_t, pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
        if BLOCK_DQK1 > 0:
            dk1 = tl.dot(dst.to(qt1.dtype), tl.trans(qt1), dk1)
    return dk, dk1, dv


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
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
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_lb,
    stride_lh,
    seqlen_q,
    seqlen_k,
    num_heads_k,
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
    """Grid (cdiv(max_seqlen_k, BLOCK_N), batch * Hk): one key block, all q heads of its group."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_k
    hk = pid_bh % num_heads_k
    q_start, len_q = _seq_bounds(CU_Q, b, seqlen_q, IS_VARLEN)
    k_start, len_k = _seq_bounds(CU_K, b, seqlen_k, IS_VARLEN)
    n_start = pid_n * BLOCK_N
    if n_start < len_k:
        off = len_k - len_q
        cols = n_start + tl.arange(0, BLOCK_N)
        offs_dqk = tl.arange(0, BLOCK_DQK)
        offs_dv = tl.arange(0, BLOCK_DV)
        k_base = K + b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
        k = tl.load(
            k_base + cols[:, None] * stride_ks + offs_dqk[None, :],
            mask=(cols[:, None] < len_k) & (offs_dqk[None, :] < D_QK),
            other=0.0,
        )
        v = tl.load(
            v_base + cols[:, None] * stride_vs + offs_dv[None, :],
            mask=(cols[:, None] < len_k) & (offs_dv[None, :] < D_V),
            other=0.0,
        )
        dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
        k1 = _load_rows_dslice(k_base, cols, stride_ks, len_k, BLOCK_DQK, BLOCK_DQK1, k)
        if BLOCK_DQK1 > 0:
            dk1 = tl.zeros([BLOCK_N, BLOCK_DQK1], dtype=tl.float32)
        else:
            dk1 = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # unused placeholder
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        # query rows that see any key of this block: [lo, hi); rows that see all of them and are
        # in bounds: [full_lo, full_hi)
        lo = 0
        hi = len_q
        full_lo = 0
        full_hi = len_q
        if HAS_RIGHT:
            lo = tl.maximum(n_start - off - window_right, 0)
            full_lo = tl.maximum(n_start + BLOCK_N - 1 - off - window_right, 0)
        if HAS_LEFT:
            hi = tl.minimum(n_start + BLOCK_N - 1 - off + window_left + 1, len_q)
            full_hi = tl.minimum(n_start - off + window_left + 1, len_q)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(full_lo, BLOCK_M) * BLOCK_M
        hi = tl.maximum(hi, 0)
        full_hi = (tl.maximum(full_hi, 0) // BLOCK_M) * BLOCK_M
        if n_start + BLOCK_N > len_k:  # ragged key tail: every block needs the column mask
            full_lo = hi
        full_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
        full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
        for g in range(0, group_size):
            h = hk * group_size + g
            q_base = Q + b.to(tl.int64) * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
            do_base = DO + b.to(tl.int64) * stride_dob + q_start.to(tl.int64) * stride_dos + h * stride_doh
            l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
            d_base = DELTA + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
            dk, dk1, dv = _bwd_dkdv_inner(
                dk,
                dk1,
                dv,
                k,
                k1,
                v,
                q_base,
                do_base,
                l_base,
                d_base,
                stride_qs,
                stride_dos,
                lo,
                full_lo,
                cols,
                len_q,
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
                BLOCK_M,
                True,
                HAS_LEFT,
                HAS_RIGHT,
            )
            dk, dk1, dv = _bwd_dkdv_inner(
                dk,
                dk1,
                dv,
                k,
                k1,
                v,
                q_base,
                do_base,
                l_base,
                d_base,
                stride_qs,
                stride_dos,
                full_lo,
                full_hi,
                cols,
                len_q,
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
                BLOCK_M,
                False,
                HAS_LEFT,
                HAS_RIGHT,
            )
            dk, dk1, dv = _bwd_dkdv_inner(
                dk,
                dk1,
                dv,
                k,
                k1,
                v,
                q_base,
                do_base,
                l_base,
                d_base,
                stride_qs,
                stride_dos,
                full_hi,
                hi,
                cols,
                len_q,
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
                BLOCK_M,
                True,
                HAS_LEFT,
                HAS_RIGHT,
            )
        dk = dk * sm_scale
        dk_base = DK + b.to(tl.int64) * stride_dkb + k_start.to(tl.int64) * stride_dks + hk * stride_dkh
        dv_base = DV + b.to(tl.int64) * stride_dvb + k_start.to(tl.int64) * stride_dvs + hk * stride_dvh
        tl.store(
            dk_base + cols[:, None] * stride_dks + offs_dqk[None, :],
            dk.to(DK.dtype.element_ty),
            mask=(cols[:, None] < len_k) & (offs_dqk[None, :] < D_QK),
        )
        if BLOCK_DQK1 > 0:
            offs_d1 = BLOCK_DQK + tl.arange(0, BLOCK_DQK1)
            tl.store(
                dk_base + cols[:, None] * stride_dks + offs_d1[None, :],
                (dk1 * sm_scale).to(DK.dtype.element_ty),
                mask=cols[:, None] < len_k,
            )
        tl.store(
            dv_base + cols[:, None] * stride_dvs + offs_dv[None, :],
            dv.to(DV.dtype.element_ty),
            mask=(cols[:, None] < len_k) & (offs_dv[None, :] < D_V),
        )
