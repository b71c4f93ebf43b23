"""Megatron trainer checkpoints keyed by parameter name, so a run resumes with other turbo flags.

Turbo on and off build the same parameters under two module layouts: the turbo experts (TEGroupedMLP) hold
``experts.linear_fc1.weight<i>`` where the stock SequentialMLP holds ``experts.local_experts.<i>.linear_fc1
.weight`` (same shape, same [gate; up] rows), and DDP puts the stock experts of an ep=1 run in the dense
gradient buffer (in SequentialMLP's order) but the turbo ones in the expert buffer. A checkpoint keyed by
module path and optimizer index (format 1) therefore loaded only into the layout that wrote it. Format 2:

  rank<r>.tensors.model.<name>      this rank's model state-dict tensors (its TP / EP shards), expert weights
                                    under SequentialMLP's names
  dp<k>.<name>.<state>@<start>      a distributed-optimizer shard (exp_avg, exp_avg_sq and, for 16-bit
                                    parameters, main_param: the fp32 master) of the flattened parameter from
                                    element <start>; k: the first global rank of the data-parallel group the
                                    optimizer shards it over. A resume whose buffers cut the parameter
                                    elsewhere reads the overlapping shards.
  dp<k>.<name>.step                 Adam's step counter
  rank<r>.objects                   scheduler, CPU RNG, step, world size, format

What cannot load (another model, parallel layout or world size) stops the resume with the names that differ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from primus_turbo.integrations.common import checkpoint as ckpt
from primus_turbo.integrations.megatron.turbo_optimizer import sub_optimizers

FORMAT = 2
_GROUPED = re.compile(r"^(.*\.mlp\.experts)\.linear_fc([12])\.weight(\d+)$")
_PIECE = re.compile(r"^(dp\d+\..+)\.(exp_avg|exp_avg_sq|main_param)@(\d+)$")


class CheckpointMismatch(RuntimeError):
    """The checkpoint cannot serve this run (model, layout or world size differ)."""


def canonical_name(name: str) -> str:
    """The checkpoint name of a parameter: TEGroupedMLP's ``weight<i>`` as SequentialMLP's local expert i."""
    return _GROUPED.sub(r"\1.local_experts.\3.linear_fc\2.weight", name)


@dataclass
class _Shard:
    """This rank's distributed-optimizer shard of one parameter."""

    key: str  # dp<k>.<canonical name>
    start: int  # first element of the flattened parameter held here
    state: dict  # the inner optimizer's state of the shard (exp_avg, exp_avg_sq, step)
    master: torch.Tensor | None  # the fp32 master shard of a 16-bit parameter, else None (the param is it)

    def tensors(self) -> dict:
        out = {"exp_avg": self.state["exp_avg"], "exp_avg_sq": self.state["exp_avg_sq"]}
        if self.master is not None:
            out["main_param"] = self.master
        return out


def _shards(run) -> list[_Shard]:
    names = {p: canonical_name(n) for n, p in run.model.module.named_parameters()}
    shards = []
    for sub in sub_optimizers(run.optimizer):
        first = min(dist.get_process_group_ranks(sub.data_parallel_group))
        pairs = ((sub.model_fp32_groups, sub.shard_fp32_groups, False),
                 (sub.model_float16_groups, sub.shard_fp32_from_float16_groups, True))  # fmt: skip
        for model_groups, main_groups, is_master in pairs:
            for model_group, main_group in zip(model_groups, main_groups, strict=True):
                for param, main in zip(model_group, main_group, strict=True):
                    start = sub._get_model_param_range_map(param)["param"].start
                    state = sub.optimizer.state[main]
                    shards.append(
                        _Shard(f"dp{first}.{names[param]}", start, state, main if is_master else None)
                    )
    return shards


def _model_tensors(run) -> dict[str, torch.Tensor]:
    """canonical name -> this rank's state-dict tensor (the parameter's storage: DCP loads in place)."""
    state = run.model.module.state_dict()
    return {canonical_name(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def save(run, step: int, init_optimizer_state) -> str:
    init_optimizer_state(run)  # every shard has its state (a parameter no step touched: zero moments)
    tensors = {f"model.{k}": v for k, v in _model_tensors(run).items()}
    shared = {}
    for s in _shards(run):
        for name, t in s.tensors().items():
            shared[f"{s.key}.{name}@{s.start}"] = t
        shared[f"{s.key}.step"] = s.state["step"]
    objects = {"format": FORMAT, "step": step, "world_size": dist.get_world_size(),
               "scheduler": run.scheduler.state_dict(), "rng_cpu": torch.get_rng_state()}  # fmt: skip
    return ckpt.save_checkpoint(run.cfg.train.ckpt_dir, step, tensors, objects, shared=shared)


def saved_format(path: str, metadata: dict) -> int:
    rank = dist.get_rank()
    ranks = {int(m.group(1)) for k in metadata if (m := re.match(r"rank(\d+)\.", k))}
    if ranks != set(range(dist.get_world_size())):  # every rank stops (none waits in DCP's collectives)
        raise CheckpointMismatch(
            f"cannot resume from {path}: it holds ranks 0..{max(ranks, default=-1)} (world size "
            f"{len(ranks)}), this run has world size {dist.get_world_size()}. A resume needs the world size "
            "and parallel layout of the run that saved it."
        )
    return FORMAT if f"rank{rank}.objects.format" in metadata else 1


def _listing(names) -> str:
    names = sorted(names)
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more


def agree(problem: str | None, device) -> None:
    """Collective: raise CheckpointMismatch on every rank when any rank has a ``problem`` (a rank alone
    raising would leave the others waiting in DCP's collectives)."""
    flag = torch.tensor([0.0 if problem is None else float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if problem is not None:
        raise CheckpointMismatch(problem)
    if flag.item():
        raise CheckpointMismatch(
            f"rank {int(flag.item()) - 1} cannot load the checkpoint (its message above)"
        )


def model_tensor_problem(path: str, metadata: dict, prefix: str, mine: dict[str, torch.Tensor]) -> str | None:
    """The tensors the checkpoint lacks, adds, or holds in another shape, as one message (None: all match)."""
    saved = {
        k[len(prefix) :]: md.size
        for k, md in metadata.items()
        if k.startswith(prefix) and hasattr(md, "size")
    }
    missing, extra = mine.keys() - saved.keys(), saved.keys() - mine.keys()
    shapes = [f"{k} {tuple(saved[k])} vs {tuple(mine[k].shape)}" for k in mine.keys() & saved.keys()
              if tuple(saved[k]) != tuple(mine[k].shape)]  # fmt: skip
    problems = []
    if missing:
        problems.append(f"this model has {len(missing)} tensor(s) the checkpoint lacks: {_listing(missing)}")
    if extra:
        problems.append(f"the checkpoint has {len(extra)} tensor(s) this model lacks: {_listing(extra)}")
    if shapes:
        problems.append(f"{len(shapes)} tensor(s) differ in shape (saved vs here): {_listing(shapes)}")
    if not problems:
        return None
    return (
        f"cannot resume from {path} on rank {dist.get_rank()}: "
        + "; ".join(problems)
        + ". The model config and parallel layout must match the run that saved it."
    )


def _saved_pieces(metadata: dict) -> dict[tuple[str, str], list[tuple[int, int]]]:
    pieces: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for key, md in metadata.items():
        m = _PIECE.match(key)
        if m:
            pieces.setdefault((m.group(1), m.group(2)), []).append((int(m.group(3)), md.size.numel()))
    return pieces


def load(run, step: int, metadata: dict, init_optimizer_state) -> dict:
    """Load a format-2 checkpoint into ``run`` (model, optimizer shards); returns its objects."""
    path = ckpt.step_dir(run.cfg.train.ckpt_dir, step)
    model = _model_tensors(run)
    agree(model_tensor_problem(path, metadata, f"rank{dist.get_rank()}.tensors.model.", model), run.device)
    init_optimizer_state(run)  # the live state tensors are the load targets
    pieces = _saved_pieces(metadata)
    shared, copies, missing = {}, [], []
    for s in _shards(run):
        for name, live in s.tensors().items():
            lo, hi = s.start, s.start + live.numel()
            saved = pieces.get((s.key, name), [])
            if (lo, hi - lo) in saved:  # the same cut as the saving run: straight into the state
                shared[f"{s.key}.{name}@{lo}"] = live
                continue
            covered = 0
            for start, size in saved:  # another cut: read the overlapping saved shards, copy the overlap
                a, b = max(lo, start), min(hi, start + size)
                if a < b:
                    key = f"{s.key}.{name}@{start}"
                    if key not in shared:
                        shared[key] = torch.empty(size, dtype=live.dtype, device=live.device)
                    buf = shared[key]
                    copies.append((buf[a - start : b - start], live[a - lo : b - lo]))
                    covered += b - a
            if covered != hi - lo:
                missing.append(f"{s.key}.{name}")
        if f"{s.key}.step" in metadata:
            shared[f"{s.key}.step"] = s.state["step"]
        else:
            missing.append(f"{s.key}.step")
    problem = None
    if missing:
        problem = (
            f"cannot resume from {path} on rank {dist.get_rank()}: no optimizer state for "
            f"{_listing(missing)} (dp<k>: the data-parallel group of the optimizer that holds it). The "
            "parallel layout and train.dtype must match the run that saved it."
        )
    agree(problem, run.device)
    tensors = {f"model.{k}": v for k, v in model.items()}
    objects = {"format": 0, "step": 0, "world_size": 0, "scheduler": run.scheduler.state_dict(),
               "rng_cpu": torch.get_rng_state()}  # fmt: skip
    objects = ckpt.load_checkpoint(run.cfg.train.ckpt_dir, step, tensors, objects, shared=shared)
    with torch.no_grad():
        for src, dst in copies:
            dst.copy_(src)
    for sub in sub_optimizers(run.optimizer):  # step counters where each optimizer keeps them (device, dtype)
        sub.optimizer.load_state_dict(sub.optimizer.state_dict())
    return objects


def read_metadata(path: str) -> dict:
    try:
        return dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as err:
        raise CheckpointMismatch(f"cannot read the checkpoint metadata of {path}: {err}") from err
