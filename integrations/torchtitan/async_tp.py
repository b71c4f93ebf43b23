"""``turbo.async_tp`` for TorchTitan: the TP plan's sequence-parallel gathers and scatters fused into GEMMs.

TorchTitan's TP plan (llama3, qwen3, deepseek_v3) all-gathers each block's ``attention`` / ``feed_forward``
input over the sequence (``PrepareModuleInput``: Shard(1) -> Replicate), runs the linears that read it
(ColwiseParallel wq/wk/wv, w1/w3; NoParallel wkv_a/wq_a in MLA) on the gathered copy, and reduce-scatters the
output projection (RowwiseParallel wo/w2, output Shard(1)). Here, per marked block module:

  input gather + every GEMM that reads it -> one ``turbo.ops.fused_all_gather_matmul`` (a pre-hook on the
      module, run before TorchTitan's own; the gathered input it returns is handed on as the Replicate
      DTensor TorchTitan's hook expects, so that hook moves nothing);
  those linears' forwards return their slice of the fused result, as the DTensor their ParallelStyle's output
      hook expects (Shard(-1) for column-parallel, Replicate for NoParallel);
  wo / w2 -> GEMM + reduce-scatter in ``turbo.ops.fused_matmul_reduce_scatter`` (the Megatron adapter's
      function), output the Shard(1) DTensor RowwiseParallel's hook expects.

Backward of the fused gather: the column-parallel gradients' dgrad sum is reduce-scattered asynchronously
while the weight-gradient GEMMs run; the replicated consumers' gradients are whole on every rank (DTensor
all-reduces them before they reach us), so only their local rows are added after the scatter. Their weight
gradients come out whole (Replicate), where stock DTensor leaves them Partial until read.

Parameters stay TorchTitan's DTensors (same names, shapes and placements: checkpoints load either way). Blocks
are marked on the meta model by the converter; the hooks check on the first call that TorchTitan's plan was
applied as expected and stop the run otherwise. MoE layers keep TorchTitan's TP (their gather feeds the router
and experts, not linears). Eager only: ``framework.compile=true`` is refused by the converter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from primus_turbo.integrations.megatron.turbo_async_tp import row_forward
from primus_turbo.integrations.torchtitan.turbo_modules import autocast_input
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.models.deepseek_v3.model.model import Attention as MLAAttention
from torchtitan.models.llama3.model.model import Attention as Llama3Attention
from torchtitan.models.qwen3.model.model import Attention as Qwen3Attention

from primus_turbo.pytorch.ops.async_tp import fused_all_gather_matmul

__all__ = ["mark_blocks", "plan_for"]

_GQA = (Llama3Attention, Qwen3Attention)
_ATTR = "_turbo_async_tp"


def plan_for(name: str, module: nn.Module) -> tuple[tuple[str, ...], str] | None:
    """(linears reading the gathered input, the row-parallel output linear) of a block child, or None (not a
    module this adapter fuses; one with a biased linear keeps TorchTitan's plan)."""
    if name == "attention" and isinstance(module, _GQA):
        plan = ("wq", "wk", "wv"), "wo"
    elif name == "attention" and isinstance(module, MLAAttention):
        plan = (("wq",) if module.q_lora_rank == 0 else ("wq_a",)) + ("wkv_a",), "wo"
    elif name == "feed_forward" and all(hasattr(module, w) for w in ("w1", "w2", "w3")):
        plan = ("w1", "w3"), "w2"
    else:
        return None
    return None if any(getattr(module, w).bias is not None for w in (*plan[0], plan[1])) else plan


def mark_blocks(model: nn.Module) -> list[str]:
    """Mark every TransformerBlock's attention / dense feed-forward that ``plan_for`` accepts for the fused
    path (the converter, on the meta model). Returns the marked module paths."""
    marked = []
    for block_name, block in getattr(model, "layers", nn.ModuleDict()).items():
        for name, module in block.named_children():
            plan = plan_for(name, module)
            if plan is not None:
                path = f"layers.{block_name}.{name}"
                setattr(module, _ATTR, _FusedBlock(module, *plan, path))
                marked.append(path)
    return marked


class _GatherMatmulsFn(torch.autograd.Function):
    """x_full, y_i = all_gather(x rows), x_full @ W_i^T for seq-first 2D rows; ``replicated[i]``: W_i is whole
    on every rank (its output gradient arrives whole), else column-sharded (its dgrad is a partial sum)."""

    @staticmethod
    def forward(ctx, x2d, group, replicated, *weights):
        x_full, outs = fused_all_gather_matmul(x2d, [w.t() for w in weights], 0, group, return_a=True)
        ctx.save_for_backward(x_full, *weights)
        ctx.group, ctx.replicated = group, replicated
        ctx.set_materialize_grads(False)
        return (x_full, *outs)

    @staticmethod
    def backward(ctx, g_full, *gs):
        x_full, *weights = ctx.saved_tensors
        group = ctx.group
        world, rank = group.size(), group.rank()
        rows = x_full.shape[0] // world
        partial = None
        for g, w, rep in zip(gs, weights, ctx.replicated):
            if g is not None and not rep:
                partial = g @ w if partial is None else partial.addmm_(g, w)
        work = dx = None
        if partial is not None:
            dx = partial.new_empty((rows, partial.shape[1]))
            work = dist.reduce_scatter_tensor(dx, partial, group=group, async_op=True)
        dws = [None if g is None else (g.t() @ x_full).to(w.dtype) for g, w in zip(gs, weights)]
        local = slice(rank * rows, (rank + 1) * rows)
        whole = [g_full[local]] if g_full is not None else []
        whole += [g[local] @ w for g, w, rep in zip(gs, weights, ctx.replicated) if g is not None and rep]
        if work is not None:
            work.wait()
        for extra in whole:
            dx = extra.to(x_full.dtype) if dx is None else dx.add_(extra)
        if dx is None:
            dx = x_full.new_zeros((rows, x_full.shape[1]))
        return (dx, None, None, *dws)


def _sharded_last(x: DTensor) -> bool:
    (p,) = x.placements
    return isinstance(p, Shard) and p.dim in (-1, x.ndim - 1)


def _check(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise RuntimeError(
            f"turbo.async_tp: {where}: {what}; TorchTitan's TP plan was not applied as this adapter expects "
            "(set turbo.async_tp=false to run TorchTitan's own TP)"
        )


class _FusedBlock:
    """The hooks of one marked module: the fused gather (pre-hook) and the linears' replacement forwards."""

    def __init__(self, module: nn.Module, consumers: tuple[str, ...], row: str, path: str):
        self.consumers, self.row, self.path, self.checked = consumers, row, path, False
        self.pending: dict[str, torch.Tensor] = {}
        module.register_forward_pre_hook(self._pre_hook)  # before TorchTitan's PrepareModuleInput hook
        for name in consumers:
            getattr(module, name).forward = self._consumer_forward(name)
        getattr(module, row).forward = self._row_forward(getattr(module, row))

    def _check_plan(self, module: nn.Module) -> None:
        for name in self.consumers:
            w = getattr(module, name).weight
            _check(isinstance(w, DTensor), f"{self.path}.{name}.weight", "is not a DTensor")
            _check(w.placements in ((Shard(0),), (Replicate(),)), f"{self.path}.{name}.weight",
                   f"placements {w.placements}, expected (Shard(0),) or (Replicate(),)")  # fmt: skip
        w = getattr(module, self.row).weight
        _check(isinstance(w, DTensor) and w.placements == (Shard(1),), f"{self.path}.{self.row}.weight",
               "is not a DTensor sharded on dim 1 (RowwiseParallel)")  # fmt: skip
        _check(len(module._forward_pre_hooks) >= 2, self.path, "has no PrepareModuleInput hook")
        self.checked = True

    def _pre_hook(self, module: nn.Module, args):
        if not self.checked:
            self._check_plan(module)
        x = args[0]
        if isinstance(x, DTensor):
            _check(
                x.placements == (Shard(1),),
                f"{self.path} input",
                f"placements {x.placements}, expected Shard(1)",
            )
            mesh, x = x.device_mesh, x.to_local()
        else:
            mesh = getattr(module, self.consumers[0]).weight.device_mesh
        weights = [getattr(module, n).weight for n in self.consumers]
        replicated = tuple(w.placements == (Replicate(),) for w in weights)
        b, s_local, hidden = x.shape
        # seq-first rows (the gather dim leads), operands cast as autocast casts F.linear's (opaque ops here)
        x2d = autocast_input(x).transpose(0, 1).reshape(s_local * b, hidden)
        local_w = [autocast_input(w.to_local()) for w in weights]
        with torch.autocast(x.device.type, enabled=False):
            x_full, *outs = _GatherMatmulsFn.apply(x2d, mesh.get_group(), replicated, *local_w)
        s = s_local * mesh.size()
        for name, y, rep in zip(self.consumers, outs, replicated):
            y = y.view(s, b, -1).transpose(0, 1)
            self.pending[name] = DTensor.from_local(
                y, mesh, (Replicate(),) if rep else (Shard(-1),), run_check=False
            )
        full = DTensor.from_local(
            x_full.view(s, b, hidden).transpose(0, 1), mesh, (Replicate(),), run_check=False
        )
        return (full, *args[1:])

    def _consumer_forward(self, name: str):
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self.pending.pop(name, None)
            _check(out is not None, f"{self.path}.{name}", "called without its block's fused all-gather")
            _check(tuple(x.shape[:-1]) == tuple(out.shape[:-1]), f"{self.path}.{name}",
                   f"input {tuple(x.shape)} is not the gathered block input {tuple(out.shape)}")  # fmt: skip
            return out

        return forward

    def _row_forward(self, linear: nn.Module):
        def forward(x: torch.Tensor) -> torch.Tensor:
            _check(isinstance(x, DTensor) and _sharded_last(x), f"{self.path}.{self.row} input",
                   "expected RowwiseParallel's DTensor sharded on the last dim")  # fmt: skip
            mesh, local = x.device_mesh, x.to_local()
            w, x_sbk = autocast_input(linear.weight.to_local()), autocast_input(local).transpose(0, 1)
            with torch.autocast(local.device.type, enabled=False):
                y = row_forward(x_sbk, w, mesh.get_group())  # [s / tp, b, out]
            return DTensor.from_local(y.transpose(0, 1), mesh, (Shard(1),), run_check=False)

        return forward
