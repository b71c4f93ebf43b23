"""turbo.fused_clip: TorchTitan's gradient clipping folded into the fused AdamW step (``grad_scale``).

The step must update the parameters as the stock clip + step does (bitwise when the norm is below max_norm,
within an ulp when clipping), return the same norm, leave the same clipped gradients, and apply only where
it can (fused Adam/AdamW, the trainer's own parameters, no PP/EP).
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchtitan")

import torchtitan.distributed.utils as dist_utils  # noqa: E402
from primus_turbo.integrations.torchtitan import fused_clip  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 64), torch.nn.GELU(), torch.nn.Linear(64, 40))


def _trainer(model, fused=True, max_norm=1.0):
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused, foreach=None if fused else True
    )
    return SimpleNamespace(
        model_parts=[model], optimizers=SimpleNamespace(optimizers=[opt]),
        job_config=SimpleNamespace(training=SimpleNamespace(max_norm=max_norm)),
    )  # fmt: skip


def _step(trainer, x, max_norm):
    model = trainer.model_parts[0]
    model.zero_grad(set_to_none=True)
    (model(x) ** 2).mean().backward()
    params = [p for m in trainer.model_parts for p in m.parameters()]
    norm = dist_utils.clip_grad_norm_(params, max_norm, foreach=True, pp_mesh=None, ep_enabled=False)
    trainer.optimizers.optimizers[0].step()
    return norm


@pytest.fixture(autouse=True)
def _restore():
    stock = dist_utils.clip_grad_norm_
    yield
    fused_clip.uninstall()
    dist_utils.clip_grad_norm_ = stock


@pytest.mark.parametrize("max_norm", [1e3, 0.05], ids=["below_max_norm", "clipping"])
def test_folded_clip_updates_as_the_stock_clip_then_step(max_norm):
    stock, folded = _trainer(_model(), max_norm=max_norm), _trainer(_model(), max_norm=max_norm)
    assert fused_clip.install(folded) is None
    for i in range(3):
        x = torch.randn(16, 48, generator=torch.Generator().manual_seed(i))
        fused_clip.uninstall()
        want = _step(stock, x, max_norm)
        assert fused_clip.install(folded) is None
        got = _step(folded, x, max_norm)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if max_norm > 1:
            assert want < max_norm
        else:
            assert want > max_norm  # the clip was active
        for (name, p), q in zip(folded.model_parts[0].named_parameters(), stock.model_parts[0].parameters()):
            if max_norm > 1:
                assert torch.equal(p, q), name
                assert torch.equal(p.grad, q.grad), name
            else:
                torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7, msg=name)
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=2e-6, atol=1e-9, msg=name
                )  # clipped grads kept
            assert p.grad.abs().sum() > 0


def test_it_applies_only_to_fused_adam_and_the_trainers_parameters():
    assert "fused=False" in fused_clip.install(_trainer(_model(), fused=False))
    assert "max_norm" in fused_clip.install(_trainer(_model(), max_norm=0.0))
    trainer = _trainer(_model())
    assert (
        fused_clip.install(trainer) is None and dist_utils.clip_grad_norm_ is not fused_clip._STATE["stock"]
    )
    other = _model(1)  # another caller's parameters: the stock clip (in place), no grad_scale
    (other(torch.randn(4, 48)) ** 2).sum().backward()
    before = [p.grad.clone() for p in other.parameters()]
    norm = dist_utils.clip_grad_norm_(list(other.parameters()), 1e-3, foreach=True)
    assert norm > 1e-3
    assert all((p.grad.norm() < b.norm()) for p, b in zip(other.parameters(), before))
    assert not hasattr(trainer.optimizers.optimizers[0], "grad_scale")
    fused_clip.uninstall()
    assert "stock" not in fused_clip._STATE
