"""fp64 reference of FP8 quantization: explicit loops over scaling groups (small shapes only)."""

from __future__ import annotations

import math

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def ref_scale(amax: float, fp8_dtype: torch.dtype, pow2: bool = False) -> float:
    scale = FP8_MAX[fp8_dtype] / amax if amax > 0 else 1.0
    scale = min(scale, torch.finfo(torch.float32).max)
    if pow2:
        scale = 2.0 ** math.floor(math.log2(scale))
    return float(torch.tensor(scale, dtype=torch.float32))


def ref_quantize_groups(x: torch.Tensor, gr: int, gc: int, fp8_dtype, pow2: bool = False):
    """x 2-D; group (gr, gc), 0 = whole dim. Returns (fp8 values as fp64, scale_inv grid fp64)."""
    x = x.double()
    rows, cols = x.shape
    gr, gc = gr or rows, gc or cols
    nr, nc = -(-rows // gr), -(-cols // gc)
    out = torch.empty_like(x)
    scale_inv = torch.empty(nr, nc, dtype=torch.float64)
    fmax = FP8_MAX[fp8_dtype]
    for i in range(nr):
        for j in range(nc):
            blk = x[i * gr : (i + 1) * gr, j * gc : (j + 1) * gc]
            finite = blk.abs()[torch.isfinite(blk)]
            amax = float(finite.max()) if finite.numel() else 0.0
            scale = ref_scale(amax, fp8_dtype, pow2)
            y = torch.where(torch.isnan(blk), blk, (blk * scale).clamp(-fmax, fmax))
            out[i * gr : (i + 1) * gr, j * gc : (j + 1) * gc] = y.to(fp8_dtype).double()
            scale_inv[i, j] = 1.0 / scale
    return out, scale_inv
