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
        # A row that saw no key: l == 0, or, with a sink of -inf, m still -inf (l kept the sink's 1). Both get
        # lse = +inf and a zero output, as the TORCH backend does (a -inf sink contributes nothing).
        empty = (l_i == 0.0) | (m_i == float("-inf"))
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
