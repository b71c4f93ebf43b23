"""Flash-attention-2 style Triton kernels (forward, backward) for sm_90.

One set of kernels serves fixed-length (BSHD) and packed variable-length (THD) inputs: a sequence
``b`` starts at token ``start`` (0 for BSHD, ``cu_seqlens[b]`` for THD) and its base pointer is
``ptr + b * stride_b + start * stride_s`` (``stride_b`` is 0 for THD).

Masks (flash-attn semantics, bottom-right aligned): with ``off = len_k - len_q``, query ``i`` sees key
``j`` iff ``j >= i + off - left`` (when a left window is set) and ``j <= i + off + right`` (when a
right window is set; causal is ``right = 0``). A row that sees no key outputs 0 and stores
``lse = +inf`` (so the backward's ``exp(s - lse)`` is 0 there), as flash-attn does.

Attention sink (gpt-oss): an extra per-head logit ``sink[h]`` in every row's softmax denominator,
with no value row. The online softmax simply starts from ``m = sink, l = 1``.

Each key loop is split in three phases, masked / unmasked / masked, so the bulk of the blocks
skips the mask arithmetic. A q/k head dim that is a sum of two powers of two (192 = 128 + 64, MLA)
runs as two dot products over the slices ``[0, BLOCK_DQK)`` and ``[BLOCK_DQK, BLOCK_DQK +
BLOCK_DQK1)`` instead of being padded to 256 (17-19% fewer MMA flops for 192/128); other dims are
padded to the next power of two with masked loads (``BLOCK_DQK1 = 0``).

The backward never uses atomics: dK/dV programs own a key block (and loop over the q heads of
their GQA group and over q blocks), dQ programs own a query block. Gradients are therefore
bitwise deterministic run to run.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _seq_bounds(CU, b, fixed_len, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    else:
        start = b * 0  # a tensor, so that .to(tl.int64) works on both paths
        length = fixed_len
    return start, length


@triton.jit
def _key_ranges(
    m_start,
    len_q,
    len_k,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Key blocks seen by query rows [m_start, m_start + BLOCK_M): [lo, full_lo) and [full_hi, hi)
    need the mask, [full_lo, full_hi) do not."""
    off = len_k - len_q
    lo = 0
    full_lo = 0
    hi = len_k
    full_hi = len_k
    if HAS_LEFT:
        lo = tl.maximum(m_start + off - window_left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(m_start + BLOCK_M - 1 + off - window_left, 0)
        full_lo = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(m_start + BLOCK_M - 1 + off + window_right + 1, len_k)
        full_hi = tl.minimum(m_start + off + window_right + 1, len_k)
    hi = tl.maximum(hi, 0)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _valid_mask(
    rows, cols, len_k, off, window_left, window_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    valid = cols[None, :] < len_k
    if HAS_LEFT:
        valid = valid & (cols[None, :] >= rows[:, None] + off - window_left)
    if HAS_RIGHT:
        valid = valid & (cols[None, :] <= rows[:, None] + off + window_right)
    return valid


@triton.jit
def _load_rows_dslice(base, rows, stride_s, length, D_START: tl.constexpr, WIDTH: tl.constexpr, fallback):
    """[rows, D_START:D_START+WIDTH] of a [S, D] tile (the second head-dim slice); ``fallback``
    when there is no second slice (WIDTH == 0)."""
    if WIDTH > 0:
        offs = D_START + tl.arange(0, WIDTH)
        return tl.load(
            base + rows[:, None] * stride_s + offs[None, :], mask=rows[:, None] < length, other=0.0
        )
    else:
        return fallback


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    q1,
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
        v_ptrs = v_base + cols[:, None] * stride_vs + offs_dv[None, :]
        if MASKED:
            kt = tl.load(kt_ptrs, mask=(cols[None, :] < len_k) & (offs_dqk[:, None] < D_QK), other=0.0)
            v = tl.load(v_ptrs, mask=(cols[:, None] < len_k) & (offs_dv[None, :] < D_V), other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=offs_dqk[:, None] < D_QK, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < D_V, other=0.0)
        qk = tl.dot(q, kt)
        if BLOCK_DQK1 > 0:  # second head-dim slice (192 = 128 + 64), no padding to 256
            kt1_ptrs = k_base + cols[None, :] * stride_ks + BLOCK_DQK + tl.arange(0, BLOCK_DQK1)[:, None]
            if MASKED:
                kt1 = tl.load(kt1_ptrs, mask=cols[None, :] < len_k, other=0.0)
            else:
                kt1 = tl.load(kt1_ptrs)
            qk = tl.dot(q1, kt1, qk)
        qk = qk * qk_scale
        if MASKED:
            valid = _valid_mask(rows, cols, len_k, off, window_left, window_right, HAS_LEFT, HAS_RIGHT)
            qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k", "window_left", "window_right"])
def attn_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    SINK,
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
    stride_ob,
    stride_os,
    stride_oh,
    stride_lb,
    stride_lh,
    seqlen_q,
    seqlen_k,
    num_heads_q,
    group_size,
    qk_scale,
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
    HAS_SINK: tl.constexpr,
):
    """Grid (cdiv(max_seqlen_q, BLOCK_M), batch * Hq). ``qk_scale`` = softmax_scale * log2(e)."""
    pid_m = tl.program_id(0)
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
        k_base = K + b.to(tl.int64) * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
        q = tl.load(
            q_base + rows[:, None] * stride_qs + offs_dqk[None, :],
            mask=(rows[:, None] < len_q) & (offs_dqk[None, :] < D_QK),
            other=0.0,
        )
        q1 = _load_rows_dslice(q_base, rows, stride_qs, len_q, BLOCK_DQK, BLOCK_DQK1, q)
        if HAS_SINK:
            m_i = (
                tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINK + h).to(tl.float32) * 1.4426950408889634
            )
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
        else:
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        lo, full_lo, full_hi, hi = _key_ranges(
            m_start, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            q1,
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
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            q1,
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
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            q1,
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
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(
            empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
        )
        o_base = Out + b.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
        tl.store(
            o_base + rows[:, None] * stride_os + offs_dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=(rows[:, None] < len_q) & (offs_dv[None, :] < D_V),
        )
        l_base = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + q_start
        tl.store(l_base + rows, lse, mask=rows < len_q)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
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
