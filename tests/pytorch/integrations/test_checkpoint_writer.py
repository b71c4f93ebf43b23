"""Checkpoints are written by several DCP writer threads per rank (DCP's default is one): the thread count
rule, and a 2-rank save of several files per rank that loads back exactly, shared keys included."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_distributed
from primus_turbo.integrations.common import checkpoint as ckpt


@pytest.mark.parametrize(
    "cpus, local_ranks, expected",
    [(2, 2, 2), (16, 1, 8), (16, 8, 2), (128, 8, 8), (48, 4, 8), (24, 4, 6), (1, 1, 2), (4, 0, 4)],
)
def test_writer_threads_share_the_cores_between_2_and_8(cpus, local_ranks, expected):
    assert ckpt.writer_threads(cpus, local_ranks) == expected


def test_writer_threads_reads_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ckpt.writer_threads(cpu_count=24) == 6


def _body_round_trip(rank, world, device, ckpt_dir):
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # 8 threads on any host: several files per rank
    gen = torch.Generator().manual_seed(100 + rank)
    tensors = {f"w{i}": torch.randn(257, 33 + i, generator=gen) for i in range(12)}
    shared = {"replicated.step": torch.tensor(float(7))}
    objects = {"step": 3, "rank": rank}
    path = ckpt.save_checkpoint(ckpt_dir, 3, tensors, objects, shared=shared)
    files = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert len(files) > world, files  # more than one file per rank
    assert ckpt.latest_step(ckpt_dir) == 3
    assert ckpt.dir_gb(path) * 1e9 >= world * sum(t.numel() * 4 for t in tensors.values())  # all ranks
    loaded = {k: torch.zeros_like(v) for k, v in tensors.items()}
    loaded_shared = {"replicated.step": torch.tensor(0.0)}
    got = ckpt.load_checkpoint(ckpt_dir, 3, loaded, {"step": None, "rank": None}, shared=loaded_shared)
    assert got == objects
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert loaded_shared["replicated.step"].item() == 7.0


def test_checkpoint_with_several_writer_files_per_rank_loads_back(tmp_path):
    run_distributed(_body_round_trip, world_size=2, args=(str(tmp_path),))
