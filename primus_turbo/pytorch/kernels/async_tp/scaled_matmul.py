"""The GEMM every async-TP backend runs per block: bf16/fp16/fp32 ``torch.mm`` or the FP8 ``_scaled_mm`` with
dequant scales (tensor-wise or row-wise), K and N zero-padded to cuBLAS's multiples of 16 where needed."""

from __future__ import annotations

import torch

__all__ = ["scaled_matmul"]


def scaled_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """a @ b (bf16/fp16/fp32: torch.mm, i.e. cuBLAS) or the FP8 product with dequant scales.

    FP8: ``b`` must be column-major (``b.t()`` contiguous), as torch._scaled_mm requires.
    Non-CUDA tensors (the gloo CPU tests) never reach torch._scaled_mm: its CPU kernel is tensor-wise
    only before torch 2.13 (an INTERNAL ASSERT on row-wise scales) and its dtype support varies by
    release, so FP8 on CPU is dequantize (fp32) + torch.mm, which is also the more exact product.
    """
    if a_scale is None:
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    if not a.is_cuda:
        b_deq = b.float() if b_scale is None else b.float() * b_scale.float()
        res = torch.mm(a.float() * a_scale.float(), b_deq).to(out_dtype or torch.bfloat16)
        return res if out is None else out.copy_(res)
    rowwise = a_scale.dim() == 2  # [rows, 1]; a one-row block's scale has one element but is row-wise
    if rowwise and a_scale.data_ptr() % 16:
        a_scale = a_scale.clone()  # cuBLAS row-wise kernels need 16-byte aligned scales
    n = b.shape[1]
    if a.shape[1] % 16 or n % 16:  # cuBLAS FP8 needs K and N multiples of 16: zero-pad, then slice
        a, b, b_scale = _pad_fp8_operands(a, b, b_scale, rowwise)
        res = torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)[:, :n]
        return res.contiguous() if out is None else out.copy_(res)
    kwargs = dict(scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)
    if out is None:
        return torch._scaled_mm(a, b, **kwargs)
    return torch.ops.aten._scaled_mm.out(a, b, **kwargs, out=out)


def _pad_fp8_operands(a, b, b_scale, rowwise: bool):
    """Zero-pad K (a's columns, b's rows: zeros add nothing) and N (b's columns, sliced off after) to
    multiples of 16; b stays column-major, a row-wise b_scale [1, N] is padded with ones (with a row-wise
    ``a`` a one-element b_scale too: at N = 1 it is [1, N], and cuBLAS wants [1, padded N])."""
    (m, k), n = a.shape, b.shape[1]
    k16, n16 = -(-k // 16) * 16, -(-n // 16) * 16
    if k16 != k:
        a_pad = a.new_zeros(m, k16)
        a_pad[:, :k] = a
        a = a_pad
    b_pad = torch.zeros(n16, k16, dtype=b.dtype, device=b.device).t()  # column-major, like b
    b_pad[:k, :n] = b
    if b_scale is not None and (b_scale.numel() > 1 or rowwise):
        scale = torch.ones(1, n16, dtype=b_scale.dtype, device=b_scale.device)
        scale[:, :n] = b_scale.reshape(1, -1)  # a one-element scale broadcasts over the N columns
        b_scale = scale
    return a, b_pad, b_scale
