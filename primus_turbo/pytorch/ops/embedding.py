"""Embedding lookup whose weight gradient can go straight into the weight's fp32 ``main_grad``.

``embedding(input, weight)`` is ``F.embedding(input, weight)``. With ``accumulate_into_main_grad=True``
(Megatron's gradient_accumulation_fusion for the word embedding) the backward adds each token's output
gradient into ``weight.main_grad[id]`` in fp32 (one deterministic Triton kernel over the touched rows) and
returns Megatron's placeholder gradient, instead of a dense [V, H] gradient that DDP then adds into
``main_grad`` (a zero-fill, a scatter and a [V, H] fp32 += bf16 pass). H100, 4096 tokens, V = 102400,
H = 2048: 0.16 ms vs 1.21 ms (benchmark/ops/bench_embedding.py). Without it, the gradient is torch's own
(``embedding_dense_backward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from primus_turbo.pytorch.core.main_grad import check_main_grad, wgrad_placeholder
from primus_turbo.pytorch.core.utils import debug_checks_enabled
from primus_turbo.pytorch.kernels.embedding.embedding_impl import embedding_accumulate_

__all__ = ["embedding"]

_INDEX_DTYPES = (torch.int32, torch.int64)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, accumulate):
        ctx.save_for_backward(input)
        ctx.weight = weight if accumulate else None  # the Python object carries main_grad
        ctx.num_weights = weight.shape[0]
        return F.embedding(input, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (input,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None
        ids = input.reshape(-1)
        grad = grad_out.reshape(ids.shape[0], grad_out.shape[-1])
        if ctx.weight is None:
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.num_weights, -1, False), None
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        embedding_accumulate_(ctx.weight.main_grad, ids, grad)
        return None, wgrad_placeholder(ctx.weight), None


def _check_ids(input: torch.Tensor, num_weights: int) -> None:
    """Ids outside [0, V) raise, naming the range: free on CPU, one host sync on CUDA, so there only with
    PRIMUS_TURBO_DEBUG_CHECKS=1 (without it F.embedding's device-side assert fires, as in torch)."""
    if torch.compiler.is_compiling() or input.numel() == 0:
        return
    if input.device.type == "cpu" or debug_checks_enabled():
        lo, hi = int(input.min()), int(input.max())
        if lo < 0 or hi >= num_weights:
            bounds = f"[0, {num_weights}) (weight.shape[0]), got range [{lo}, {hi}]"
            raise ValueError(f"embedding: input ids must be in {bounds}")


def embedding(
    input: torch.Tensor, weight: torch.Tensor, *, accumulate_into_main_grad: bool = False
) -> torch.Tensor:
    """``weight[input]``: input int32/int64 of any shape, weight [V, H] -> [*input.shape, H].

    accumulate_into_main_grad: the weight gradient is added into ``weight.main_grad`` (a [V, H] tensor,
    usually fp32, allocated by the caller, e.g. Megatron DDP) and ``weight`` receives Megatron's placeholder
    (see primus_turbo.pytorch.core.main_grad). Ids must lie in [0, V): ValueError otherwise (CPU ids always,
    CUDA ids with PRIMUS_TURBO_DEBUG_CHECKS=1; without it F.embedding's device-side assert, as in torch).
    """
    if not isinstance(input, torch.Tensor) or input.dtype not in _INDEX_DTYPES:
        got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
        raise TypeError(f"embedding: input must be an int32 or int64 tensor of token ids, got {got}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        is_tensor = isinstance(weight, torch.Tensor)
        got = f"{tuple(weight.shape)} {weight.dtype}" if is_tensor else type(weight).__name__
        raise ValueError(f"embedding: weight must be a 2-D floating-point [V, H] tensor, got {got}")
    if input.device != weight.device:
        raise ValueError(f"embedding: input is on {input.device} but weight on {weight.device}")
    if accumulate_into_main_grad:
        check_main_grad(weight, "embedding", "weight")  # shape, device, floating-point
        if weight.main_grad.stride(-1) != 1:
            raise ValueError(
                "embedding: weight.main_grad needs unit stride along H (a contiguous [V, H] buffer)"
            )
    _check_ids(input, weight.shape[0])
    return _Embedding.apply(input, weight, bool(accumulate_into_main_grad))
