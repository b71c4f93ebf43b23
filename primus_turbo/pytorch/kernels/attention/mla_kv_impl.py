"""MLA keys / values from the wkv_b output (``primus_turbo/triton/attention/mla_kv_kernel.py``) as torch
custom ops: the Triton kernels on GPU / interpreter, the same ops in eager torch otherwise (the test twin).
Inputs are validated already (``primus_turbo.pytorch.ops.mla``)."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.utils import eager_direct, triton_can_run_on

__all__ = ["mla_kv_fwd", "mla_kv_bwd", "mla_kv_fwd_eager", "mla_kv_bwd_eager"]


def mla_kv_fwd_eager(kv, k_pe, nope: int):
    heads = kv.shape[2]
    k = torch.cat([kv[..., :nope], k_pe.expand(-1, -1, heads, -1)], dim=-1)
    return k, kv[..., nope:].contiguous()


def mla_kv_bwd_eager(dk, dv, nope: int):
    dkv = torch.cat([dk[..., :nope], dv], dim=-1)
    return dkv, dk[..., nope:].float().sum(2, keepdim=True).to(dk.dtype)


@eager_direct
@torch.library.custom_op("primus_turbo::mla_kv_fwd", mutates_args=())
def mla_kv_fwd(kv: torch.Tensor, k_pe: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k [B, S, H, nope + R], v [B, S, H, VD]) from kv [B, S, H, nope + VD] and k_pe [B, S, 1, R]."""
    if not triton_can_run_on(kv, k_pe):
        return mla_kv_fwd_eager(kv, k_pe, nope)
    from primus_turbo.triton.attention.mla_kv_kernel import launch_mla_kv_fwd

    b, s, h, width = kv.shape
    k = torch.empty((b, s, h, nope + k_pe.shape[-1]), dtype=kv.dtype, device=kv.device)
    v = torch.empty((b, s, h, width - nope), dtype=kv.dtype, device=kv.device)
    launch_mla_kv_fwd(kv, k_pe, k, v, nope)
    return k, v


@mla_kv_fwd.register_fake
def _(kv, k_pe, nope):
    b, s, h, width = kv.shape
    return kv.new_empty((b, s, h, nope + k_pe.shape[-1])), kv.new_empty((b, s, h, width - nope))


@eager_direct
@torch.library.custom_op("primus_turbo::mla_kv_bwd", mutates_args=())
def mla_kv_bwd(dk: torch.Tensor, dv: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dkv [B, S, H, nope + VD], dk_pe [B, S, 1, R]) from dk [B, S, H, nope + R] and dv [B, S, H, VD]."""
    if not triton_can_run_on(dk, dv):
        return mla_kv_bwd_eager(dk, dv, nope)
    from primus_turbo.triton.attention.mla_kv_kernel import launch_mla_kv_bwd

    b, s, h, kw = dk.shape
    dkv = torch.empty((b, s, h, nope + dv.shape[-1]), dtype=dk.dtype, device=dk.device)
    dpe = torch.empty((b, s, 1, kw - nope), dtype=dk.dtype, device=dk.device)
    launch_mla_kv_bwd(dk, dv, dkv, dpe, nope)
    return dkv, dpe


@mla_kv_bwd.register_fake
def _(dk, dv, nope):
    b, s, h, kw = dk.shape
    return dk.new_empty((b, s, h, nope + dv.shape[-1])), dk.new_empty((b, s, 1, kw - nope))
