"""Weights of single-device TorchTitan AMP runs: cast once per optimizer step, gradients added into ``.grad``.

Without FSDP (one GPU), TorchTitan keeps fp32 parameters and runs the forward under ``torch.autocast``
(bf16). Per micro-batch, every weight is then cast to bf16 again (6 bytes per element), and the backward
turns each bf16 weight gradient into a new fp32 tensor (6 bytes per element) that AccumulateGrad adds
into ``.grad`` (12 more). H200 profile of ``deepseek_moe_fp8`` (2.2B parameters, 4 micro-batches per step):
~77 ms of a 323 ms step in those casts and adds.

Here the turbo linears and experts, when their weight is such an fp32 parameter and the input is half
precision:

- read the weight cast to bf16 (or quantized to FP8) once per optimizer step: the copy is cached on the
  module (for a gate/up pair, w1 and w3 concatenated into the weight of one GEMM), keyed by the step
  (``new_step``, called by the converter's post-optimizer hook), the weights' storage and their version
  counters, so an in-place write between micro-batches also rebuilds it;
- add the half-precision weight gradient into the fp32 ``.grad`` in the backward, in one vectorized pass
  (``core.main_grad.add_into_``; the first micro-batch of a step stores it as ``.grad``; a gate/up
  gradient is split in place) and give autograd no gradient for the weight: no fp32 temporary, no
  AccumulateGrad. The experts and, on CUDA, the bf16 linears go further (``weights_for_wgrad_into``): the
  GEMM's ``wgrad_into`` writes or sums their gradient into ``.grad`` inside the wgrad GEMM (Triton grouped
  kernel; cuBLAS beta=1), unrounded, with no half-precision gradient at all.

The gradient is rounded to bf16 before the fp32 sum, as under plain autocast. A weight that is a DTensor,
has gradient hooks (e.g. TorchTitan's optimizer-in-backward) or needs a differentiable gradient
(``create_graph``), and any call inside a ``torch.compile`` trace (TorchTitan's per-block compile), keep the
plain path: cast per call, gradient through autograd. ``torch.autograd.grad(loss, weight)`` sees no gradient
for a weight on this path (it goes to ``.grad``), as with Megatron's gradient-accumulation fusion. Without
``new_step`` calls (a loop other than the converter's) nothing is cached; the gradient fusion still holds.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from primus_turbo.pytorch.core.main_grad import add_into_grads, split_for_autograd

_HALF = (torch.bfloat16, torch.float16)
_STEP: list[int | None] = [None]  # the optimizer step the cached copies belong to; None: no caching


def new_step() -> None:
    """An optimizer step has updated the weights: the next micro-batch casts (quantizes) them again."""
    _STEP[0] = 0 if _STEP[0] is None else _STEP[0] + 1


def disable_cache() -> None:
    """No caching until the next ``new_step`` (every call casts; the gradient fusion stays)."""
    _STEP[0] = None


def grad_fusable(weight: torch.Tensor) -> bool:
    """Whether an op may add ``weight``'s gradient into its ``.grad`` itself: an fp32 plain-tensor parameter
    (a leaf: not e.g. a DTensor's ``to_local()`` view, whose gradient must reach the DTensor) without
    gradient hooks (their owners expect autograd to deliver the gradient), outside a compile trace."""
    if torch.compiler.is_compiling():  # data_ptr / _version / the cache dict break a fullgraph trace
        return False
    return (
        weight.dtype == torch.float32
        and weight.is_leaf
        and not isinstance(weight, DTensor)
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and not getattr(weight, "_backward_hooks", None)
    )


def applies(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``weight`` takes this path for input ``x``: :func:`grad_fusable` under a half precision
    compute dtype."""
    return x.dtype in _HALF and grad_fusable(weight)


class _GradIntoWeights(torch.autograd.Function):
    """forward: ``carrier`` (the step's copy of the weights, concatenated along dim -2 when several, or a
    zero-storage stand-in of that shape for an FP8 copy) as a view; backward: each weight's rows of the
    gradient go into its ``.grad`` and autograd gets none."""

    @staticmethod
    def forward(ctx, carrier, *weights):
        ctx.weights = weights  # the Parameter objects: their .grad is read and written at backward time
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad):
        weights = ctx.weights
        if torch.is_grad_enabled():  # create_graph: the gradient must stay differentiable
            return None, *split_for_autograd(grad, weights)
        add_into_grads(weights, grad)
        return (None,) * (1 + len(weights))


def _cached(owner: torch.nn.Module, name: str, weights, tag, build):
    """``build()`` for ``owner``'s entry ``name`` once per step (the entry dies with the next rebuild)."""
    step = _STEP[0]
    if step is None:
        return build()
    key = (step, tuple((w.data_ptr(), w._version) for w in weights), tag)
    cache = owner.__dict__.setdefault("_turbo_amp_cache", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    cache.pop(name, None)  # free the stale copy before building the new one
    value = build()
    cache[name] = (key, value)
    return value


def _with_grad(carrier: torch.Tensor, weights) -> torch.Tensor:
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return _GradIntoWeights.apply(carrier, *weights)
    return carrier


def _cast(weights, dtype: torch.dtype) -> torch.Tensor:
    if len(weights) == 1:
        return weights[0].to(dtype)
    return torch.cat([w.to(dtype) for w in weights], dim=-2)


def cast_weights(owner: torch.nn.Module, name: str, weights, dtype: torch.dtype) -> torch.Tensor:
    """``weights`` in ``dtype`` (one weight, or several concatenated along dim -2, e.g. w1 and w3 as one
    [..., 2F, K] gate/up weight), cached per step, their gradients going into each weight's ``.grad``."""
    weights = tuple(weights)
    with torch.no_grad():
        cast = _cached(owner, name, weights, ("cast", dtype), lambda: _cast(weights, dtype))
    return _with_grad(cast, weights)


def cast_weight(owner: torch.nn.Module, name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` (cached per step) whose gradient goes into ``weight.grad``."""
    return cast_weights(owner, name, (weight,), dtype)


def _stand_in(weights, dtype: torch.dtype) -> torch.Tensor:
    """A zero-storage tensor of the (concatenated) weights' shape: the FP8 GEMM's gradient carrier, built
    with the step's FP8 copy rather than on every call."""
    shape = list(weights[0].shape)
    shape[-2] = sum(w.shape[-2] for w in weights)
    return torch.empty((), dtype=dtype, device=weights[0].device).expand(shape)


def fp8_weight(owner: torch.nn.Module, name: str, weight: torch.Tensor, config):
    """``weight`` [N, K] as the Float8Tensor ``gemm_fp8(x, ., trans_b=True)`` reads (quantized once per
    step from the fp32 values), its gradient going into ``weight.grad``. The stand-in source is fp32, so
    the wgrad GEMM writes fp32, as it does for the fp32 parameter on the plain path."""
    from primus_turbo.pytorch.modules.float8_linear import quantize_weight

    with torch.no_grad():
        build = lambda: (quantize_weight(weight, config), _stand_in((weight,), weight.dtype))  # noqa: E731
        w8, stand_in = _cached(owner, name, (weight,), ("fp8", config), build)
    return dataclasses.replace(w8, source=_with_grad(stand_in, (weight,)))


def weights_for_wgrad_into(owner: torch.nn.Module, name: str, weights, dtype: torch.dtype, config=None):
    """``(b, wgrad_into)`` for ``grouped_gemm(x, b, ..., trans_b=True, wgrad_into=wgrad_into)`` (or
    ``grouped_gemm_fp8(..., config=config, wgrad_into=...)``; for one dense weight, ``gemm(...,
    wgrad_into=wgrad_into[0])``): b is the step's copy of the weights ([G, N, K] experts, several
    concatenated along N; or one [N, K] weight) cast to ``dtype`` (the input's: the op takes one dtype for a
    and b), or their GroupedFloat8Weight quantized from that cast (as the plain path quantizes the cast
    weight on every call). When every weight needs a gradient, ``wgrad_into`` is the weights: the op sums
    their gradients into ``.grad`` inside the wgrad GEMM (no half-precision gradient, no add pass);
    otherwise None, and b carries the gradient (``_GradIntoWeights``) or none."""
    weights = tuple(weights)
    fused = torch.is_grad_enabled() and all(w.requires_grad for w in weights)
    if config is None:
        with torch.no_grad():
            cast = _cached(owner, name, weights, ("cast", dtype), lambda: _cast(weights, dtype))
        return (cast, weights) if fused else (_with_grad(cast, weights), None)
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import quantize_grouped_weight

    def build():
        return quantize_grouped_weight(_cast(weights, dtype), config), _stand_in(weights, dtype)

    with torch.no_grad():
        w8, stand_in = _cached(owner, name, weights, ("fp8", config, dtype), build)
    if fused:  # no source: the op's gradient goes to wgrad_into
        return dataclasses.replace(w8, source=None), weights
    return dataclasses.replace(w8, source=_with_grad(stand_in, weights)), None
