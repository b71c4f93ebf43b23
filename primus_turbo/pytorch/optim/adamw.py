"""``turbo.optim.AdamW``: torch's AdamW (same arguments, state and state_dict) whose step is one Triton pass
per parameter, optionally scaling every gradient by a device scalar on the fly (gradient clipping's factor)
without writing the gradients back.

    opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    opt.step(grad_scale=(max_norm / (norm + 1e-6)).clamp(max=1.0))   # = clip_grads_with_norm_ + step

Takes the Triton path for plain dense CUDA parameters (any, under the Triton interpreter) whose gradient and
moments are contiguous, in fp32 / bf16 / fp16, with amsgrad, maximize, capturable and differentiable off and
a float learning rate; anything else (sparse or complex gradients, DTensors, those options) steps through
torch's AdamW, the grad_scale applied there with one ``_foreach_mul_``. The step count stays on the host (a
CPU tensor, as torch's for-loop AdamW keeps it), so no step reads anything back from the GPU.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from primus_turbo.pytorch.core.utils import triton_can_run_on

__all__ = ["AdamW"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fast(p: torch.Tensor, group: dict) -> bool:
    g = p.grad
    return (
        not isinstance(p, DTensor) and not g.is_sparse and p.dtype in _DTYPES and g.dtype in _DTYPES
        and p.is_contiguous() and g.is_contiguous() and triton_can_run_on(p, g)
        and not (group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"])
        and not isinstance(group["lr"], torch.Tensor)
    )  # fmt: skip


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with a one-pass Triton step and an optional ``grad_scale`` (see the module doc).
    ``fused`` / ``foreach`` are accepted for drop-in use and only steer the fallback path."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.turbo_steps = 0  # parameters updated by the Triton kernel (introspection / tests)
        self._next_grad_scale: torch.Tensor | None = None

    def set_next_grad_scale(self, grad_scale: torch.Tensor | None) -> None:
        """``grad_scale`` for the next ``step()`` called without one (for callers that step through a
        container, e.g. TorchTitan's OptimizersContainer, which passes no arguments)."""
        self._next_grad_scale = grad_scale

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        """One AdamW update; ``grad_scale``: a one-element tensor every gradient is multiplied by first."""
        from primus_turbo.triton.optim.adamw_kernel import launch_adamw

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale, self._next_grad_scale = self._next_grad_scale, None
        if grad_scale is not None:
            if not isinstance(grad_scale, torch.Tensor) or grad_scale.numel() != 1:
                raise ValueError(f"AdamW.step: grad_scale must be a one-element tensor, got {grad_scale!r}")
            grad_scale = grad_scale.detach().reshape(1).to(torch.float32)
        fallback = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            slow = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not _fast(p, group):
                    slow.append(p)
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                elif state["step"].device.type != "cpu":  # e.g. loaded from torch's fused AdamW: once
                    state["step"] = state["step"].detach().cpu()
                state["step"] += 1
                scale = grad_scale.to(p.device, non_blocking=True) if grad_scale is not None else None
                launch_adamw(
                    p, p.grad, state["exp_avg"], state["exp_avg_sq"], scale, lr=float(group["lr"]),
                    beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                    weight_decay=float(group["weight_decay"]), step=int(state["step"].item()),
                )  # fmt: skip
                self.turbo_steps += 1
            fallback.append(slow)
        if any(fallback):
            self._torch_step(fallback, grad_scale)
        return loss

    def _torch_step(self, fallback: list[list[torch.Tensor]], grad_scale) -> None:
        """torch's AdamW on the parameters the kernel does not take: a torch AdamW over them with their
        groups' options, sharing this optimizer's state (so state_dict holds every parameter's moments)."""
        if grad_scale is not None:
            for device_grads in _by_device([p.grad for params in fallback for p in params]).values():
                torch._foreach_mul_(device_grads, grad_scale.reshape(()).to(device_grads[0].device))
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                  for group, params in zip(self.param_groups, fallback) if params]  # fmt: skip
        inner = torch.optim.AdamW(groups)
        inner.state = self.state
        inner.step()


def _by_device(tensors):
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
