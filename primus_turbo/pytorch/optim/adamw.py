"""``turbo.optim.AdamW``: torch's AdamW (same arguments, state and state_dict) whose step is one Triton pass
over the parameters (one launch per parameter group and dtype combination, as torch's multi-tensor apply),
optionally scaling every gradient by a device scalar on the fly (gradient clipping's factor) without writing
the gradients back.

    opt = AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    opt.step(grad_scale=(max_norm / (norm + 1e-6)).clamp(max=1.0))   # = clip_grads_with_norm_ + step

Takes the Triton path for plain dense CUDA parameters (any, under the Triton interpreter) whose gradient and
moments are contiguous (the moments of one dtype), in fp32 / bf16 / fp16, with amsgrad, maximize, capturable
and differentiable off and a float learning rate; anything else (sparse or complex gradients, DTensors, those
options) steps through torch's AdamW, the grad_scale applied there with one ``_foreach_mul_``. The step count
stays on the host (a CPU tensor, as torch's for-loop AdamW keeps it), so no step reads anything back from the
GPU.

Mixed-precision training keeps fp32 master weights and casts them into the model's bf16 weights after each
step. ``set_param_copies([(master, model_weight), ...])`` has the step write that cast in the same pass (the
Triton path stores the updated value twice; the torch path copies after its step):

    opt.set_param_copies(zip(fp32_masters, bf16_weights))
    opt.step()      # every bf16 weight now holds its master's updated value, cast

``AdamW.adopt(opt)`` turns an existing ``torch.optim.AdamW`` (state included) into this class in place, for
frameworks that build their own optimizer.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from primus_turbo.pytorch.core.utils import triton_can_run_on, triton_interpret_enabled

__all__ = ["AdamW"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _group_fast(group: dict) -> bool:
    return not (
        group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]
        or isinstance(group["lr"], torch.Tensor)
    )  # fmt: skip


def _fast(p: torch.Tensor, interpret: bool) -> bool:
    """Called per parameter and step (hundreds per step): the cheapest tests first."""
    g = p.grad
    return (
        (p.is_cuda and g.is_cuda or interpret and triton_can_run_on(p, g))
        and p.dtype in _DTYPES and g.dtype in _DTYPES and not g.is_sparse and not isinstance(p, DTensor)
        and p.is_contiguous() and g.is_contiguous()
    )  # fmt: skip


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW with a one-pass Triton step and an optional ``grad_scale`` (see the module doc).
    ``fused`` / ``foreach`` are accepted for drop-in use and only steer the fallback path."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._init_turbo_fields()

    def _init_turbo_fields(self) -> None:
        self.turbo_steps = 0  # parameters updated by the Triton kernel (introspection / tests)
        self._next_grad_scale: torch.Tensor | None = None
        self._copies: dict[torch.Tensor, torch.Tensor] = {}
        self._copies_fresh = False
        self._tables: dict[tuple, tuple[list[int], torch.Tensor]] = {}  # launch tables by group and bucket

    @classmethod
    def adopt(cls, optimizer: torch.optim.AdamW) -> AdamW:
        """Make ``optimizer`` (exactly a ``torch.optim.AdamW``) an instance of this class in place: the same
        parameter groups, options and state, its steps from now on the one-pass kernel. Returns it."""
        if type(optimizer) is not torch.optim.AdamW:
            got = type(optimizer).__name__
            raise TypeError(f"AdamW.adopt: optimizer must be a torch.optim.AdamW, got {got}")
        optimizer.__class__ = cls
        optimizer._init_turbo_fields()
        optimizer._patch_step_function()  # torch's step hooks / profiler range around the new step
        return optimizer

    def set_param_copies(self, pairs) -> int:
        """Register (param, copy) pairs: after each step that updates ``param``, ``copy`` holds it cast to the
        copy's dtype (as ``copy.copy_(param)``). ``param`` must be one of this optimizer's parameters and
        ``copy`` a contiguous floating tensor of the same number of elements on its device; a pair whose copy
        is the parameter's own memory in its dtype is skipped. Replaces earlier pairs; returns how many are
        kept."""
        owned = {p for group in self.param_groups for p in group["params"]}
        copies: dict[torch.Tensor, torch.Tensor] = {}
        for param, copy in pairs:
            if param not in owned:
                raise ValueError("AdamW.set_param_copies: a param is not one of this optimizer's parameters")
            if not isinstance(copy, torch.Tensor) or not copy.is_floating_point() or not copy.is_contiguous():
                raise ValueError(
                    "AdamW.set_param_copies: copy must be a contiguous floating-point tensor, got "
                    + (f"{copy.dtype} {tuple(copy.shape)}" if isinstance(copy, torch.Tensor) else repr(copy))
                )
            if copy.numel() != param.numel() or copy.device != param.device:
                raise ValueError(
                    f"AdamW.set_param_copies: copy has {copy.numel()} elements on {copy.device}, its param "
                    f"{param.numel()} on {param.device}: they must match"
                )
            if copy.dtype == param.dtype and copy.data_ptr() == param.data_ptr():
                continue
            copies[param] = copy.view(param.shape)
        self._copies = copies
        return len(copies)

    def copies_fresh(self) -> bool:
        """True once after a ``step()`` that wrote the registered copies (then False until the next step):
        the caller's own master-to-model cast of that step can be skipped."""
        fresh, self._copies_fresh = self._copies_fresh, False
        return fresh

    def set_next_grad_scale(self, grad_scale: torch.Tensor | None) -> None:
        """``grad_scale`` for the next ``step()`` called without one (for callers that step through a
        container, e.g. TorchTitan's OptimizersContainer, which passes no arguments)."""
        self._next_grad_scale = grad_scale

    @torch.no_grad()
    def step(self, closure=None, grad_scale: torch.Tensor | None = None):
        """One AdamW update; ``grad_scale``: a one-element tensor every gradient is multiplied by first."""
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
        interpret = triton_interpret_enabled()
        for index, group in enumerate(self.param_groups):
            fast, slow = [], []
            group_fast = _group_fast(group)
            for p in group["params"]:
                if p.grad is not None:
                    (fast if group_fast and _fast(p, interpret) else slow).append(p)
            fallback.append(slow)
            if fast:
                self._kernel_step(index, group, fast, slow, grad_scale)
        if any(fallback):
            self._torch_step(fallback, grad_scale)
            for params in fallback:
                for p in params:
                    if p in self._copies:
                        self._copies[p].copy_(p)
        self._copies_fresh = bool(self._copies)
        return loss

    def _kernel_step(self, index: int, group: dict, params: list, slow: list, grad_scale) -> None:
        """The group's kernel parameters in one launch per (device, dtypes, step count); parameters whose two
        moments differ in dtype or are not contiguous (e.g. loaded so) join ``slow``."""
        from primus_turbo.triton.optim.adamw_kernel import adamw_table, launch_adamw

        kept, states = [], []
        for p in params:
            state = self.state[p]
            if "step" not in state:  # new, or moments made by a framework's state initializer
                state["step"] = torch.tensor(0.0)
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif state["step"].device.type != "cpu":  # e.g. loaded from torch's fused AdamW: once
                state["step"] = state["step"].detach().cpu()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            if m.dtype != v.dtype or not (m.is_contiguous() and v.is_contiguous()):
                slow.append(p)
                continue
            kept.append(p)
            states.append(state)
        if not kept:
            return
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1.0)
        buckets: dict[tuple, list] = {}
        for p, state, count in zip(kept, states, torch.stack(steps).tolist(), strict=True):
            copy = self._copies.get(p)
            copy_dtype = None if copy is None else copy.dtype
            key = (p.get_device(), p.dtype, p.grad.dtype, state["exp_avg"].dtype, copy_dtype, int(count))
            buckets.setdefault(key, []).append((p, state, copy))
        beta1, beta2 = group["betas"]
        ranks: dict[tuple, int] = {}  # a table's cache key: the bucket without its step count (which moves)
        for key, items in buckets.items():
            _, *dtypes, count = key
            rank = ranks[key[:-1]] = ranks.get(key[:-1], -1) + 1
            params, states_, copies = zip(*items, strict=True)
            device = params[0].device
            rows, blocks, aligned = adamw_table(
                params, [p.grad for p in params], [s["exp_avg"] for s in states_],
                [s["exp_avg_sq"] for s in states_], None if dtypes[3] is None else copies,
            )  # fmt: skip
            scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
            launch_adamw(
                self._device_table((index, *key[:-1], rank), rows, device), len(items), blocks, dtypes, scale,
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), step=count, aligned=aligned,
            )  # fmt: skip
            self.turbo_steps += len(items)

    def _device_table(self, key, rows: list[int], device: torch.device) -> torch.Tensor:
        """The launch table on ``device``, copied there only when its addresses change (steady state: never;
        the host list is compared, the device copy kept)."""
        cached = self._tables.get(key)
        if cached is not None and cached[0] == rows:
            return cached[1]
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        self._tables[key] = (rows, table)
        return table

    def _torch_step(self, fallback: list[list[torch.Tensor]], grad_scale) -> None:
        """torch's AdamW on the parameters the kernel does not take: a torch AdamW over them with their
        groups' options, sharing this optimizer's state (so state_dict holds every parameter's moments)."""
        if grad_scale is not None:
            for device_grads in _by_device([p.grad for params in fallback for p in params]).values():
                torch._foreach_mul_(device_grads, grad_scale.reshape(()).to(device_grads[0].device))
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                  for group, params in zip(self.param_groups, fallback) if params]  # fmt: skip
        # built on a placeholder, then given the groups: torch's constructor refuses non-leaf parameters,
        # which frameworks step legitimately (Megatron's DistributedOptimizer: views of its fp32 buffer)
        inner = torch.optim.AdamW([torch.zeros(())])
        inner.param_groups = groups
        inner.state = self.state
        inner.step()


def _by_device(tensors):
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
