"""Rank-consistent measured backend choice (core/collective_choice.py) on 2 gloo processes.

Fake backends sleep for a rank-dependent time, so the per-rank fastest differs from the group's: the
choice must follow the slowest rank, skip a backend one rank cannot run, and keep the baseline unless
another backend beats it by the margin.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.collective_choice import can_measure, measured_choice


def _backend(ms_by_rank: tuple[float, float], ranks_that_handle=(0, 1)):
    class _Fake(KernelBackend):
        @staticmethod
        def can_handle(**kw) -> bool:
            return dist.get_rank() in ranks_that_handle

        @staticmethod
        def execute(**kw):
            time.sleep(ms_by_rank[dist.get_rank()] / 1e3)

    return _Fake


def _hiccup_backend(slow_calls: int, slow_ms: float, fast_ms: float):
    """Slow for its first ``slow_calls`` runs (a host hiccup during one timing round), fast after."""
    calls = [0]

    class _Fake(KernelBackend):
        @staticmethod
        def can_handle(**kw) -> bool:
            return True

        @staticmethod
        def execute(**kw):
            calls[0] += 1
            time.sleep((slow_ms if calls[0] <= slow_calls else fast_ms) / 1e3)

    return _Fake


def _dispatcher(backends):
    class _D(AutoKernelDispatcher):
        op_name = "fake_collective"
        autotune_warmup, autotune_iters = 1, 3

    _D.backends = backends
    return _D


def _body(rank, world, device):
    x = {"x": torch.ones(4)}
    # per rank TURBO is fastest on rank 0 only; the group's time is the slowest rank's: SYMM_MEM wins
    d = _dispatcher({
        BackendType.NCCL: _backend((30.0, 30.0)),
        BackendType.SYMM_MEM: _backend((10.0, 10.0)),
        BackendType.TURBO: _backend((1.0, 40.0)),
    })  # fmt: skip
    best, times = measured_choice(d, dist.group.WORLD, BackendType.NCCL, x)
    assert best is BackendType.SYMM_MEM, times
    assert times[BackendType.TURBO] >= 35.0, times  # rank 1's time, on every rank
    # a backend only rank 0 can run is never tried (rank 1 would not join its collectives)
    d = _dispatcher({BackendType.NCCL: _backend((20.0, 20.0)), BackendType.TURBO: _backend((1.0, 1.0), (0,))})
    best, times = measured_choice(d, dist.group.WORLD, BackendType.NCCL, x)
    assert best is BackendType.NCCL and BackendType.TURBO not in times, times
    # within the margin the baseline (unfused) stays
    d = _dispatcher({BackendType.NCCL: _backend((20.0, 20.0)), BackendType.TURBO: _backend((19.9, 19.9))})
    best, _ = measured_choice(d, dist.group.WORLD, BackendType.NCCL, x, margin=0.2)
    assert best is BackendType.NCCL
    # the baseline must run everywhere: a clear error, not a hang
    d = _dispatcher({BackendType.NCCL: _backend((1.0, 1.0), (1,)), BackendType.TURBO: _backend((1.0, 1.0))})
    with pytest.raises(ValueError, match="baseline backend NCCL cannot run on every rank"):
        measured_choice(d, dist.group.WORLD, BackendType.NCCL, x)
    # one hiccup round does not decide: each candidate's fastest of the interleaved rounds counts
    # (warmup 1 + iters 3 = the 4 calls of round 1 are slow; a single round keeps the baseline)
    for rounds, want in ((1, BackendType.NCCL), (3, BackendType.TURBO)):
        hiccup = _hiccup_backend(4, 40.0, 5.0)
        d = _dispatcher({BackendType.NCCL: _backend((20.0, 20.0)), BackendType.TURBO: hiccup})
        best, times = measured_choice(d, dist.group.WORLD, BackendType.NCCL, x, rounds=rounds)
        assert best is want, (rounds, times)
    # CPU tensors: the dispatchers never measure (their heuristic decides)
    assert not can_measure(dist.group.WORLD, x)


def test_measured_choice_is_rank_consistent():
    run_distributed(_body, world_size=2, backend="gloo")
