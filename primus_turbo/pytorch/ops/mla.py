"""Multi-head latent attention (DeepSeek-V2/V3) helpers.

    k, v = mla_key_value(kv, k_pe, nope_dim)

``kv``: the wkv_b projection viewed [B, S, H, nope_dim + v_dim]; ``k_pe``: the shared rotary key [B, S, 1, R]
(already rotated). Returns k = [kv[..., :nope_dim], k_pe broadcast over the heads] [B, S, H, nope_dim + R] and
v = kv[..., nope_dim:] [B, S, H, v_dim], both contiguous, in one kernel; the backward writes kv's gradient
(keys' nope part next to the values') and k_pe's (the keys' rope part summed over heads in fp32) in one more.
Equals ``torch.split`` + ``torch.cat([k_nope, k_pe.expand(...)])`` as TorchTitan's MLA writes it.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.kernels.attention.mla_kv_impl import mla_kv_bwd, mla_kv_fwd

__all__ = ["mla_key_value"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _MLAKeyValue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, k_pe, nope):
        ctx.nope = nope
        ctx.shapes = (kv.shape[-1] - nope, k_pe.shape[-1])
        return mla_kv_fwd(kv, k_pe, nope)

    @staticmethod
    def backward(ctx, dk, dv):
        vd, rope = ctx.shapes
        if dk is None or dv is None:  # one of k / v unused: its gradient is zero
            like = dv if dk is None else dk
            b, s, h = like.shape[:3]
            dk = dk if dk is not None else like.new_zeros((b, s, h, ctx.nope + rope))
            dv = dv if dv is not None else like.new_zeros((b, s, h, vd))
        if dk.shape[2] == 0:  # no head: k_pe's gradient is an empty sum, which the kernel leaves unwritten
            b, s = dk.shape[:2]
            return dk.new_empty((b, s, 0, ctx.nope + vd)), dk.new_zeros((b, s, 1, rope)), None
        dk, dv = (g if g.stride(-1) == 1 else g.contiguous() for g in (dk, dv))
        dkv, dpe = mla_kv_bwd(dk, dv, ctx.nope)
        return dkv, dpe, None


def mla_key_value(kv: torch.Tensor, k_pe: torch.Tensor, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of MLA from ``kv`` [B, S, H, nope_dim + v_dim] and ``k_pe`` [B, S, 1, R]; see the module doc."""
    for name, t in (("kv", kv), ("k_pe", k_pe)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype not in _FLOAT_DTYPES:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"mla_key_value: {name} must be a 4-D float tensor, got {got}")
    int_like = isinstance(nope_dim, (int, torch.SymInt)) and not isinstance(nope_dim, bool)  # SymInt: traced
    if not int_like or not 0 < nope_dim < kv.shape[-1]:
        raise ValueError(
            f"mla_key_value: nope_dim={nope_dim!r} must be an int in (0, {kv.shape[-1]}) (kv's last dim)"
        )
    if k_pe.shape[:2] != kv.shape[:2] or k_pe.shape[2] != 1 or k_pe.shape[3] < 1:
        raise ValueError(
            f"mla_key_value: k_pe must be [B, S, 1, R] with kv's B, S = {tuple(kv.shape[:2])} and R >= 1, "
            f"got {tuple(k_pe.shape)}"
        )
    if k_pe.dtype != kv.dtype or k_pe.device != kv.device:
        raise ValueError(
            f"mla_key_value: k_pe ({k_pe.dtype}, {k_pe.device}) must match kv ({kv.dtype}, {kv.device})"
        )
    kv, k_pe = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, k_pe))
    return _MLAKeyValue.apply(kv, k_pe, nope_dim)
