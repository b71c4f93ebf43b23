"""Rotary position embedding (rotate-half form) over [S, B, H, D] in one pass each way.

Forward, per position s, batch b and a block of heads, with x1 / x2 the two halves of the rotated input:
    out[..., :D/2] = x1 * c1 - x2 * s1,   out[..., D/2:] = x2 * c2 + x1 * s2
where c / s = cos / sin(freqs[s]) * mscale, rounded to the input dtype (as Megatron's eager RoPE rounds
them; computed by torch once per freqs tensor and passed in as fp32 [S, D]), and the math runs in fp32 with
one rounding of the result. ``INTERLEAVED_INPUT`` (Megatron's MLA
layout): x1 / x2 are the even / odd input elements (Megatron de-interleaves with a strided cat first);
otherwise the first / second half. Backward is the transpose: dx1 = g1 * c1 + g2 * s2, dx2 = g2 * c2 -
g1 * s1, stored back in the input layout. Replaces ~10 eager kernels each way (two strided slices and three
cats, cos, sin, neg, three multiplies, an add). ``NOPE`` > 0: the first NOPE elements of each row are copied
through (both ways) and the rotation covers the rest (MLA's query [q_nope, rope(q_pe)] in one pass, where
Megatron splits, ropes and concatenates).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, B, H, stride_xs, stride_xb, stride_xh, stride_os, stride_ob, stride_oh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED_INPUT: tl.constexpr, BACKWARD: tl.constexpr,
    NOPE: tl.constexpr = 0, NOPE_P2: tl.constexpr = 1,
):  # fmt: skip
    row = tl.program_id(0)  # s * B + b
    s = row // B
    b = row % B
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    mask = (heads < H)[:, None]
    dtype = x_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + s * 2 * HALF + j)[None, :]
    c2 = tl.load(cos_ptr + s * 2 * HALF + HALF + j)[None, :]
    s1 = tl.load(sin_ptr + s * 2 * HALF + j)[None, :]
    s2 = tl.load(sin_ptr + s * 2 * HALF + HALF + j)[None, :]
    if INTERLEAVED_INPUT:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + HALF
    x_row = x_ptr + s.to(tl.int64) * stride_xs + b.to(tl.int64) * stride_xb + heads[:, None] * stride_xh
    o_row = out_ptr + s.to(tl.int64) * stride_os + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
    if NOPE > 0:  # the pass-through prefix, then the rotary part after it
        k = tl.arange(0, NOPE_P2)[None, :]
        k_mask = mask & (k < NOPE)
        tl.store(o_row + k, tl.load(x_row + k, mask=k_mask), mask=k_mask)
        x_row += NOPE
        o_row += NOPE
    if BACKWARD:  # x is the output gradient (rotate-half layout); out is the input gradient (input layout)
        g1 = tl.load(x_row + j[None, :], mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(x_row + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + i1[None, :], (g1 * c1 + g2 * s2).to(dtype), mask=mask)
        tl.store(o_row + i2[None, :], (g2 * c2 - g1 * s1).to(dtype), mask=mask)
    else:
        x1 = tl.load(x_row + i1[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + i2[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + j[None, :], (x1 * c1 - x2 * s1).to(dtype), mask=mask)
        tl.store(o_row + HALF + j[None, :], (x2 * c2 + x1 * s2).to(dtype), mask=mask)


def launch_rope(x, cos, sin, out, interleaved_input: bool, backward: bool, nope: int = 0) -> None:
    """x / out: [S, B, H, nope + D], unit stride along the last dim; cos / sin: contiguous fp32 [S, D] (D a
    power of two); the first ``nope`` elements of each row are copied through."""
    seq, batch, heads, width = x.shape
    dim = width - nope
    if x.numel() == 0:
        return
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // triton.next_power_of_2(width)))
    grid = (seq * batch, triton.cdiv(heads, block_h))
    rope_kernel[grid](
        x, cos, sin, out, batch, heads, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
        out.stride(2), HALF=dim // 2, BLOCK_H=block_h, INTERLEAVED_INPUT=interleaved_input,
        BACKWARD=backward, NOPE=nope, NOPE_P2=triton.next_power_of_2(max(nope, 1)), num_warps=4,
    )  # fmt: skip
