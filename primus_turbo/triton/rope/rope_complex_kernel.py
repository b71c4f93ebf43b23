"""Rotary position embedding in the complex (interleaved-pair) form of DeepSeek / TorchTitan, on the last
``2 * ROPE_PAIRS`` elements of each [B, S, H, D] row, the first ``2 * NOPE_PAIRS`` copied: one pass each way.

Per position s, with (xr, xi) = elements (2j, 2j + 1) of the rotary part, (c, s) = (Re, Im) freqs_cis[s, j]:
    forward   out = (xr * c - xi * s,  xr * s + xi * c)      (x * freqs_cis, as complex numbers)
    backward  dx  = (gr * c + gi * s, -gr * s + gi * c)      (g * conj(freqs_cis))
in fp32 with one rounding of the result, as TorchTitan's ``apply_rotary_emb`` (x.float() times complex64
freqs, then .to(dtype)). The output is contiguous [B, S, H, D]: for MLA's q this replaces the split, the two
casts, the complex multiply and the cat of the nope and rope parts (and in the backward the cat of their
gradients) with one read and one write of q.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_complex_kernel(
    x_ptr, f_ptr, out_ptr, S, H, stride_xb, stride_xs, stride_xh, stride_fs,
    PAIRS: tl.constexpr, NOPE_PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * S + s
    b = row // S
    s = row % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    p = tl.arange(0, BLOCK_P)
    pmask = p < PAIRS
    rot = pmask & (p >= NOPE_PAIRS)
    j = tl.where(rot, p - NOPE_PAIRS, 0)
    c = tl.load(f_ptr + s.to(tl.int64) * stride_fs + 2 * j, mask=rot, other=1.0)[None, :]
    sn = tl.load(f_ptr + s.to(tl.int64) * stride_fs + 2 * j + 1, mask=rot, other=0.0)[None, :]
    if BACKWARD:
        sn = -sn
    mask = (heads < H)[:, None] & pmask[None, :]
    x_row = x_ptr + b.to(tl.int64) * stride_xb + s.to(tl.int64) * stride_xs
    x_row += heads[:, None].to(tl.int64) * stride_xh
    xr = tl.load(x_row + 2 * p[None, :], mask=mask, other=0.0)
    xi = tl.load(x_row + 2 * p[None, :] + 1, mask=mask, other=0.0)
    xr32, xi32 = xr.to(tl.float32), xi.to(tl.float32)
    keep = rot[None, :]
    dtype = out_ptr.dtype.element_ty
    o_r = tl.where(keep, (xr32 * c - xi32 * sn).to(dtype), xr.to(dtype))  # the nope part: an exact copy
    o_i = tl.where(keep, (xr32 * sn + xi32 * c).to(dtype), xi.to(dtype))
    o_row = out_ptr + (row.to(tl.int64) * H + heads[:, None].to(tl.int64)) * (2 * PAIRS)
    tl.store(o_row + 2 * p[None, :], o_r, mask=mask)
    tl.store(o_row + 2 * p[None, :] + 1, o_i, mask=mask)


def launch_rope_complex(x, freqs, out, rope_dim: int, backward: bool) -> None:
    """x: [B, S, H, D] with unit stride along D; freqs: fp32 [>= S, rope_dim / 2, 2] (view_as_real of the
    complex freqs, unit stride along the last two dims); out: contiguous [B, S, H, D]."""
    batch, seq, heads, dim = x.shape
    if x.numel() == 0:
        return
    pairs = dim // 2
    block_p = triton.next_power_of_2(pairs)
    block_h = min(triton.next_power_of_2(heads), max(1, 2048 // block_p))
    grid = (batch * seq, triton.cdiv(heads, block_h))
    rope_complex_kernel[grid](
        x, freqs, out, seq, heads, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0),
        PAIRS=pairs, NOPE_PAIRS=(dim - rope_dim) // 2, BLOCK_P=block_p, BLOCK_H=block_h, BACKWARD=backward,
        num_warps=4,
    )  # fmt: skip
