"""Gated activations (SwiGLU / GeGLU), optionally scaled by a per-row router probability.

Layout (Megatron-Core convention): ``x`` is ``[N, 2H]``; the gate is ``x[:, :H]``, the up
projection ``x[:, H:]``; ``out = act(gate) * up * probs[:, None]``.

A program owns BLOCK_R rows (one by default, see ``launch_config``), looping over H in BLOCK_H
chunks: the probs gradient is a full-row reduction, and rows (tokens) are numerous in MoE, so a
row per program keeps the grid large without a second reduction pass. All arithmetic is fp32
(bf16 stays the storage type). No @triton.jit helpers: the sm_90 compile check
(tests/pytorch/triton_compile_utils.py) cannot resolve them under the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACT_SILU = 0
ACT_GELU = 1  # exact (erf) GeLU, as torch.nn.functional.gelu's default


@triton.jit
def glu_fwd_kernel(
    x_ptr,
    probs_ptr,
    out_ptr,
    N,
    H,
    stride_x,
    stride_out,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = rows < N
    x_rows = x_ptr + rows[:, None] * stride_x
    out_rows = out_ptr + rows[:, None] * stride_out
    if HAS_PROBS:
        scale = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    else:
        scale = tl.full([BLOCK_R, 1], 1.0, tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols < H)[None, :]
        g = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            act = g / (1.0 + tl.exp(-g))
        else:
            act = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        y = act * u * scale
        tl.store(out_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd_kernel(
    grad_out_ptr,
    x_ptr,
    probs_ptr,
    grad_x_ptr,
    grad_probs_ptr,
    N,
    H,
    stride_g,
    stride_x,
    stride_gx,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    row_ok = rows < N
    g_rows = grad_out_ptr + rows[:, None] * stride_g
    x_rows = x_ptr + rows[:, None] * stride_x
    gx_rows = grad_x_ptr + rows[:, None] * stride_gx
    if HAS_PROBS:
        scale = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    else:
        scale = tl.full([BLOCK_R, 1], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols < H)[None, :]
        dy = tl.load(g_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_rows + H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            sig = 1.0 / (1.0 + tl.exp(-g))
            act = g * sig
            dact = sig * (1.0 + g * (1.0 - sig))
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            act = g * cdf
            dact = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
        acc += dy * act * u  # unconditional: a constexpr-guarded loop-carried value miscompiles
        dys = dy * scale
        tl.store(gx_rows + cols[None, :], (dys * u * dact).to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(gx_rows + H + cols[None, :], (dys * act).to(grad_x_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(grad_probs_ptr + rows, tl.sum(acc, axis=1).to(grad_probs_ptr.dtype.element_ty), mask=row_ok)


def launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps) for rows of ``hidden`` outputs: one row per program in chunks of
    <= 1024 columns (8 elements per thread at 4 warps: 16-byte bf16 accesses), forward and
    backward. Measured (benchmark/ops/sweep_glu.py, H200, GPU time): the best or within 2% of the best
    of 24 (BLOCK_R, BLOCK_H, warps) variants at 32768 x 2048, 49152 x 1408 and 8192 x 14336, at 94-100%
    of the same-size copy; whole-row tiles (BLOCK_H 4096) and 16 warps lose 5-45%."""
    return 1, min(1024, triton.next_power_of_2(max(hidden, 16))), 4
