"""The TURBO push pipelines' slot/offset/row-block bookkeeping, simulated on CPU.

Ranks are threads; CUDA streams and events are synchronous no-ops (program order is then a valid
stream order, so every cross-stream dependency the pipeline declares is trivially met); the
symmetric workspace is one uint8 tensor per rank that every thread can address, and
``barrier(channel)`` is a threading barrier. What this checks is what a GPU run would get wrong
silently: which slot a push lands in, the byte offsets and dtype views, uneven row blocks, the
gathered copy-out and the strided reduction. Stream overlap and the barrier kernel itself are only
exercised by the multigpu tests.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from primus_turbo.pytorch.kernels.async_tp import symm_mem_pipeline as pipe


class _FakeStream:
    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class _FakeEvent:
    def record(self, stream=None):
        pass


class _FakeHandle:
    def __init__(self, storages, rank, barriers):
        self.storages, self.rank, self.barriers = storages, rank, barriers

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        elem = torch.empty(0, dtype=dtype).element_size()
        numel = torch.Size(sizes).numel()
        raw = self.storages[rank][storage_offset * elem : (storage_offset + numel) * elem]
        return raw.view(dtype).view(sizes)

    def barrier(self, channel=0, timeout_ms=0):
        self.barriers[channel].wait(timeout=30)


def _simulate(world, per_rank_fn, monkeypatch):
    storages = [torch.full((1 << 20,), 0xFF, dtype=torch.uint8) for _ in range(world)]  # garbage-filled
    barriers = {c: threading.Barrier(world) for c in range(pipe._MAX_SPLITS + 1)}
    stream = _FakeStream()
    fake_cuda = types.SimpleNamespace(
        current_stream=lambda: stream,
        set_stream=lambda s: None,
        Event=_FakeEvent,
    )
    local = threading.local()
    monkeypatch.setattr(pipe, "_cuda", fake_cuda)
    monkeypatch.setattr(pipe, "_views", {})  # cached views of another test's fake buffers
    monkeypatch.setattr(pipe, "_event_pools", {})  # keep fake events out of the real pool
    monkeypatch.setattr(pipe, "_side_stream", lambda device: stream)

    def workspace(group_name, nbytes, device):
        assert nbytes <= storages[0].numel(), "simulated workspace too small"
        return _FakeHandle(storages, local.rank, barriers)

    monkeypatch.setattr(pipe, "_workspace", workspace)
    results, errors = [None] * world, []

    def run(rank):
        local.rank = rank
        try:
            results[rank] = per_rank_fn(rank)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)
            for b in barriers.values():
                b.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("world,rows,splits,rowwise", [(2, 7, 3, True), (2, 8, 1, False), (3, 5, 2, True)])
def test_all_gather_pipeline_sim(monkeypatch, world, rows, splits, rowwise):
    gen = torch.Generator().manual_seed(rows * 31 + world)
    shards = [torch.randn(rows, 24, generator=gen).to(torch.bfloat16) for _ in range(world)]
    scales = [torch.rand(rows, 1, generator=gen) + 0.5 for _ in range(world)]
    b = torch.randn(24, 16, generator=gen).to(torch.bfloat16)

    def rank_fn(rank):
        out = torch.full((world * rows, 16), float("nan"))
        seen = torch.zeros(world * rows, dtype=torch.int32)
        tensors = [shards[rank], scales[rank]] if rowwise else [shards[rank]]

        def consume(block, row0):
            n = block[0].shape[0]
            y = block[0].float() @ b.float()
            out[row0 : row0 + n] = y * block[1] if rowwise else y
            seen[row0 : row0 + n] += 1

        gathered = [torch.empty(world * rows, 24, dtype=torch.bfloat16)]
        if rowwise:
            gathered.append(torch.empty(world * rows, 1))
        pipe.pipelined_all_gather_consume(tensors, consume, gathered, "sim", world, rank, splits)
        return out, seen, gathered

    full_a = torch.cat(shards)
    full_s = torch.cat(scales)
    want = full_a.float() @ b.float()
    if rowwise:
        want = want * full_s
    for rank, (out, seen, gathered) in enumerate(run_all := _simulate(world, rank_fn, monkeypatch)):
        assert torch.equal(seen, torch.ones_like(seen)), f"rank {rank}: every row consumed exactly once"
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(gathered[0], full_a)
        if rowwise:
            assert torch.equal(gathered[1], full_s)
    assert len(run_all) == world


@pytest.mark.parametrize(
    "world,m,splits,reduce_op,fused",
    [
        (2, 5, 2, "sum", False),
        (2, 4, 1, "avg", False),
        (4, 3, 3, "sum", False),
        (2, 5, 3, "avg", True),
        (2, 6, 1, "sum", True),
        (3, 4, 2, "avg", True),
        (4, 3, 3, "sum", True),
    ],
)
def test_reduce_scatter_pipeline_sim(monkeypatch, world, m, splits, reduce_op, fused):
    gen = torch.Generator().manual_seed(m * 17 + world)
    a = [torch.randn(world * m, 12, generator=gen) for _ in range(world)]
    b = [torch.randn(12, 20, generator=gen) for _ in range(world)]

    def rank_fn(rank):
        produced = torch.zeros(world * m, dtype=torch.int32)

        def produce(r0, r1, dst):
            dst.copy_(a[rank][r0:r1] @ b[rank])
            produced[r0:r1] += 1

        def accumulate(r0, r1, c, alpha, beta, dst):  # what torch.addmm(c, a, b, beta, alpha) computes
            dst.copy_(alpha * (a[rank][r0:r1] @ b[rank]) + beta * c)
            produced[r0:r1] += 1

        out = torch.empty(m, 20)
        pipe.pipelined_produce_reduce_scatter(
            produce, out, reduce_op, "sim", world, rank, splits, accumulate if fused else None
        )
        return out, produced

    total = sum(x @ y for x, y in zip(a, b))
    if reduce_op == "avg":
        total = total / world
    for rank, (out, produced) in enumerate(_simulate(world, rank_fn, monkeypatch)):
        assert torch.equal(produced, torch.ones_like(produced)), f"rank {rank}: every row produced once"
        torch.testing.assert_close(out, total[rank * m : (rank + 1) * m], rtol=1e-5, atol=1e-5)
