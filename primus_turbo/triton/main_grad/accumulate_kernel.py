"""``dst[g] += src[g]`` for G equally spaced destination buffers: a grouped weight gradient added into
Megatron's per-expert ``main_grad`` buffers in one launch.

``src`` is a [G, numel] gradient (any float dtype) whose rows are contiguous; ``dst[g]`` starts at ``dst + g *
dst_stride_g`` elements (the stride may be negative: Megatron's DDP lays parameters out in reverse
order). The sum is taken in fp32 and rounded to dst's dtype, as ``torch.add_`` does, so the result is
bitwise what the per-expert ``main_grad.add_(grad)`` of DDP's hook gives.

Tile: 4096 elements per program, 4 warps (32 per thread, 16-byte vector loads): 0.87 ms for
fp32 += bf16 at [64, 2816, 2048] on an H200 (4.2 TB/s; a device-to-device copy reaches ~4.3), where
torch's mixed-dtype ``add_`` (an unvectorized dynamic-cast kernel) takes 1.30 ms in one launch and
1.57 ms as 64 per-expert launches (benchmark/ops/bench_expert_main_grad.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def accumulate_grouped_kernel(dst_ptr, src_ptr, numel, dst_stride_g, src_stride_g, BLOCK: tl.constexpr):
    g = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    src = tl.load(src_ptr + g * src_stride_g + offs, mask=mask)
    dst = dst_ptr + g * dst_stride_g + offs
    acc = tl.load(dst, mask=mask).to(tl.float32) + src.to(tl.float32)
    tl.store(dst, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def launch_accumulate_grouped(dst_first: torch.Tensor, src: torch.Tensor, dst_stride_g: int) -> None:
    """dst_first: the first destination buffer (contiguous); src: [G, *dst_first.shape], each src[g]
    contiguous (src itself may be strided along dim 0, e.g. one half of a [G, 2F, K] gradient);
    dst_stride_g: elements from one destination buffer to the next (any sign, non-overlapping)."""
    groups, numel = src.shape[0], dst_first.numel()
    if groups == 0 or numel == 0:
        return
    grid = (triton.cdiv(numel, BLOCK), groups)
    src_stride_g = src.stride(0) if groups > 1 else numel
    accumulate_grouped_kernel[grid](
        dst_first, src, numel, dst_stride_g, src_stride_g, BLOCK=BLOCK, num_warps=4
    )
