"""Gated-activation kernels as torch custom ops (Triton, with an eager fallback off-GPU).

Direct-Triton op (no dispatcher): the Triton kernel is memory-bound and always the right choice on
a GPU; the eager path only serves CPUs without the Triton interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from primus_turbo.pytorch.core.utils import eager_direct, triton_can_run_on

_ACTS = {"silu": 0, "gelu": 1}


def _eager_act(gate: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate)


@eager_direct
@torch.library.custom_op("primus_turbo::glu_fwd", mutates_args=())
def glu_fwd(x: torch.Tensor, probs: torch.Tensor | None, act: str) -> torch.Tensor:
    n, two_h = x.shape
    h = two_h // 2
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0 or h == 0:
        return out
    if not triton_can_run_on(x):
        gate, up = x.float().chunk(2, dim=-1)
        y = _eager_act(gate, act) * up
        if probs is not None:
            y = y * probs.float().unsqueeze(-1)
        return out.copy_(y)
    from primus_turbo.triton.activation.activation_kernel import glu_fwd_kernel, launch_config

    block_r, block_h, warps = launch_config(h)
    glu_fwd_kernel[(triton.cdiv(n, block_r),)](
        x,
        probs if probs is not None else x,
        out,
        n,
        h,
        x.stride(0),
        out.stride(0),
        ACT=_ACTS[act],
        HAS_PROBS=probs is not None,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return out


@glu_fwd.register_fake
def _(x, probs, act):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@eager_direct
@torch.library.custom_op("primus_turbo::glu_bwd", mutates_args=())
def glu_bwd(
    grad_out: torch.Tensor, x: torch.Tensor, probs: torch.Tensor | None, act: str
) -> tuple[torch.Tensor, torch.Tensor]:
    n, two_h = x.shape
    h = two_h // 2
    grad_x = torch.empty_like(x)
    # no probs: no probs gradient (0 elements); else every row's is written below (h == 0: zeros)
    probs_shape = (0,) if probs is None else probs.shape
    if n == 0 or h == 0:
        return grad_x, torch.zeros(probs_shape, dtype=torch.float32, device=x.device)
    grad_probs = torch.empty(probs_shape, dtype=torch.float32, device=x.device)
    if not triton_can_run_on(x):
        # Explicit formulas: autograd is not available inside a custom op's implementation.
        gate, up = x.float().chunk(2, dim=-1)
        if act == "silu":
            sig = torch.sigmoid(gate)
            act_val, dact = gate * sig, sig * (1.0 + gate * (1.0 - sig))
        else:
            cdf = 0.5 * (1.0 + torch.erf(gate * 0.7071067811865476))
            act_val, dact = gate * cdf, cdf + gate * 0.3989422804014327 * torch.exp(-0.5 * gate * gate)
        dy = grad_out.float()
        if probs is not None:
            grad_probs.copy_((dy * act_val * up).sum(-1).reshape(grad_probs.shape))
            dy = dy * probs.float().reshape(-1, 1)
        grad_x.copy_(torch.cat([dy * up * dact, dy * act_val], dim=-1))
        return grad_x, grad_probs
    from primus_turbo.triton.activation.activation_kernel import glu_bwd_kernel, launch_config

    grad_out = grad_out.contiguous()
    block_r, block_h, warps = launch_config(h)
    glu_bwd_kernel[(triton.cdiv(n, block_r),)](
        grad_out,
        x,
        probs if probs is not None else x,
        grad_x,
        grad_probs if probs is not None else grad_x,  # not written without probs
        n,
        h,
        grad_out.stride(0),
        x.stride(0),
        grad_x.stride(0),
        ACT=_ACTS[act],
        HAS_PROBS=probs is not None,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return grad_x, grad_probs


@glu_bwd.register_fake
def _(grad_out, x, probs, act):
    shape = (0,) if probs is None else probs.shape
    return torch.empty_like(x), x.new_empty(shape, dtype=torch.float32)
