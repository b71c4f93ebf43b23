"""Weights of single-device TorchTitan AMP runs: cast once per optimizer step, gradients added into ``.grad``.

Without FSDP (one GPU), TorchTitan keeps fp32 parameters and runs the forward under ``torch.autocast``
(bf16). Per micro-batch, every weight is then cast to bf16 again (6 bytes per element), and the backward
turns each bf16 weight gradient into a new fp32 tensor (6 bytes per element) that AccumulateGrad adds
into ``.grad`` (12 more). H200 profile of ``deepseek_moe_fp8`` (2.2B parameters, 4 micro-batches per step):
~77 ms of a 323 ms step in those casts and adds.

Here the turbo linears and experts, when their weight is such an fp32 parameter and the input is half
precision:

- read the weight cast to bf16 (or quantized to FP8) once per optimizer step: the copy is cached on the
  module, keyed by the step (``new_step``, called by the converter's post-optimizer hook), the weight's
  storage and its version counter, so an in-place write between micro-batches also rebuilds it;
- add the half-precision weight gradient into the fp32 ``.grad`` in the backward, in one vectorized pass
  (``core.main_grad.add_into_``; the first micro-batch of a step stores it as ``.grad``) and give
  autograd no gradient for the weight: no fp32 temporary, no AccumulateGrad.

The gradient is rounded to bf16 before the fp32 sum, as under plain autocast. A weight that is a DTensor,
has gradient hooks (e.g. TorchTitan's optimizer-in-backward) or needs a differentiable gradient
(``create_graph``) keeps the plain path: cast per call, gradient through autograd. Without
``new_step`` calls (a loop other than the converter's) nothing is cached; the gradient fusion still holds.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import DTensor

from primus_turbo.pytorch.core.main_grad import add_into_

_HALF = (torch.bfloat16, torch.float16)
_STEP: list[int | None] = [None]  # the optimizer step the cached copies belong to; None: no caching


def new_step() -> None:
    """An optimizer step has updated the weights: the next micro-batch casts (quantizes) them again."""
    _STEP[0] = 0 if _STEP[0] is None else _STEP[0] + 1


def disable_cache() -> None:
    _STEP[0] = None


def applies(weight: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``weight`` takes this path for input ``x``: an fp32 plain-tensor parameter under a half
    precision compute dtype, without gradient hooks (their owners expect autograd to deliver the gradient)."""
    return (
        weight.dtype == torch.float32
        and x.dtype in _HALF
        and not isinstance(weight, DTensor)
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and not getattr(weight, "_backward_hooks", None)
    )


class _GradIntoWeight(torch.autograd.Function):
    """forward: ``carrier`` (the step's cast of ``weight``, or a zero-storage stand-in of its shape for an
    FP8 copy) as a view; backward: the gradient goes into ``weight.grad`` and autograd gets none."""

    @staticmethod
    def forward(ctx, carrier, weight):
        ctx.weight = weight  # the Parameter object: its .grad is read and written at backward time
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad):
        weight = ctx.weight
        if torch.is_grad_enabled():  # create_graph: the gradient must stay differentiable
            return None, grad.to(weight.dtype)
        if weight.grad is None:
            weight.grad = grad.to(weight.dtype, memory_format=torch.contiguous_format)
        else:
            add_into_(weight.grad, grad)
        return None, None


def _cached(owner: torch.nn.Module, name: str, weight: torch.Tensor, tag, build):
    """``build()`` for ``owner.<name>`` once per step (the entry dies with the next step's rebuild)."""
    step = _STEP[0]
    if step is None:
        return build()
    key = (step, weight.data_ptr(), weight._version, tag)
    cache = owner.__dict__.setdefault("_turbo_amp_cache", {})
    hit = cache.get(name)
    if hit is not None and hit[0] == key:
        return hit[1]
    cache.pop(name, None)  # free the stale copy before building the new one
    value = build()
    cache[name] = (key, value)
    return value


def _with_grad(carrier: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and weight.requires_grad:
        return _GradIntoWeight.apply(carrier, weight)
    return carrier


def cast_weight(owner: torch.nn.Module, name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` (cached per step) whose gradient goes into ``weight.grad``."""
    with torch.no_grad():
        cast = _cached(owner, name, weight, ("cast", dtype), lambda: weight.to(dtype))
    return _with_grad(cast, weight)


def _stand_in(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty((), dtype=dtype, device=weight.device).expand(weight.shape)


def fp8_weight(owner: torch.nn.Module, name: str, weight: torch.Tensor, config):
    """``weight`` [N, K] as the Float8Tensor ``gemm_fp8(x, ., trans_b=True)`` reads (quantized once per
    step from the fp32 values), its gradient going into ``weight.grad``. The stand-in source is fp32, so
    the wgrad GEMM writes fp32, as it does for the fp32 parameter on the plain path."""
    from primus_turbo.pytorch.modules.float8_linear import quantize_weight

    with torch.no_grad():
        w8 = _cached(owner, name, weight, ("fp8", config), lambda: quantize_weight(weight, config))
    return dataclasses.replace(w8, source=_with_grad(_stand_in(weight, weight.dtype), weight))


def fp8_grouped_weight(owner: torch.nn.Module, name: str, weight: torch.Tensor, config, dtype: torch.dtype):
    """Expert weights [G, N, K] as the GroupedFloat8Weight ``grouped_gemm_fp8(x, ., trans_b=True)`` reads
    (quantized once per step), their gradient (in ``dtype``, the input's: the op takes one dtype for a and
    b) going into ``weight.grad``."""
    from primus_turbo.pytorch.ops.grouped_gemm_fp8 import quantize_grouped_weight

    with torch.no_grad():  # from the cast, as the plain path quantizes the cast weight on every call
        build = lambda: quantize_grouped_weight(weight.to(dtype), config)  # noqa: E731
        w8 = _cached(owner, name, weight, ("fp8", config, dtype), build)
    return dataclasses.replace(w8, source=_with_grad(_stand_in(weight, dtype), weight))
