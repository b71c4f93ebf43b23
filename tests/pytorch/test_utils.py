"""Tolerances and accuracy metrics: the one place tests take them from."""

from __future__ import annotations

import torch

# FP8 gates (dB), from ARCHITECTURE.md > Testing.
SNR_E4M3_DB = 25.0
SNR_E5M2_DB = 20.0  # also HYBRID, whose gradients are E5M2
SNR_ATTENTION_BF16_DB = 40.0


def get_tolerances(dtype: torch.dtype) -> dict[str, float]:
    if dtype in (torch.bfloat16, torch.float16):
        return {"rtol": 1e-2, "atol": 1e-2}
    if dtype == torch.float32:
        return {"rtol": 1e-4, "atol": 1e-4}
    if dtype == torch.float64:
        return {"rtol": 1e-7, "atol": 1e-7}
    raise ValueError(f"get_tolerances: no tolerance defined for {dtype}")


def compute_snr(ref: torch.Tensor, out: torch.Tensor) -> float:
    """Signal-to-noise ratio of ``out`` against ``ref`` in dB (inf when identical)."""
    ref64 = ref.detach().double()
    err = (out.detach().double() - ref64).pow(2).sum().item()
    sig = ref64.pow(2).sum().item()
    if err == 0.0:
        return float("inf")
    return 10.0 * torch.log10(torch.tensor(sig / err)).item()


def fp8_snr_gate(fmt) -> float:
    """Minimum SNR for a given low_precision.Format (E4M3: 25 dB; E5M2/HYBRID: 20 dB)."""
    from primus_turbo.pytorch.core.low_precision import Format

    return SNR_E4M3_DB if fmt is Format.E4M3 else SNR_E5M2_DB


def assert_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None, msg: str = ""
) -> None:
    """allclose with the project tolerances of ``dtype`` (default: out's dtype); NaN never passes."""
    assert not torch.isnan(out).any(), f"{msg}: output has NaN"
    tol = get_tolerances(dtype or out.dtype)
    # compared on the host: references are often computed there (fp64 on CPU)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **tol, msg=lambda m: f"{msg}: {m}")


def assert_snr(out: torch.Tensor, ref: torch.Tensor, min_db: float, msg: str = "") -> float:
    assert torch.isfinite(out).all(), f"{msg}: output has inf/NaN"
    snr = compute_snr(ref, out)
    assert snr >= min_db, f"{msg}: SNR {snr:.1f} dB < {min_db} dB"
    return snr
