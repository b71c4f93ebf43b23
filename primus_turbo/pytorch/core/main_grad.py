"""Megatron ``gradient_accumulation_fusion`` helpers: weight gradients added straight into ``main_grad``.

Megatron's DDP gives every parameter an fp32 ``main_grad`` (a view into its gradient buffer) and, after
each backward, adds ``param.grad`` into it unless ``param.grad_added_to_main_grad`` says the op already
did. Ops that accumulate themselves (``ops.gemm(accumulate_into_main_grad=True)``, the Megatron turbo
experts with :func:`accumulate_into_main_grads_`) check the buffer with :func:`check_main_grad` and
return :func:`wgrad_placeholder` as the weight's gradient.
"""

from __future__ import annotations

import weakref

import torch

from primus_turbo.pytorch.core.utils import triton_can_run_on

__all__ = [
    "check_main_grad", "wgrad_placeholder", "wgrad_placeholders", "accumulate_into_main_grads_", "add_into_",
    "add_into_grads", "split_for_autograd", "main_grad_block",
]  # fmt: skip


def check_main_grad(weight: torch.Tensor, op: str = "gemm", name: str = "b") -> None:
    """Raise ValueError unless ``weight.main_grad`` is a tensor of weight's shape on its device, TypeError
    unless it is floating-point."""
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(
            f"{op}: accumulate_into_main_grad=True needs {name}.main_grad (a tensor of {name}'s shape, "
            f"usually fp32) allocated by the caller (e.g. Megatron DDP); {name} has none"
        )
    if main_grad.shape != weight.shape or main_grad.device != weight.device:
        raise ValueError(
            f"{op}: {name}.main_grad must match {name}: got {tuple(main_grad.shape)} on {main_grad.device}, "
            f"{name} is {tuple(weight.shape)} on {weight.device}"
        )
    if not main_grad.is_floating_point():  # else the backward fails naming no argument, or truncates
        raise TypeError(f"{op}: {name}.main_grad must be floating-point, got {main_grad.dtype}")


def wgrad_placeholder(weight: torch.Tensor) -> torch.Tensor | None:
    """What Megatron's gradient_accumulation_fusion returns for the weight after accumulating.

    None when the weight has no ``grad_added_to_main_grad`` attribute (no Megatron DDP); otherwise
    an uninitialised tensor (zeros when ``weight.zero_out_wgrad``), with ``grad_added_to_main_grad``
    set so DDP's hook skips it: the gradient must still reach the parameter for that hook to fire.
    """
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def wgrad_placeholders(weights) -> list[torch.Tensor | None]:
    """:func:`wgrad_placeholder` for each of G same-shape weights, as slices of one allocation when
    every weight gets an uninitialised one (64 ``empty_like`` calls cost ~0.2 ms of host time)."""
    if not weights:
        return []
    if not all(
        hasattr(w, "grad_added_to_main_grad") and not getattr(w, "zero_out_wgrad", False) for w in weights
    ):
        return [wgrad_placeholder(w) for w in weights]
    for w in weights:
        w.grad_added_to_main_grad = True
    first = weights[0]
    return list(torch.empty((len(weights), *first.shape), dtype=first.dtype, device=first.device).unbind(0))


def accumulate_into_main_grads_(weights, grad: torch.Tensor) -> None:
    """``weights[g].main_grad += grad[g]`` for the G slices of a [G, *weight.shape] gradient.

    Megatron's DDP lays consecutive parameters' main_grads out back to back (in reverse order), so the
    G experts' buffers are one block with a constant, negative, expert stride: one vectorized Triton
    launch adds the whole gradient (fp32 += bf16 read as 10 bytes per element). A layout that breaks
    the spacing (a DDP bucket boundary among the experts) costs one launch per equally spaced run.
    Where Triton cannot run (CPU without the interpreter): ``torch._foreach_add_``, the per-expert
    adds of DDP's hook.
    Measured alternatives (H200, G=64, 2816 x 2048, bf16 gradient into fp32, per call): per-expert
    ``add_`` (DDP's hook) 64 launches 1.57 ms; ``_foreach_add_`` with mixed dtypes falls back to the
    same; casting to fp32 first + ``_foreach_add_`` 19 launches 2.19 ms; one mixed-dtype ``add_`` over
    the block (needs ascending order) 1.30 ms; this kernel 1 launch 0.87 ms.
    Raises ValueError unless there are G weights and each main_grad has grad[g]'s shape (the kernel adds
    main_grad's element count from each row of grad: a mismatch would read past grad or skip elements).
    """
    main_grads = [w.main_grad for w in weights]
    _check_main_grads(main_grads, grad)
    if not main_grads:
        return
    grad = grad.contiguous()
    runs = _layout(main_grads) if triton_can_run_on(grad, *main_grads) else None
    if runs is None:
        torch._foreach_add_(main_grads, list(grad.unbind(0)))
        return
    from primus_turbo.triton.main_grad.accumulate_kernel import launch_accumulate_grouped

    for start, stop, stride in runs:
        launch_accumulate_grouped(main_grads[start], grad[start:stop], stride)


def _check_main_grads(main_grads: list, grad: torch.Tensor) -> None:
    if len(main_grads) != grad.shape[0]:
        raise ValueError(
            f"accumulate_into_main_grads_: {len(main_grads)} weights, grad has G={grad.shape[0]} (dim 0)"
        )
    shape = grad.shape[1:]
    if all(isinstance(m, torch.Tensor) and m.shape == shape for m in main_grads):
        return
    for g, m in enumerate(main_grads):
        if not isinstance(m, torch.Tensor) or m.shape != shape:
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(
                f"accumulate_into_main_grads_: weights[{g}].main_grad is {got}, grad[{g}] {tuple(shape)}"
            )


def main_grad_block(weights) -> tuple[torch.Tensor, bool] | None:
    """The G same-shape weights' ``main_grad`` buffers as one [G, *shape] strided view, or None when they
    do not sit equally spaced in one buffer (a DDP bucket boundary among them, a non-contiguous buffer,
    separate allocations that the CUDA caching allocator happened to space equally).

    Returns (view, reversed): Megatron's DDP lays the experts out in reverse order (a negative spacing), which
    no torch view can express; the view then starts at the last weight's buffer and view[G-1-g] is
    weights[g].main_grad (``reversed`` True). Raises ValueError when a main_grad's shape differs from the
    first's (the view would reach past it)."""
    main_grads = [w.main_grad for w in weights]
    first = main_grads[0]
    for g, m in enumerate(main_grads):
        if m.shape != first.shape:
            shapes = f"weights[{g}].main_grad is {tuple(m.shape)}, weights[0]'s {tuple(first.shape)}"
            raise ValueError(f"main_grad_block: {shapes}")
    runs = _layout(main_grads)
    if runs is None or len(runs) != 1:
        return None
    if first.untyped_storage().data_ptr() != main_grads[-1].untyped_storage().data_ptr():
        return None  # separate allocations that sit equally spaced by chance: a view would leave the storage
    stride = runs[0][2]
    base = main_grads[-1] if stride < 0 else first
    view = base.as_strided((len(main_grads), *first.shape), (abs(stride) or first.numel(), *first.stride()))
    return view, stride < 0


def add_into_(dst: torch.Tensor, src: torch.Tensor, reverse_groups: bool = False) -> None:
    """``dst += src`` for a contiguous ``dst`` (e.g. an fp32 gradient) and a same-shape ``src`` of any float
    dtype (e.g. a bf16 weight gradient): one vectorized launch reading src once (10 bytes per element for
    fp32 += bf16), where torch's mixed-dtype ``add_`` runs an unvectorized dynamic-cast kernel. ``src``
    may be strided along its first dim (one half of a [G, 2F, K] gradient) without a copy; so may ``dst``
    when each dst[g] is contiguous (a :func:`main_grad_block` view). ``reverse_groups``: dst[G-1-g] +=
    src[g]. The sum is taken in fp32 and rounded to dst's dtype, as ``add_`` does. Elsewhere (CPU without
    the interpreter, other layouts): ``dst.add_(src)``."""
    if dst.shape != src.shape:
        raise ValueError(f"add_into_: dst is {tuple(dst.shape)}, src {tuple(src.shape)}")
    if src.numel() == 0:
        return
    # G contiguous, non-overlapping blocks at a stride (overlapping ones, e.g. an expanded dst: add_'s error)
    blocks = dst.dim() >= 2 and dst[0].is_contiguous() and abs(dst.stride(0)) >= dst[0].numel()
    if not ((dst.is_contiguous() or blocks) and triton_can_run_on(dst, src)):
        dst.add_(src.flip(0) if reverse_groups else src)
        return
    from primus_turbo.triton.main_grad.accumulate_kernel import launch_accumulate_grouped

    if reverse_groups or not dst.is_contiguous():
        g = dst.shape[0]
        first, step = (dst[g - 1], -dst.stride(0)) if reverse_groups else (dst[0], dst.stride(0))
        rows = src.reshape(g, -1) if src[0].is_contiguous() else src.contiguous().reshape(g, -1)
        launch_accumulate_grouped(first, rows, step)
    elif src.is_contiguous() or src.dim() < 2:
        launch_accumulate_grouped(dst, src.contiguous().reshape(1, -1), 0)
    elif src[0].is_contiguous():  # G contiguous rows at a stride
        launch_accumulate_grouped(dst[0], src.reshape(src.shape[0], -1), dst[0].numel())
    else:
        launch_accumulate_grouped(dst, src.contiguous().reshape(1, -1), 0)


def add_into_grads(weights, grad: torch.Tensor) -> None:
    """A gradient of weights stacked along dim -2 (e.g. [w1; w3]) into each weight's ``.grad``: stored in the
    weight's dtype where ``.grad`` is None, else added with :func:`add_into_` (one pass each)."""
    parts = grad.split([w.shape[-2] for w in weights], dim=-2) if len(weights) > 1 else (grad,)
    for part, w in zip(parts, weights):
        if w.grad is None:
            w.grad = part.to(w.dtype, memory_format=torch.contiguous_format)
        else:
            add_into_(w.grad, part)


def split_for_autograd(grad: torch.Tensor, weights) -> tuple:
    """create_graph: the stacked gradient split along dim -2, each part in its weight's dtype."""
    parts = grad.split([w.shape[-2] for w in weights], dim=-2) if len(weights) > 1 else (grad,)
    return tuple(part.to(w.dtype) for part, w in zip(parts, weights))


# id(first main_grad) -> (weak references to the main_grad tensors, their addresses, their runs or None):
# DDP's buffers live for the whole run, so the layout is computed once per grouped linear, not on every
# backward (64 experts: ~30 us of host to compute, ~8 us to check). Weak references: the cache must not keep
# a deleted model's buffers alive (strong ones did: a whole gradient buffer per grouped linear). Addresses:
# a main_grad given new storage in place (``.data = ...``) keeps its identity, and a stale stride would
# write its gradient into the old memory.
_LAYOUTS: dict[int, tuple[list[weakref.ref], list[int], list[tuple[int, int, int]] | None]] = {}


def _layout(main_grads: list[torch.Tensor]) -> list[tuple[int, int, int]] | None:
    """The equally spaced runs of ``main_grads``, or None when one is not contiguous (cached: valid while
    the same tensors, none freed, sit at the same addresses)."""
    hit = _LAYOUTS.get(id(main_grads[0]))
    if hit is not None and len(hit[0]) == len(main_grads):
        refs, addresses, runs = hit
        if all(r() is m and m.data_ptr() == a for r, m, a in zip(refs, main_grads, addresses)):
            return runs
    runs = list(_equally_spaced_runs(main_grads)) if all(m.is_contiguous() for m in main_grads) else None
    if len(_LAYOUTS) >= 4096:
        _LAYOUTS.clear()
    refs = [weakref.ref(m) for m in main_grads]
    _LAYOUTS[id(main_grads[0])] = (refs, [m.data_ptr() for m in main_grads], runs)
    return runs


def _equally_spaced_runs(buffers: list[torch.Tensor]):
    """(start, stop, element stride) of maximal runs of same-dtype, non-overlapping contiguous buffers
    that sit a constant distance apart, so each run is one strided block."""
    start, stride = 0, 0
    for g in range(1, len(buffers) + 1):
        if g < len(buffers):
            first, prev, cur = buffers[start], buffers[g - 1], buffers[g]
            step, rem = divmod(cur.data_ptr() - prev.data_ptr(), cur.element_size())
            spaced = rem == 0 and abs(step) >= cur.numel() and (g - 1 == start or step == stride)
            fits = spaced and cur.dtype == first.dtype
            if fits:
                stride = step
                continue
        yield start, g, stride
        start, stride = g, 0
