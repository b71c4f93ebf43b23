"""turbo.sync_free_step (TorchTitan): micro-batches staged to the GPU without blocking, metrics read back one
step late behind CUDA events (``integrations/torchtitan/sync_free.py``).

TorchTitan's ``train_step`` counts valid tokens on the CPU batch, then calls ``.to(device)`` per micro-batch
(a blocking copy that drains the GPU queue). A ``_StagedBatch`` answers that ``.to`` with the copy queued at
batch time; everything else it does is what the CPU tensor does, returning plain tensors.
"""

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("hydra")

from omegaconf import OmegaConf  # noqa: E402
from primus_turbo.integrations.common.metrics import DeferredMetrics  # noqa: E402
from primus_turbo.integrations.torchtitan import sync_free as sf  # noqa: E402


def _staged(values: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    staged = values.as_subclass(sf._StagedBatch)
    staged._turbo_staged = copy
    return staged


def test_staged_batch_to_its_device_returns_the_queued_copy_and_ops_act_on_the_cpu_values():
    labels = torch.randint(-100, 50, (2, 7), generator=torch.Generator().manual_seed(0))
    copy = torch.empty(2, 7, device="meta")
    staged = _staged(labels, copy)
    assert staged.to("meta") is copy and staged.to(torch.device("meta")) is copy
    assert staged.to(device="meta") is copy
    valid = (staged != -100).sum()  # TorchTitan's valid-token count, on the CPU values
    assert type(valid) is torch.Tensor and valid.item() == int((labels != -100).sum())
    as_float = staged.to(torch.float32)  # any other conversion: the CPU values, a plain tensor
    assert type(as_float) is torch.Tensor and torch.equal(as_float, labels.float())
    assert staged.to("meta", non_blocking=True) is not copy  # not the one-argument form: a real .to
    assert torch.equal(staged.to("cpu"), labels)


def test_unstaged_batch_tensor_copies_as_usual():
    plain = torch.arange(4).as_subclass(sf._StagedBatch)
    assert torch.equal(plain.to("cpu"), torch.arange(4)) and plain.to("meta").device.type == "meta"


def _cfg(enabled=True, sync_free=True):
    return OmegaConf.create({"turbo": {"enabled": enabled, "sync_free_step": sync_free}})


class _Base:
    def batch_generator(self, data_iterable):
        yield from data_iterable


@pytest.mark.parametrize("enabled,sync_free", [(False, True), (True, False)])
def test_stock_trainer_when_turbo_or_the_flag_is_off(enabled, sync_free):
    assert sf.trainer_class(_cfg(enabled, sync_free), _Base, print) is _Base


def test_deferred_metrics_on_cpu_record_each_step_one_step_late():
    rows = []
    deferred = DeferredMetrics()
    for step in (1, 2, 3):
        deferred.queue(
            step, torch.tensor(float(step)), torch.tensor(2.0 * step), {"lr": step}, lambda *r: rows.append(r)
        )
        assert len(rows) == step - 1
    deferred.flush(lambda *r: rows.append(r))
    assert [r[:3] for r in rows] == [(1, 1.0, 2.0), (2, 2.0, 4.0), (3, 3.0, 6.0)] and rows[0][3] is None
    assert all(r[3] >= 0 for r in rows[1:]) and [r[4]["lr"] for r in rows] == [1, 2, 3]


@pytest.mark.gpu
def test_staged_micro_batches_reach_the_gpu_without_a_host_sync():
    """The subclass's batches: inputs and labels staged; train_step's .to(device) returns the queued copies
    (equal to the CPU values) without a synchronizing call."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    cls = sf.trainer_class(_cfg(), _Base, print)
    assert cls is not _Base
    trainer = cls.__new__(cls)
    trainer.device = device
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, 1000, (2, 65), generator=gen) for _ in range(3)]
    batches = [({"input": t[:, :-1].contiguous()}, t[:, 1:].contiguous()) for t in tokens]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        staged = list(trainer.batch_generator(batches))
        on_gpu = [(inputs["input"].to(device), labels.to(device)) for inputs, labels in staged]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for (inputs, labels), (x, y) in zip(batches, on_gpu):
        assert x.is_cuda and y.is_cuda
        assert torch.equal(x.cpu(), inputs["input"]) and torch.equal(y.cpu(), labels)


@pytest.mark.gpu
def test_deferred_metrics_log_each_step_one_step_late_with_gpu_timed_steps():
    """queue() of step n records step n - 1 (its values, and the GPU time between the two end events, here at
    least the ~20 ms each step sleeps on the GPU), flush() the last one; queue() itself never syncs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    rows = []
    deferred = DeferredMetrics()
    record = lambda *row: rows.append(row)  # noqa: E731
    for step in range(1, 4):
        torch.cuda._sleep(20_000_000)  # ~10-20 ms of GPU time, whatever the clock
        loss = torch.full((), float(step), device="cuda")
        norm = torch.full((), 10.0 * step, device="cuda")
        deferred.queue(step, loss, norm, {"lr": 0.1}, record)
        assert len(rows) == step - 1  # the step queued before, not this one
    deferred.flush(record)
    assert [r[:3] for r in rows] == [(1, 1.0, 10.0), (2, 2.0, 20.0), (3, 3.0, 30.0)]
    assert rows[0][3] is None and all(r[3] > 0.005 for r in rows[1:]), rows
    assert all(r[4] == {"lr": 0.1} for r in rows)


def test_turbo_adamw_swap_takes_over_the_step_an_lr_scheduler_wrapped_before():
    """TorchTitan builds its LR schedulers (which wrap optimizer.step on the instance) before the swap: the
    swapped optimizer must still step through turbo.optim.AdamW, consuming the grad scale set for it."""
    import warnings
    from types import SimpleNamespace

    from primus_turbo.pytorch.optim import AdamW as TurboAdamW

    params = [torch.nn.Parameter(torch.randn(4, 3))]
    opt = torch.optim.AdamW(params, lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    assert sf.use_turbo_adamw(SimpleNamespace(optimizers=[opt])) == 1 and isinstance(opt, TurboAdamW)
    params[0].grad = torch.ones(4, 3)
    opt.set_next_grad_scale(torch.tensor(0.5))
    opt.step()
    assert opt._next_grad_scale is None and float(opt.state[params[0]]["step"]) == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would be raised here
        sched.step()
