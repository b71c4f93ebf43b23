"""Expert-parallel token dispatch and combine (differentiable).

    recv_x, recv_indices, recv_probs, tokens_per_expert, handle = moe_dispatch(x, indices, probs,
                                                                               num_experts, group)
    ... local experts on recv_x (recv_indices are local expert ids, -1 = expert on another rank) ...
    y = moe_combine(expert_out, group, handle)          # [T, H]: sum of every rank's rows per token

The backward of dispatch is a combine (token grads summed over ranks; probs grads routed back to
the owning slot) and the backward of combine is a dispatch with the same layout. ``x`` may be a
(x_fp8, x_scale) pair: the scales travel with the rows (forward only for x; probs stay
differentiable). Backend choice: see kernels/moe/dispatch_impl.py (NCCL needs one host sync per
dispatch for the split sizes; TURBO needs none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.kernels.moe.dispatch_impl import (
    DispatchHandle,
    MoEDispatchCombineDispatcher,
    nccl_dispatch_cached,
    validate_dispatch,
)

__all__ = ["moe_dispatch", "moe_combine", "DispatchHandle"]


def _dispatch_raw(x, x_scale, indices, probs, num_experts, group):
    return MoEDispatchCombineDispatcher.dispatch(
        kind="dispatch",
        x=x,
        x_scale=x_scale,
        indices=indices,
        probs=probs,
        num_experts=num_experts,
        group=group,
    )


def _combine_raw(x, handle, topk_weights=None):
    return MoEDispatchCombineDispatcher.dispatch(
        kind="combine", x=x, handle=handle, topk_weights=topk_weights
    )


def _dispatch_cached(x, handle):
    if handle.backend.name == "NCCL":
        return nccl_dispatch_cached(x, handle)
    if handle.backend.name == "TURBO":
        from primus_turbo.pytorch.kernels.moe.ep_turbo import turbo_dispatch_cached

        return turbo_dispatch_cached(x, handle)
    from primus_turbo.pytorch.kernels.moe.ep_deepep import deepep_dispatch_cached

    return deepep_dispatch_cached(x, handle)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, x_scale, indices, num_experts, group):
        recv_x, recv_scale, recv_idx, recv_probs, tokens_per_expert, handle = _dispatch_raw(
            x, x_scale, indices, probs, num_experts, group
        )
        ctx.handle = handle
        ctx.x_dtype = x.dtype
        ctx.mark_non_differentiable(recv_idx, tokens_per_expert)
        if recv_scale is not None:
            ctx.mark_non_differentiable(recv_scale)
        ctx.save_for_backward(recv_idx)
        return recv_x, recv_probs, recv_scale, recv_idx, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_x, grad_probs, _gs, _gi, _gt, _gh):
        (recv_idx,) = ctx.saved_tensors
        weights = None
        if grad_probs is not None:
            weights = torch.where(
                recv_idx >= 0, grad_probs.float(), torch.zeros((), device=grad_probs.device)
            )
        if grad_x is None:
            grad_x = torch.zeros((ctx.handle.num_recv, ctx.handle.hidden), device=recv_idx.device)
        gx, gw = _combine_raw(grad_x.contiguous(), ctx.handle, weights)
        grad_in_x = gx if ctx.x_dtype.is_floating_point and ctx.x_dtype.itemsize > 1 else None
        return grad_in_x, gw, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, handle):
        out, _ = _combine_raw(x.contiguous(), handle)
        ctx.handle = handle
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return _dispatch_cached(grad_out.contiguous(), ctx.handle), None


def moe_dispatch(x, indices, probs, num_experts, group=None):
    """Send every token to the EP ranks owning its experts.

    Args:
        x: [T, H] tokens, or a (x_fp8 [T, H], x_scale [T, ...]) pair.
        indices: [T, K] global expert ids (int32/int64; -1 = no route). Expert e lives on rank
            e // (num_experts / W).
        probs: [T, K] fp32 routing probs or None.
        num_experts: global number of experts (a multiple of the group size W).
        group: the EP process group (default: the world).

    Arguments are checked on each rank before any communication; settings that must agree across ranks
    (num_experts, hidden, topk, dtype, probs, x_scale width) are compared in the first exchange and a mismatch
    raises on every rank. A bad input on one rank only raises there, and its peers wait in the collective
    until the process group's timeout (agreeing on validity first would cost a collective per call).

    Returns:
        (recv_x [N, H] or (recv_x, recv_scale), recv_indices [N, K] local ids in the dtype of indices
        (-1 elsewhere), recv_probs [N, K] (0 elsewhere) or None, tokens_per_expert [E / W] int32 device
        tensor, handle for moe_combine).
    """
    x_scale = None
    if isinstance(x, (tuple, list)):
        x, x_scale = x
    group = group if group is not None else dist.group.WORLD
    validate_dispatch(x, x_scale, indices, probs, num_experts, group)
    recv_x, recv_probs, recv_scale, recv_idx, tokens_per_expert, handle = _Dispatch.apply(
        x.contiguous(),
        probs.float().contiguous() if probs is not None else None,
        x_scale.contiguous() if x_scale is not None else None,
        indices.contiguous(),
        num_experts,
        group,
    )
    recv = (recv_x, recv_scale) if x_scale is not None else recv_x
    return recv, recv_idx, recv_probs, tokens_per_expert, handle


def moe_combine(x: torch.Tensor, group, handle: DispatchHandle) -> torch.Tensor:
    """Send expert outputs [N, H] back and sum them per source token: returns [T, H]."""
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"moe_combine: handle must come from moe_dispatch, got {type(handle).__name__}")
    if x.dim() != 2 or x.shape[0] != handle.num_recv:
        raise ValueError(f"moe_combine: x must be [num_recv={handle.num_recv}, hidden], got {tuple(x.shape)}")
    return _Combine.apply(x, handle)
