"""``turbo.async_tp``: Megatron's sequence-parallel linears with their collectives fused into the GEMMs.

Under tensor + sequence parallelism Megatron runs, per linear:
  column: all-gather(x) -> GEMM;   backward: dgrad GEMM -> reduce-scatter, re-gather x -> wgrad GEMM
  row:    GEMM -> reduce-scatter;  backward: all-gather(dy) -> dgrad GEMM, wgrad GEMM
Here the gather and the scatter ride inside ``turbo.ops.fused_all_gather_matmul`` /
``fused_matmul_reduce_scatter`` (backend measured once per shape and agreed across ranks: the NCCL
unfused path unless an overlapped one is >= 3% faster; ``PRIMUS_TURBO_ASYNC_TP_BACKEND`` pins one):
  column forward  = fused all-gather + GEMM (the gathered input is not kept: Megatron's memory scheme)
  column backward = fused dgrad GEMM + reduce-scatter, while the input is re-gathered on NCCL's stream
  row forward     = fused GEMM + reduce-scatter
  row backward    = fused all-gather(dy) + dgrad GEMM; the gathered dy feeds the wgrad GEMM
Weight gradients go into ``weight.main_grad`` when Megatron's DDP gave the weight one (turbo's wgrad GEMM,
as the turbo.gemm linears do), else they are returned. bf16/fp16/fp32 linears only: under precision=fp8
the patch refuses turbo.async_tp (the FP8 linears run turbo's FP8 GEMMs instead).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from primus_turbo.integrations.megatron import turbo_ops

__all__ = ["column_forward", "row_forward"]


def _accumulates(weight: torch.Tensor) -> bool:
    return weight.requires_grad and isinstance(getattr(weight, "main_grad", None), torch.Tensor)


def _wgrad(x2d: torch.Tensor, dy2d: torch.Tensor, weight: torch.Tensor, accumulate: bool):
    """dW = dy^T @ x for y = x @ W^T, into ``weight.main_grad`` (placeholder returned) when accumulating."""
    gemm_wgrad = turbo_ops.get("ops.gemm.gemm_wgrad")
    return gemm_wgrad(x2d, dy2d, False, True, weight.dtype, weight if accumulate else None)


def _keep(ctx, x, x2d, weight, group, y) -> torch.Tensor:
    """Save what both backwards need; return y [rows, out] viewed as [-1, *x's middle dims, out]."""
    ctx.save_for_backward(x2d, weight)
    ctx.group, ctx.x_shape, ctx.accumulate = group, x.shape, _accumulates(weight)
    return y.view(-1, *x.shape[1:-1], weight.shape[0])


class _ColumnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        x2d = x.reshape(-1, x.shape[-1])
        fused_ag = turbo_ops.get("ops.fused_all_gather_matmul")
        _, (y,) = fused_ag(x2d, [weight.t()], 0, group, return_a=False)
        return _keep(ctx, x, x2d, weight, group, y)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        group = ctx.group
        x_full = x2d.new_empty((group.size() * x2d.shape[0], x2d.shape[1]))
        gather = dist.all_gather_into_tensor(x_full, x2d, group=group, async_op=True)
        dy2d = dy.reshape(-1, dy.shape[-1])
        dx = turbo_ops.get("ops.fused_matmul_reduce_scatter")(dy2d, weight, "sum", 0, group)
        gather.wait()
        dw = _wgrad(x_full, dy2d, weight, ctx.accumulate)
        return dx.view(ctx.x_shape), dw, None


class _RowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group):
        x2d = x.reshape(-1, x.shape[-1])
        y = turbo_ops.get("ops.fused_matmul_reduce_scatter")(x2d, weight.t(), "sum", 0, group)
        return _keep(ctx, x, x2d, weight, group, y)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])
        fused_ag = turbo_ops.get("ops.fused_all_gather_matmul")
        dy_full, (dx,) = fused_ag(dy2d, [weight], 0, ctx.group, return_a=True)
        dw = _wgrad(x2d, dy_full, weight, ctx.accumulate)
        return dx.view(ctx.x_shape), dw, None


def column_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp_group):
    """ColumnParallelLinear._forward_impl under sequence parallel: x [s / tp, b, in] -> [s, b, out / tp]."""
    out = _ColumnFn.apply(x, weight, tp_group)
    return out + bias if bias is not None else out


def row_forward(x: torch.Tensor, weight: torch.Tensor, tp_group) -> torch.Tensor:
    """RowParallelLinear's GEMM + reduce-scatter: x [s, b, in / tp] -> [s / tp, b, out] (bias not added)."""
    return _RowFn.apply(x, weight, tp_group)
