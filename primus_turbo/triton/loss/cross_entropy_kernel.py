"""Fused softmax cross-entropy over a (possibly vocab-parallel) logits row, forward and backward.

Forward: one program per row streams the row once in BLOCK_V chunks, keeping an online max ``m`` and
sum ``s = sum(exp(x - m))`` in fp32 (one exp per element), the target logit (one scalar load) and, with
label smoothing, the row sum. With FINAL it writes the per-row loss and ``lse = m + log(s)``; without it
(a vocab shard, tensor parallel) it writes the partials ``[m, s, x_target, sum(x)]`` that the caller
combines across ranks. Backward: a 2-D grid (row, vocab block) writes
``(softmax - (1 - eps) * onehot - eps / V) * grad_loss`` in the logits dtype, from the saved lse.

Eager Megatron makes ~8 passes over an fp32 copy of the logits (cast, max, subtract, exp, sum, divide,
then the gradient's multiply and the cast back); this reads the bf16 logits once forward and once
backward and writes the bf16 gradient once. No @triton.jit helpers (see activation_kernel.py).

Targets outside [0, vocab_total) that are not ``ignore_index`` give a NaN loss (no host check) and, where
their grad_loss is non-zero, a NaN gradient row; ignored rows give loss 0 and a zero gradient. A row that
is -inf everywhere gives lse = -inf and a NaN gradient, as the unfused math does.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Forward: one row per program; 4096-element chunks (16 per thread at 8 warps) keep ~8 KB of bf16 loads
# in flight per program. Backward: 4096 columns per program (same reasoning), grid rows x ceil(V / 4096).
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def cross_entropy_fwd_kernel(
    logits_ptr,
    target_ptr,
    out_ptr,
    lse_ptr,
    rows,
    V,
    stride_row,
    vocab_start,
    vocab_total,
    ignore_index,
    smoothing,
    FINAL: tl.constexpr,
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    sx = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row of -inf so far: s stays 0
        rescale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new_safe))  # s == 0 while m == -inf
        s = s * rescale + tl.sum(tl.exp(x - m_new_safe), 0)
        m = m_new
        if SMOOTH:
            sx += tl.sum(tl.where(cols < V, x, 0.0), 0)
    target = tl.load(target_ptr + row).to(tl.int64)
    local = target - vocab_start
    is_local = (local >= 0) & (local < V)
    x_t = tl.load(base + tl.where(is_local, local, 0), mask=is_local, other=0.0).to(tl.float32)
    if FINAL:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = m_safe + tl.log(s)
        loss = lse - x_t
        if SMOOTH:
            loss = (1.0 - smoothing) * loss - smoothing * (sx / vocab_total - lse)
        valid = (target >= 0) & (target < vocab_total)
        loss = tl.where(valid, loss, float("nan"))
        loss = tl.where(target == ignore_index, 0.0, loss)
        tl.store(out_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
    else:  # partials, one [rows] slice each: max, sum of exp(x - max), target logit (0 off-shard), sum of x
        tl.store(out_ptr + row, m)
        tl.store(out_ptr + rows + row, s)
        tl.store(out_ptr + 2 * rows + row, x_t)
        tl.store(out_ptr + 3 * rows + row, sx)


@triton.jit
def cross_entropy_bwd_kernel(
    logits_ptr,
    target_ptr,
    lse_ptr,
    grad_loss_ptr,
    grad_ptr,
    V,
    stride_row,
    grad_stride_row,
    vocab_start,
    vocab_total,
    ignore_index,
    smoothing,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    target = tl.load(target_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    g = tl.load(grad_loss_ptr + row).to(tl.float32)
    g = tl.where(target == ignore_index, 0.0, g)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.exp(x - lse) - smoothing / vocab_total
    d = tl.where(cols == target - vocab_start, d - (1.0 - smoothing), d)
    # a used row whose loss is NaN (target out of range) gets a NaN gradient, not a finite softmax row
    invalid = (target < 0) | (target >= vocab_total)
    out = tl.where(invalid & (g != 0.0), float("nan"), d * g).to(grad_ptr.dtype.element_ty)
    tl.store(grad_ptr + row.to(tl.int64) * grad_stride_row + cols, out, mask=mask)
