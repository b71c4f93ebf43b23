"""turbo.sync_free_step on Megatron-Core: the gradient norm kept on the device equals Megatron's float, the
clip by a device norm scales the gradients as Megatron's clip does (with and without a turbo AdamW to hand the
factor to), neither reads anything back on a GPU, and the deferred metrics carry the SIGTERM flag. The
end-to-end trajectory (sync-free loop vs the synced one) is checked by test_train_cpu."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port

pytest.importorskip("megatron.core")


def _grads(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(5, 7), (3,), (0,), (64, 33)]
    return [torch.randn(s, generator=gen).to(device) for s in shapes]


@pytest.mark.parametrize("norm_type", [2, math.inf])
def test_device_norm_equals_megatrons_float(megatron_world, norm_type):
    from megatron.core.optimizer import clip_grads
    from primus_turbo.integrations.megatron import sync_free

    sync_free.install()
    grads = _grads("cpu")
    if norm_type == math.inf:  # Megatron's max over an empty gradient raises; ours skips it
        largest = max(g.abs().max() for g in grads if g.numel())
        assert sync_free.grad_norm_on_device(grads, norm_type).item() == largest
        grads = [g for g in grads if g.numel()]
    got = sync_free.grad_norm_on_device(grads, norm_type)
    want = clip_grads.get_grad_norm_fp32(grads, norm_type)
    assert isinstance(got, torch.Tensor) and got.shape == () and got.dtype == torch.float32
    assert isinstance(want, float)
    assert got.item() == pytest.approx(want, rel=1e-6)
    ref = (
        max(g.abs().max().item() for g in grads if g.numel())
        if norm_type == math.inf
        else math.sqrt(sum(g.double().square().sum().item() for g in grads))
    )
    assert got.item() == pytest.approx(ref, rel=1e-6)
    # other norm types: Megatron's own function (a host float)
    assert sync_free.grad_norm_on_device(grads, 1) == pytest.approx(sum(g.abs().sum().item() for g in grads))


@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clips", "no-clip"])
def test_clip_by_device_norm_scales_like_megatrons_clip(megatron_world, max_norm):
    """No turbo AdamW owns the parameters (turbo.optimizer off): one foreach multiply by min(1, factor)."""
    from megatron.core.optimizer import clip_grads
    from primus_turbo.integrations.megatron import turbo_optimizer

    turbo_optimizer.install_clip()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in _grads("cpu")]
    for p, g in zip(params, _grads("cpu", seed=1)):
        p.grad = g
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    norm = torch.stack([p.grad.norm() for p in params]).norm()
    turbo_optimizer.clip_grad_by_total_norm_fp32(params, max_norm, norm)
    clip_grads.clip_grad_by_total_norm_fp32(ref, max_norm, norm.item())
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    scaled = norm.item() > max_norm
    assert scaled == (max_norm == 0.5)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, _grads("cpu", seed=1))) == (not scaled)


def test_clip_by_device_norm_hands_the_factor_to_the_owning_turbo_adamw(megatron_world):
    from primus_turbo.integrations.megatron import turbo_optimizer

    turbo_optimizer.install_clip()
    params = [torch.nn.Parameter(torch.randn(8, 4)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.grad.clone() for p in params]
    inner = torch.optim.AdamW(params, lr=1e-3)
    turbo_optimizer.use_turbo_adamw(type("Sub", (), {"optimizer": inner})())
    norm = torch.stack([p.grad.norm() for p in params]).norm()
    turbo_optimizer.clip_grad_by_total_norm_fp32(params, 0.25, norm)
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))  # not written: the step scales
    torch.testing.assert_close(inner._next_grad_scale, (0.25 / (norm + 1e-6)).reshape(1))


def test_deferred_metrics_carry_the_stop_flag_one_step_late():
    from primus_turbo.integrations.common.metrics import DeferredMetrics

    rows, deferred = [], DeferredMetrics()
    for step, stop in ((1, 0.0), (2, 2.0), (3, 0.0)):
        deferred.queue(step, torch.tensor(1.0), torch.tensor(0.5), {}, lambda *r: rows.append(r[0]),
                       stop=torch.tensor(stop))  # fmt: skip
        assert deferred.stop_requested == (step == 3)  # step 2's flag is read when step 3 is queued
    deferred.flush(lambda *r: rows.append(r[0]))
    assert rows == [1, 2, 3] and deferred.stop_requested


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_deferred_metrics_time_the_first_step_from_its_start_marker(device):
    """The first step has no step before it: given a marker taken when it began, its time runs from there to
    its end (not to when it is read back, a step later); without one it stays None."""
    import time

    from primus_turbo.integrations.common.metrics import DeferredMetrics

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device(device)
    rows = []
    for start in (True, False):
        deferred = DeferredMetrics()
        begin = DeferredMetrics.marker(device) if start else None
        if device.type == "cuda":
            torch.cuda._sleep(20_000_000)  # ~10-20 ms of GPU time
        else:
            time.sleep(0.02)
        one = torch.ones((), device=device)
        deferred.queue(1, one, one, {}, lambda *r: rows.append(r[3]), start=begin)
        if device.type == "cpu":
            time.sleep(0.2)  # between the first step's end and its read-back: not part of its time
        deferred.queue(2, one, one, {}, lambda *r: rows.append(r[3]))
    assert 0.005 < rows[0] < 0.15 and rows[1] is None, rows


@pytest.fixture
def nccl_world():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if dist.is_initialized():
        pytest.skip("a process group is already up")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.gpu
def test_device_norm_and_clip_make_no_host_sync_on_a_gpu(nccl_world):
    """The norm (Megatron's kernels and all-reduce) and the clip's multiply queue without any blocking call
    (sync debug mode "error" raises on one); the values match an fp64 reference."""
    from megatron.core.optimizer import clip_grads
    from primus_turbo.integrations.megatron import sync_free, turbo_optimizer
    from primus_turbo.integrations.megatron.patches import _l2_norm_on_device

    clip_grads.l2_norm_impl = _l2_norm_on_device  # fix.grad_norm_no_sync, as the trainer applies it
    sync_free.install()
    grads = _grads("cuda")
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = sync_free.grad_norm_on_device([p.grad for p in params])
        turbo_optimizer.clip_grad_by_total_norm_fp32(params, 0.5, norm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = math.sqrt(sum(g.double().square().sum().item() for g in grads))
    assert norm.item() == pytest.approx(ref, rel=1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad.double(), g.double() * (0.5 / (ref + 1e-6)), rtol=1e-6, atol=0)
