"""Gated activations (SwiGLU / GeGLU), optionally scaled by a per-row router probability.

Layout (Megatron-Core convention): ``x`` is ``[N, 2H]``; the gate is ``x[:, :H]``, the up
projection ``x[:, H:]``; ``out = act(gate) * up * probs[:, None]``.

One program per row, looping over H in BLOCK_H chunks: the probs gradient is a full-row
reduction, and rows (tokens) are numerous in MoE, so a row per program keeps the grid large
without a second reduction pass. All arithmetic is fp32 (bf16 stays the storage type).
No @triton.jit helpers: the sm_90
compile check (tests/pytorch/triton_compile_utils.py) cannot resolve them under the interpreter.
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
    H,
    stride_x,
    stride_out,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    scale = 1.0
    if HAS_PROBS:
        scale = tl.load(probs_ptr + row).to(tl.float32)
    for start in range(0, H, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        mask = offs < H
        g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + H + offs, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            act = g / (1.0 + tl.exp(-g))
        else:
            act = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        y = act * u * scale
        tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def glu_bwd_kernel(
    grad_out_ptr,
    x_ptr,
    probs_ptr,
    grad_x_ptr,
    grad_probs_ptr,
    H,
    stride_g,
    stride_x,
    stride_gx,
    ACT: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g_row = grad_out_ptr + row * stride_g
    x_row = x_ptr + row * stride_x
    gx_row = grad_x_ptr + row * stride_gx
    scale = 1.0
    if HAS_PROBS:
        scale = tl.load(probs_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        mask = offs < H
        dy = tl.load(g_row + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + H + offs, mask=mask, other=0.0).to(tl.float32)
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
        tl.store(gx_row + offs, (dys * u * dact).to(grad_x_ptr.dtype.element_ty), mask=mask)
        tl.store(gx_row + H + offs, (dys * act).to(grad_x_ptr.dtype.element_ty), mask=mask)
    if HAS_PROBS:
        tl.store(grad_probs_ptr + row, tl.sum(acc, axis=0).to(grad_probs_ptr.dtype.element_ty))


def block_h_for(hidden: int) -> int:
    # 1024 fp32 lanes per chunk = 8 elements/thread at 4 warps: full 16 B bf16 vector loads.
    return min(1024, triton.next_power_of_2(max(hidden, 16)))
