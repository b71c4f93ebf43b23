"""Row-range memory kernels shared by several ops (MoE permute buffers, grouped GEMM outputs).

No @triton.jit helpers (see activation_kernel.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def zero_rows_from_kernel(
    out_ptr,
    probs_ptr,
    start_ptr,  # int scalar on the device: the first row to zero (rows before it were written)
    N,
    H,
    stride_out,
    HAS_PROBS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Zero rows [start, N) of out [N, H] (and of probs [N]) without a host sync: the programs start at the
    tile holding ``start`` (read on the device), so only the tail is written."""
    start = tl.load(start_ptr).to(tl.int64)
    rr = tl.arange(0, BLOCK_R)
    hh = tl.arange(0, BLOCK_H)
    first = tl.maximum(start, 0) // BLOCK_R
    for tile in range(first + tl.program_id(0), tl.cdiv(N, BLOCK_R), tl.num_programs(0)):
        rows = tile * BLOCK_R + rr
        rmask = (rows >= start) & (rows < N)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + hh
            zero = tl.zeros((BLOCK_R, BLOCK_H), dtype=out_ptr.dtype.element_ty)
            tl.store(
                out_ptr + rows[:, None] * stride_out + offs[None, :],
                zero,
                mask=rmask[:, None] & (offs < H)[None, :],
            )
        if HAS_PROBS:
            tl.store(probs_ptr + rows, tl.zeros((BLOCK_R,), dtype=probs_ptr.dtype.element_ty), mask=rmask)
