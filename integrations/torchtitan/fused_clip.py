"""Gradient clipping folded into the fused AdamW step (``turbo.fused_clip``; single-device TorchTitan runs).

TorchTitan's ``train_step`` clips with ``dist_utils.clip_grad_norm_``: the total norm (one read of every
gradient), then ``torch._foreach_mul_`` of every gradient by min(1, max_norm / norm): a read and a write of
all fp32 gradients, 4.9 ms per step on H200 for ``deepseek_moe_fp8`` (2.2B parameters), even when the factor
is 1. torch's fused Adam/AdamW already divides each gradient by ``optimizer.grad_scale`` inside its kernel
(the AMP GradScaler hook), so here the norm is computed as before and the factor is handed to the step as
``grad_scale = 1 / factor``: the same update without the extra pass over the gradients (when the factor is 1,
bitwise; when clipping, the scaled gradient differs by at most an ulp: g / (1 / c) instead of g * c). The
returned norm, and the logged grad_norm, are unchanged.

It applies only when every optimizer is a fused torch Adam/AdamW and the clip is the plain one TorchTitan
makes without EP, PP or DTensor parameters (FSDP/TP); otherwise, and for any other caller of the clip, the
stock function runs. ``install`` patches ``torchtitan.distributed.utils.clip_grad_norm_`` for the trainer's
lifetime (``uninstall`` restores it).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

_STATE: dict = {}  # "stock": the original function; "params": ids of the trainer's parameters; "optimizers"


def fusable(optimizers: list, params: list[torch.Tensor]) -> str | None:
    """Why the clip cannot be folded into these optimizers' step (None: it can)."""
    if not optimizers:
        return "no optimizer"
    for opt in optimizers:
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW) or not opt.defaults.get("fused"):
            return f"{type(opt).__name__} (fused={opt.defaults.get('fused')}) has no grad_scale input"
    if any(isinstance(p, DTensor) for p in params):
        return "DTensor parameters (FSDP/TP): the norm is reduced over a mesh"
    return None


def install(trainer) -> str | None:
    """Fold the clip of ``trainer`` into its optimizers' step; returns why not (None: installed)."""
    import torchtitan.distributed.utils as dist_utils

    params = [p for m in trainer.model_parts for p in m.parameters()]
    optimizers = list(getattr(trainer.optimizers, "optimizers", []))
    reason = fusable(optimizers, params)
    if reason is None and trainer.job_config.training.max_norm <= 0:
        reason = "training.max_norm <= 0 (no clipping)"
    if reason is not None:
        return reason
    _STATE.update(stock=dist_utils.clip_grad_norm_, params=[id(p) for p in params], optimizers=optimizers)
    dist_utils.clip_grad_norm_ = _clip_grad_norm_into_step
    return None


def uninstall() -> None:
    import torchtitan.distributed.utils as dist_utils

    if "stock" in _STATE:
        dist_utils.clip_grad_norm_ = _STATE.pop("stock")
    for opt in _STATE.pop("optimizers", []):
        opt.__dict__.pop("grad_scale", None)
    _STATE.clear()


def _clip_grad_norm_into_step(
    parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    foreach: bool | None = None, pp_mesh=None, ep_enabled: bool = False,
) -> torch.Tensor:  # fmt: skip
    stock = _STATE["stock"]
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if pp_mesh is not None or ep_enabled or [id(p) for p in parameters] != _STATE["params"]:
        return stock(parameters, max_norm, norm_type, error_if_nonfinite, foreach, pp_mesh, ep_enabled)
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    # clip_grads_with_norm_'s factor, kept on the device (no host sync): min(1, max_norm / (norm + 1e-6))
    factor = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0).to(torch.float32)
    scale = factor.reciprocal()
    for opt in _STATE["optimizers"]:
        opt.grad_scale = scale  # read by the fused kernel of the next step(): grad / grad_scale
    return total_norm
