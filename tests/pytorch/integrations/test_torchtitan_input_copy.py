"""turbo.input_copy (TorchTitan): micro-batches pinned and queued to the GPU without blocking.

TorchTitan's ``train_step`` counts valid tokens on the CPU batch, then calls ``.to(device)`` per micro-batch
(a blocking copy that drains the GPU queue). A ``_StagedBatch`` answers that ``.to`` with the copy queued at
batch time; everything else it does is what the CPU tensor does, returning plain tensors.
"""

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("hydra")

from omegaconf import OmegaConf  # noqa: E402
from primus_turbo.integrations.torchtitan import trainer as tt  # noqa: E402


def _staged(values: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    staged = values.as_subclass(tt._StagedBatch)
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
    plain = torch.arange(4).as_subclass(tt._StagedBatch)
    assert torch.equal(plain.to("cpu"), torch.arange(4)) and plain.to("meta").device.type == "meta"


def _cfg(enabled=True, input_copy=True):
    return OmegaConf.create({"turbo": {"enabled": enabled, "input_copy": input_copy}})


class _Base:
    def batch_generator(self, data_iterable):
        yield from data_iterable


@pytest.mark.parametrize("enabled,input_copy", [(False, True), (True, False)])
def test_stock_trainer_when_turbo_or_input_copy_is_off(enabled, input_copy):
    assert tt._trainer_class(_cfg(enabled, input_copy), _Base) is _Base


def test_no_gpu_keeps_the_stock_trainer_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tt._trainer_class(_cfg(), _Base) is _Base
    assert "turbo.input_copy: n/a (no GPU" in capsys.readouterr().out


@pytest.mark.gpu
def test_staged_micro_batches_reach_the_gpu_without_a_host_sync():
    """The subclass's batches: inputs and labels staged; train_step's .to(device) returns the queued copies
    (equal to the CPU values) without a synchronizing call."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    cls = tt._trainer_class(_cfg(), _Base)
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
