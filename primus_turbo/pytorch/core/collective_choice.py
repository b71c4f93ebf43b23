"""Measured backend choice for collective ops, the same on every rank of the group.

A per-rank autotune of a collective could pick different backends on different ranks, and ranks that
run different collectives deadlock. Here every rank times the same candidates in the same order, the
candidate set is the intersection over ranks and the times are the slowest rank's (a collective is as
fast as its slowest participant), so the argmin is identical everywhere. The baseline backend (the
unfused path) wins unless another is faster by ``margin``: the measured choice is never slower than
the baseline beyond timing noise.

Each candidate is timed in ``rounds`` interleaved rounds and its fastest round counts: a host hiccup
during one round (2x H200, session 13: host time per call varied 2-4x between machines, and a single
timing once kept TURBO at 0.90x unfused) then cannot decide the choice.

Cost: once per dispatcher key (the dispatcher memoizes the answer), ``rounds x (warmup + iters)`` runs of
each candidate plus two small all-reduces. Never under CUDA-graph capture or while dynamo traces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from primus_turbo.env import parse_bool_env
from primus_turbo.pytorch.core.backend import BackendType


def measuring_enabled(env: str) -> bool:
    """False when the user set ``env`` to 0/false/off/no, any case (then the dispatcher's heuristic decides);
    unset or empty: True; another value is an error naming ``env`` (``OFF`` used to keep measuring)."""
    return parse_bool_env(env, default=True)


def can_measure(group: Any, kwargs: dict[str, Any]) -> bool:
    if group is None or dist.get_world_size(group) < 2 or torch.compiler.is_compiling():
        return False
    if not any(isinstance(v, torch.Tensor) and v.is_cuda for v in kwargs.values()):
        return False
    return not torch.cuda.is_current_stream_capturing()


def measured_choice(
    dispatcher: Any,
    group: Any,
    baseline: BackendType,
    kwargs: dict[str, Any],
    margin: float = 0.03,
    rounds: int = 3,
) -> tuple[BackendType, dict[BackendType, float]]:
    """(chosen backend, {backend: slowest-rank ms}); candidates are ``dispatcher.backends`` in order."""
    order = list(dispatcher.backends)
    local = [1 if dispatcher.backends[b].can_handle(**kwargs) else 0 for b in order]
    on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in kwargs.values())
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    ok = torch.tensor(local, dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    usable = [b for b, flag in zip(order, ok.tolist()) if flag]
    if baseline not in usable:
        raise ValueError(f"{dispatcher.op_name}: baseline backend {baseline.name} cannot run on every rank")
    local_ms = [float("inf")] * len(order)
    for _ in range(max(1, rounds)):  # interleaved: every candidate sees each round's host conditions
        for i, backend in enumerate(order):
            if backend in usable:
                impl = dispatcher.backends[backend]
                ms = dispatcher._time(lambda impl=impl: impl.execute(**kwargs), on_cuda)
                local_ms[i] = min(local_ms[i], ms)
    times = torch.tensor(local_ms, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    measured = {b: t for b, t in zip(order, times.tolist()) if b in usable}
    best = min(measured, key=measured.get)
    if measured[best] > measured[baseline] * (1.0 - margin):
        best = baseline
    return best, measured
