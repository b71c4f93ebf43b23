"""Tensor-parallel linears with sequence parallel and async-TP (Megatron shapes and names).

ColumnParallelLinear: weight [out / tp, in], bias [out / tp]. Input [s / tp, ..., in] with sequence
parallel (gathered along dim 0 inside a fused all-gather + GEMM), else [s, ..., in] replicated.
Output [s, ..., out / tp].

RowParallelLinear: weight [out, in / tp], bias [out] (added once, after the reduction). Input
[s, ..., in / tp]; output [s / tp, ..., out] with sequence parallel (fused GEMM + reduce-scatter),
else [s, ..., out] (all-reduce).

Backward overlaps:
  column: dgrad = dy @ W, its reduce-scatter (SP) / all-reduce (no SP) is launched async and
          waited only after wgrad = dy^T @ x_full has been issued;
  row (SP): the all-gather of dy is fused with the dgrad GEMM (fused_all_gather_matmul), and the
          gathered dy then feeds wgrad.
The column layer saves the gathered input for wgrad (tp x the shard's memory; Megatron re-gathers
instead); the row layer's bias gradient is the full-sequence gradient on every rank (no extra
all-reduce needed under SP).

FP8 (``fp8_config``, TENSORWISE or ROWWISE current scaling): the forward GEMMs run in FP8 (the
column layer gathers the FP8 activation: half the bytes); backward GEMMs run in bf16, with the
column layer dequantizing its saved FP8 input.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingStrategy
from primus_turbo.pytorch.core.utils import check_ranks_agree, debug_checks_enabled
from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import scaled_matmul
from primus_turbo.pytorch.ops.async_tp import (
    _group_name,
    _quantize_operands,
    _world,
    fused_all_gather_matmul,
    fused_all_gather_scaled_matmul,
    fused_matmul_reduce_scatter,
    quantize_for_async_tp,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _group(group_name: str):
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(group_name)


def _fp8_linear(x2d: torch.Tensor, weight: torch.Tensor, cfg: Float8QuantConfig) -> torch.Tensor:
    a_q, a_scale, (b_q,), (b_scale,) = _quantize_operands(x2d, [weight.t()], cfg, None)
    return scaled_matmul(a_q, b_q, a_scale, b_scale, x2d.dtype)


class _ColumnParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group_name, sequence_parallel, fp8_config, backend, save_gathered):
        world = _world(group_name)
        x2d = x.reshape(-1, x.shape[-1])
        gather = sequence_parallel and world > 1
        regather = gather and not save_gathered and fp8_config is None
        x_scale = None
        if gather and fp8_config is not None:
            rowwise = fp8_config.granularity is ScalingGranularity.ROWWISE
            x_q, x_scale_local = quantize_for_async_tp(
                x2d, fp8_config.format.fwd_dtype, 1 if rowwise else None, group_name
            )
            w_q, w_scale = quantize_for_async_tp(weight, fp8_config.format.fwd_dtype, 1 if rowwise else None)
            x_full, x_scale, (y,) = fused_all_gather_scaled_matmul(
                x_q,
                [w_q.t()],
                x_scale_local,
                [w_scale.view(1, -1) if rowwise else w_scale],
                0,
                group_name,
                out_dtypes=[x.dtype],
                backend=backend,
            )
        elif gather:
            x_full, (y,) = fused_all_gather_matmul(
                x2d, [weight.t()], 0, group_name, return_a=not regather, backend=backend
            )
            x_full = x2d if regather else x_full
        else:
            x_full = x2d
            y = _fp8_linear(x2d, weight, fp8_config) if fp8_config is not None else x2d @ weight.t()
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x_full, x_scale, weight)
        ctx.meta = (group_name, sequence_parallel, world, x.shape, x.dtype, bias is not None, regather)
        return y.view(-1, *x.shape[1:-1], weight.shape[0]) if gather else y.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x_full, x_scale, weight = ctx.saved_tensors
        group_name, sequence_parallel, world, x_shape, x_dtype, has_bias, regather = ctx.meta
        if x_scale is not None:  # FP8 forward: dequantize the saved gathered input for wgrad
            x_full = (x_full.float() * x_scale).to(x_dtype)
        work_ag = None
        if regather:  # saved only the shard: re-gather it while dgrad computes (Megatron's scheme)
            x_shard = x_full
            x_full = x_shard.new_empty((world * x_shard.shape[0], x_shard.shape[1]))
            work_ag = dist.all_gather_into_tensor(x_full, x_shard, group=_group(group_name), async_op=True)
        dy2d = dy.reshape(-1, dy.shape[-1])
        dgrad = dy2d @ weight
        work = None
        if world > 1 and sequence_parallel:
            dx = dgrad.new_empty((dgrad.shape[0] // world, dgrad.shape[1]))
            work = dist.reduce_scatter_tensor(dx, dgrad, group=_group(group_name), async_op=True)
        elif world > 1:
            dx = dgrad
            work = dist.all_reduce(dx, group=_group(group_name), async_op=True)
        else:
            dx = dgrad
        if work_ag is not None:
            work_ag.wait()
        dw = dy2d.t() @ x_full  # issued while the dgrad collective is in flight
        db = dy2d.sum(0) if has_bias else None
        if work is not None:
            work.wait()
        return dx.view(x_shape), dw, db, None, None, None, None, None


class _RowParallelFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group_name, sequence_parallel, fp8_config, backend):
        world = _world(group_name)
        x2d = x.reshape(-1, x.shape[-1])
        scatter = sequence_parallel and world > 1
        if scatter:
            y = fused_matmul_reduce_scatter(
                x2d, weight.t(), "sum", 0, group_name, fp8_config=fp8_config, backend=backend
            )
        else:
            y = _fp8_linear(x2d, weight, fp8_config) if fp8_config is not None else x2d @ weight.t()
            if world > 1:
                dist.all_reduce(y, group=_group(group_name))
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(x2d, weight)
        ctx.meta = (group_name, scatter, x.shape, bias is not None, backend)
        lead = (-1, *x.shape[1:-1]) if scatter else tuple(x.shape[:-1])
        return y.view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        group_name, scatter, x_shape, has_bias, backend = ctx.meta
        dy2d = dy.reshape(-1, dy.shape[-1])
        if scatter:
            dy_full, (dx,) = fused_all_gather_matmul(dy2d, [weight], 0, group_name, backend=backend)
        else:
            dy_full, dx = dy2d, dy2d @ weight
        dw = dy_full.t() @ x2d
        db = dy_full.sum(0) if has_bias else None
        return dx.view(x_shape), dw, db, None, None, None, None


class _ParallelLinearBase(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp_group,
        sequence_parallel: bool,
        fp8_config: Float8QuantConfig | None,
        backend: str | None,
        partition_dim: int,
        device,
        dtype,
    ):
        super().__init__()
        if fp8_config is not None and not isinstance(fp8_config, Float8QuantConfig):
            raise TypeError(
                f"fp8_config: expected Float8QuantConfig or None, got {type(fp8_config).__name__}"
            )
        if fp8_config is not None and (
            fp8_config.granularity not in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE)
            or fp8_config.strategy is not ScalingStrategy.CURRENT
        ):  # what the async-TP FP8 GEMMs take; said here rather than at the first forward
            raise ValueError(
                "fp8_config: the parallel linears run TENSORWISE or ROWWISE CURRENT scaling, got "
                f"{fp8_config.granularity.name} {fp8_config.strategy.name}"
            )
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name}: expected a positive int, got {size!r}")
        if backend is not None:  # a typo fails here, not at the first sequence-parallel forward
            BackendType.parse(backend, source="backend")
        if not dist.is_initialized() and tp_group is None:
            raise ValueError("tp_group: torch.distributed is not initialized; init it or pass a group")
        self.group_name = _group_name(tp_group, "tp_group")
        self.tp_size = _world(self.group_name)
        self.in_features, self.out_features = in_features, out_features
        full = (out_features, in_features)
        if full[partition_dim] % self.tp_size:
            name = "out_features" if partition_dim == 0 else "in_features"
            raise ValueError(f"{name}={full[partition_dim]} is not divisible by the TP size {self.tp_size}")
        shape = list(full)
        shape[partition_dim] //= self.tp_size
        self.sequence_parallel = bool(sequence_parallel)
        self.fp8_config = fp8_config
        self.backend = backend
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        bound = 1 / math.sqrt(in_features)  # nn.Linear's init, with the unsharded fan-in
        nn.init.uniform_(self.weight, -bound, bound)
        # Megatron's parameter attributes, so its optimizer/grad utilities treat these correctly.
        self.weight.tensor_model_parallel, self.weight.partition_dim, self.weight.partition_stride = (
            True,
            partition_dim,
            1,
        )

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_config is None else f", fp8={self.fp8_config.granularity.name}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, tp_size={self.tp_size}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}{fp8}"
        )


class ColumnParallelLinear(_ParallelLinearBase):
    """y[:, out/tp slice] = x @ W_shard^T + b_shard; SP input gathered by a fused AG+GEMM.

    ``save_gathered_input`` (bf16, SP): True keeps the gathered input for wgrad (fastest backward,
    tp x the activation memory); False keeps only the shard and re-gathers it in backward with an
    async all-gather that overlaps the dgrad GEMM (Megatron's scheme). FP8 always keeps the
    gathered FP8 input (already half the bytes of bf16).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group=None,
        sequence_parallel: bool = False,
        fp8_config: Float8QuantConfig | None = None,
        backend: str | None = None,
        save_gathered_input: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__(
            in_features,
            out_features,
            bias,
            tp_group,
            sequence_parallel,
            fp8_config,
            backend,
            0,
            device,
            dtype,
        )
        self.save_gathered_input = bool(save_gathered_input)
        self.bias = (
            nn.Parameter(torch.zeros(self.weight.shape[0], device=device, dtype=dtype)) if bias else None
        )
        if self.bias is not None:
            self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"x: last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}"
            )
        if x.dtype != self.weight.dtype:
            raise TypeError(f"x: dtype {x.dtype} differs from the weight's {self.weight.dtype}")
        if self.tp_size > 1 and debug_checks_enabled():  # the TP ranks' inputs must agree
            check_ranks_agree("ColumnParallelLinear", {"x": (tuple(x.shape), x.dtype)}, self.group_name)
        return _ColumnParallelFn.apply(
            x.contiguous(),
            self.weight,
            self.bias,
            self.group_name,
            self.sequence_parallel,
            self.fp8_config,
            self.backend,
            self.save_gathered_input,
        )


class RowParallelLinear(_ParallelLinearBase):
    """y = reduce(x[:, in/tp slice] @ W_shard^T) + b; SP output reduce-scattered by a fused GEMM+RS."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group=None,
        sequence_parallel: bool = False,
        fp8_config: Float8QuantConfig | None = None,
        backend: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(
            in_features,
            out_features,
            bias,
            tp_group,
            sequence_parallel,
            fp8_config,
            backend,
            1,
            device,
            dtype,
        )
        # Not marked ``sequence_parallel``: its gradient is already the full-sequence sum on every rank (from
        # the gathered dy); Megatron's finalize_model_grads would all-reduce a marked one's gradient again
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"x: last dim must be in_features / tp = {self.weight.shape[1]}, got shape {tuple(x.shape)}"
            )
        if x.dtype != self.weight.dtype:
            raise TypeError(f"x: dtype {x.dtype} differs from the weight's {self.weight.dtype}")
        if self.sequence_parallel and self.tp_size > 1 and x.shape[0] % self.tp_size:
            raise ValueError(
                f"x: sequence length {x.shape[0]} (dim 0) is not divisible by the TP size {self.tp_size}"
            )
        if self.tp_size > 1 and debug_checks_enabled():  # the TP ranks' inputs must agree
            check_ranks_agree("RowParallelLinear", {"x": (tuple(x.shape), x.dtype)}, self.group_name)
        return _RowParallelFn.apply(
            x.contiguous(),
            self.weight,
            self.bias,
            self.group_name,
            self.sequence_parallel,
            self.fp8_config,
            self.backend,
        )
