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
options) steps through torch's AdamW, the grad_scale applied there to copies of their gradients (one
``_foreach_mul`` per device; the gradients are left as they were, as on the Triton path). The step count
stays on the host (a CPU tensor, as torch's for-loop AdamW keeps it), so no step reads anything back from the
GPU.

Mixed-precision training keeps fp32 master weights and casts them into the model's bf16 weights after each
step. ``set_param_copies([(master, model_weight), ...])`` has the step write that cast in the same pass (the
Triton path stores the updated value twice; the torch path copies after its step):

    opt.set_param_copies(zip(fp32_masters, bf16_weights))
    opt.step()      # every bf16 weight now holds its master's updated value, cast

``AdamW.adopt(opt)`` turns an existing ``torch.optim.AdamW`` (state included) into this class in place, for
frameworks that build their own optimizer.

Host cost: the first step of a group sets up its state, buckets and device tables; once the whole group has
stepped through the kernel, later steps reuse that plan after a few attribute reads per parameter (the same
parameters, gradients at the same addresses in the same dtype and layout, the same state entries and copies,
step counters unchanged by anyone else), else rebuild it. The step counters of a plan are views of one CPU
tensor per launch (``state_dict`` hands out copies). ``launches()`` lists what the kept plans launch.
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
    ``fused`` / ``foreach`` are accepted for drop-in use and only steer the fallback path (with ``fused=True``
    too, torch's GradScaler unscales the gradients and skips inf steps before calling this step)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        self._init_turbo_fields()

    def _init_turbo_fields(self) -> None:
        # torch's AdamW(fused=True) tells GradScaler it unscales and skips inf steps itself (GradScaler then
        # only sets ``grad_scale`` / ``found_inf`` attributes); this step reads neither, so GradScaler must
        # unscale the gradients and skip inf steps as for any optimizer (it stepped on scaled, inf gradients)
        self._step_supports_amp_scaling = False
        self.turbo_steps = 0  # parameters updated by the Triton kernel (introspection / tests)
        self._next_grad_scale: torch.Tensor | None = None
        self._copies: dict[torch.Tensor, torch.Tensor] = {}
        self._copies_fresh = False
        self._tables: dict[tuple, tuple[list[int], torch.Tensor]] = {}  # launch tables by group and bucket
        self._plans: dict[int, _Plan] = {}  # per group index: its launches, reused while they hold

    def __setstate__(self, state: dict) -> None:
        """Unpickling and ``copy.deepcopy`` restore torch's fields only (``__getstate__``): start this class's
        afresh (plans and tables hold addresses of the original's tensors; copies must be registered again).
        ``load_state_dict`` calls it too, on an optimizer that has them: kept."""
        super().__setstate__(state)
        if not hasattr(self, "_plans"):
            self._init_turbo_fields()

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

    def state_dict(self):
        """torch's, with each step counter its own tensor (the step keeps them as views of one tensor per
        launch: saved as views they would each carry that whole tensor)."""
        state_dict = super().state_dict()
        state_dict["state"] = {
            k: {**s, "step": s["step"].clone()} if isinstance(s.get("step"), torch.Tensor) and s["step"]._base
            is not None else s for k, s in state_dict["state"].items()
        }  # fmt: skip
        return state_dict

    def launches(self) -> list[dict]:
        """What the kept plans launch per step, one dict per kernel launch (diagnostics): the group index,
        tensors, elements, blocks, (param, grad, moments, copy) dtypes and whether every address is 16-byte
        aligned."""
        return [
            {"group": index, "tensors": launch.num_tensors, "elements": launch.elements,
             "blocks": launch.blocks,
             "dtypes": tuple(str(d).replace("torch.", "") if d else None for d in launch.dtypes),
             "aligned": launch.aligned}
            for index, plan in sorted(self._plans.items()) for launch in plan.launches
        ]  # fmt: skip

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
            group_fast = _group_fast(group)
            plan = self._plans.get(index)
            if group_fast and plan is not None and plan.holds(group["params"], self.state, self._copies):
                self._run(plan, group, grad_scale)  # steady state: no per-parameter set-up
                fallback.append([])
                continue
            self._plans.pop(index, None)
            fast, slow = [], []
            for p in group["params"]:
                if p.grad is not None:
                    (fast if group_fast and _fast(p, interpret) else slow).append(p)
            fallback.append(slow)
            if fast:
                plan = self._kernel_step(index, group, fast, slow, grad_scale)
                if not slow and len(fast) == len(group["params"]):  # the whole group: kept for next steps
                    self._plans[index] = plan
        if any(fallback):
            self._torch_step(fallback, grad_scale)
            for params in fallback:
                for p in params:
                    if p in self._copies:
                        self._copies[p].copy_(p)
        self._copies_fresh = bool(self._copies)
        return loss

    def _kernel_step(self, index: int, group: dict, params: list, slow: list, grad_scale) -> _Plan | None:
        """The group's kernel parameters in one launch per (device, dtypes, step count); parameters whose two
        moments differ in dtype or are not contiguous (e.g. loaded so) join ``slow``. Returns the plan run."""
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
            _check_moments(p, m, v)
            if m.dtype != v.dtype or not (m.is_contiguous() and v.is_contiguous()):
                slow.append(p)
                continue
            kept.append(p)
            states.append(state)
        if not kept:
            return None
        plan = self._plan(index, kept, states)
        self._run(plan, group, grad_scale)
        return plan

    def _plan(self, index: int, params: list, states: list) -> _Plan:
        """Group ``params`` by (device, dtypes, step count); each bucket's step counters become views of one
        CPU tensor (one add steps them all) and its addresses one device table."""
        from primus_turbo.triton.optim.adamw_kernel import adamw_table

        counts = torch.stack([state["step"].reshape(()).float() for state in states]).tolist()
        buckets: dict[tuple, list] = {}
        for p, state, count in zip(params, states, counts, strict=True):
            copy = self._copies.get(p)
            copy_dtype = None if copy is None else copy.dtype
            key = (p.get_device(), p.dtype, p.grad.dtype, state["exp_avg"].dtype, copy_dtype, count)
            buckets.setdefault(key, []).append((p, state, copy))
        launches = []
        ranks: dict[tuple, int] = {}  # a table's cache key: the bucket without its step count (which moves)
        for key, items in buckets.items():
            _, *dtypes, count = key
            rank = ranks[key[:-1]] = ranks.get(key[:-1], -1) + 1
            bucket_params, bucket_states, copies = zip(*items, strict=True)
            steps = torch.full((len(items),), count, dtype=torch.float32)
            for i, state in enumerate(bucket_states):
                state["step"] = steps[i]
            rows, blocks, aligned = adamw_table(
                bucket_params, [p.grad for p in bucket_params], [s["exp_avg"] for s in bucket_states],
                [s["exp_avg_sq"] for s in bucket_states], None if dtypes[3] is None else copies,
            )  # fmt: skip
            device = bucket_params[0].device
            table = self._device_table((index, *key[:-1], rank), rows, device)
            elements = sum(p.numel() for p in bucket_params)
            launches.append(_Launch(len(items), blocks, tuple(dtypes), device, aligned, table, steps,
                                    int(count), elements))  # fmt: skip
        return _Plan(self.state, self._copies, params, states, launches)

    def _run(self, plan: _Plan, group: dict, grad_scale) -> None:
        from primus_turbo.triton.optim.adamw_kernel import launch_adamw

        beta1, beta2 = group["betas"]
        for launch in plan.launches:
            launch.steps.add_(1.0)
            launch.count += 1
            scale = grad_scale.to(launch.device, non_blocking=True) if grad_scale is not None else None
            launch_adamw(
                launch.table, launch.num_tensors, launch.blocks, launch.dtypes, scale,
                lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), step=launch.count, aligned=launch.aligned,
            )  # fmt: skip
            self.turbo_steps += launch.num_tensors
        torch.autograd.graph.increment_version(plan.written)

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
        swapped = {}  # param -> its gradient: the step reads copies (scaled / laid out), the gradients stay
        if grad_scale is not None:
            with_grad = [p for params in fallback for p in params if p.grad is not None]
            for device_params in _by_device(with_grad).values():
                grads = [p.grad for p in device_params]
                scaled = torch._foreach_mul(grads, grad_scale.reshape(()).to(grads[0].device))
                for param, grad, copy in zip(device_params, grads, scaled):
                    swapped[param] = grad
                    param.grad = copy
        groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": params}
                  for group, params in zip(self.param_groups, fallback) if params]  # fmt: skip
        for group in groups:  # torch's fused / capturable step reads the counters on the parameters' device
            if group.get("fused") or group.get("capturable"):
                for p in group["params"]:
                    state = self.state.get(p)
                    if state and "step" in state and state["step"].device != p.device:
                        state["step"] = state["step"].to(p.device)  # a kernel step left it on the CPU
                    grad = p.grad
                    if group.get("fused") and grad is not None and grad.layout == torch.strided \
                            and grad.stride() != p.stride():
                        # torch's fused kernel wants the gradient laid out as the parameter (and its moments)
                        swapped.setdefault(p, grad)
                        p.grad = torch.empty_like(p, dtype=grad.dtype).copy_(grad)
        # built on a placeholder, then given the groups: torch's constructor refuses non-leaf parameters,
        # which frameworks step legitimately (Megatron's DistributedOptimizer: views of its fp32 buffer)
        inner = torch.optim.AdamW([torch.zeros(())])
        inner.defaults = self.defaults  # differentiable: torch's step enables autograd from its defaults
        inner.param_groups = groups
        inner.state = self.state
        try:
            inner.step()
        finally:
            for param, grad in swapped.items():
                param.grad = grad


class _Launch:
    """One launch of a plan: ``num_tensors`` tensors of one (device, dtypes, step count) in ``table``; their
    step counters are the elements of ``steps`` (CPU), all equal to ``count``."""

    __slots__ = ("num_tensors", "blocks", "dtypes", "device", "aligned", "table", "steps", "count",
                 "elements")  # fmt: skip

    def __init__(self, num_tensors, blocks, dtypes, device, aligned, table, steps, count, elements):
        self.num_tensors, self.blocks, self.dtypes, self.device = num_tensors, blocks, dtypes, device
        self.aligned, self.table, self.steps, self.count = aligned, table, steps, count
        self.elements = elements


class _Plan:
    """A whole group's launches, kept across steps while everything they were built from holds: the same
    parameters (objects and memory) with gradients of the same dtype at the same contiguous memory, the same
    state entries and moment memory, the same copies, and step counters nobody else moved. Checking that is a
    few attribute reads per parameter, where building it is the state set-up, the bucketing and the tables."""

    __slots__ = ("state", "copies", "checks", "launches", "written")

    def __init__(self, state, copies, params, states, launches):
        self.state, self.copies, self.launches = state, copies, launches
        # what the kernels write: their version counters move as an in-place torch step's would, so caches
        # keyed on ``_version`` (Float8Linear's FP8 weight, autograd's saved-tensor check) see the update
        self.written = tuple(params) + tuple(copies[p] for p in params if p in copies)
        self.checks = []
        for p, st in zip(params, states, strict=True):
            m, v, g = st["exp_avg"], st["exp_avg_sq"], p.grad
            self.checks.append((p, g.dtype, st, st["step"], m, v, p.data_ptr(), g.data_ptr(), m.data_ptr(),
                                v.data_ptr()))  # fmt: skip

    def holds(self, params: list, state, copies) -> bool:
        if state is not self.state or copies is not self.copies or len(params) != len(self.checks):
            return False
        for p, (q, g_dtype, st, step, m, v, p_ptr, g_ptr, m_ptr, v_ptr) in zip(params, self.checks):
            g = p.grad
            if (
                p is not q or g is None or g.dtype is not g_dtype or g.is_sparse or not g.is_contiguous()
                or g.data_ptr() != g_ptr or p.data_ptr() != p_ptr or not p.is_contiguous()
                or state.get(p) is not st or st.get("step") is not step or st.get("exp_avg") is not m
                or st.get("exp_avg_sq") is not v or m.data_ptr() != m_ptr or v.data_ptr() != v_ptr
            ):  # fmt: skip
                return False
        for launch in self.launches:  # e.g. a checkpoint load writing the counters in place
            low, high = torch.aminmax(launch.steps)
            if low.item() != launch.count or high.item() != launch.count:
                return False
        return True


def _check_moments(p: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
    """The kernel walks a parameter's elements in its moments: moments of another shape or device (a
    checkpoint of a resized model) would be read and written out of bounds, where torch's step raises."""
    for name, moment in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if moment.shape != p.shape or moment.device != p.device:
            raise ValueError(
                f"AdamW.step: state['{name}'] of a parameter of shape {tuple(p.shape)} on {p.device} is "
                f"{tuple(moment.shape)} on {moment.device}: it must match the parameter (optimizer state "
                "loaded from a model with other parameter shapes?)"
            )


def _by_device(tensors):
    out: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out
