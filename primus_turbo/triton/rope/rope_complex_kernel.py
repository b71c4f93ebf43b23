"""Rotary position embedding in the complex (interleaved-pair) form of DeepSeek / TorchTitan, on the last
``rope_dim`` elements of each [B, S, H, D] row, the first ``D - rope_dim`` copied: one pass each way.

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
    x_ptr, f_ptr, out_ptr, T, S, H, stride_xb, stride_xs, stride_xh, stride_fs,
    NOPE: tl.constexpr, ROPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    """BLOCK_T (b, s, h) rows per program, each read and written as contiguous tiles (16-byte vectors): the
    pairs are split out of the loaded tile in registers, not loaded at a stride of 2 (measured on an H200:
    stride-2 loads and stores ran q [2, 4096, 16, 192] at 11% of the copy bandwidth)."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # (b, s, h) flattened
    tmask = t < T
    h = t % H
    s = (t // H) % S
    b = t // H // S
    x_row = (x_ptr + b * stride_xb + s * stride_xs + h * stride_xh)[:, None]
    o_row = (out_ptr + t * (NOPE + ROPE))[:, None]
    if NOPE > 0:  # copied as is
        n = tl.arange(0, BLOCK_N)[None, :]
        nmask = tmask[:, None] & (n < NOPE)
        tl.store(o_row + n, tl.load(x_row + n, mask=nmask), mask=nmask)
    r = tl.arange(0, BLOCK_R)[None, :]
    rmask = tmask[:, None] & (r < ROPE)
    x = tl.load(x_row + NOPE + r, mask=rmask, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + s[:, None] * stride_fs + r, mask=rmask, other=0.0)
    xr, xi = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_R // 2, 2)))
    c, sn = tl.split(tl.reshape(f, (BLOCK_T, BLOCK_R // 2, 2)))
    if BACKWARD:
        sn = -sn
    out = tl.reshape(tl.join(xr * c - xi * sn, xr * sn + xi * c), (BLOCK_T, BLOCK_R))
    tl.store(o_row + NOPE + r, out.to(out_ptr.dtype.element_ty), mask=rmask)


def rows_per_program(rows: int, row_block: int) -> int:
    """BLOCK_T: a power of two (tl.arange) near 4096 elements per program, at most 64 rows and at most rows
    rounded up."""
    fit = max(1, 4096 // row_block)
    return min(64, 1 << (fit.bit_length() - 1), triton.next_power_of_2(rows))


def launch_rope_complex(x, freqs, out, rope_dim: int, backward: bool) -> None:
    """x: [B, S, H, D] with unit stride along D; freqs: fp32 [>= S, rope_dim / 2, 2] (view_as_real of the
    complex freqs, unit stride along the last two dims); out: contiguous [B, S, H, D]."""
    batch, seq, heads, dim = x.shape
    if x.numel() == 0:
        return
    rows = batch * seq * heads
    nope = dim - rope_dim
    block_n = triton.next_power_of_2(nope) if nope else 1
    block_r = max(2, triton.next_power_of_2(rope_dim))
    block_t = rows_per_program(rows, block_n + block_r)
    rope_complex_kernel[(triton.cdiv(rows, block_t),)](
        x, freqs, out, rows, seq, heads, x.stride(0), x.stride(1), x.stride(2), freqs.stride(0),
        NOPE=nope, ROPE=rope_dim, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_R=block_r, BACKWARD=backward,
        num_warps=4,
    )  # fmt: skip
