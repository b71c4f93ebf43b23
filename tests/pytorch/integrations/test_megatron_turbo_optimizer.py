"""turbo.optimizer on Megatron-Core: the clip factor goes to turbo.optim.AdamW, the gradients stay unscaled.
Training with the swap: test_train_cpu.py, test_megatron_trains_the_same_trajectory_with_turbo_adamw."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

pytest.importorskip("megatron.core")

from primus_turbo.integrations.megatron import turbo_optimizer  # noqa: E402

from primus_turbo.pytorch.optim import AdamW  # noqa: E402

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture
def stock_clip(monkeypatch):
    """Megatron's clip stands in as a recorder (its real body asserts CUDA gradients)."""
    calls = []
    monkeypatch.setattr(turbo_optimizer, "_STOCK_CLIP", lambda *args: calls.append(args))
    monkeypatch.setattr(turbo_optimizer, "_ADOPTED", [])
    return calls


def _params(device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((33, 7), (9,))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    return params


@pytest.mark.parametrize("norm_on_device", [False, True])
def test_clip_factor_goes_to_the_owning_optimizer_step(stock_clip, norm_on_device, device):
    import weakref

    ours, ref = _params(device), _params(device)
    opt = AdamW.adopt(torch.optim.AdamW(ours, **KW))
    turbo_optimizer._ADOPTED.append(weakref.ref(opt))
    grads = [p.grad.clone() for p in ours]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    total = norm if norm_on_device else float(norm)
    turbo_optimizer.clip_grad_by_total_norm_fp32(ours, 0.5, total)
    assert not stock_clip and all(torch.equal(p.grad, g) for p, g in zip(ours, grads))  # not written
    opt.step()
    ref_opt = torch.optim.AdamW(ref, foreach=False, **KW)
    for q in ref:
        q.grad.mul_(0.5 / (float(norm) + 1e-6))
    ref_opt.step()
    for p, q in zip(ours, ref):
        assert_close(p, q, torch.float32)
        # the moments carry the factor (Adam's first update barely depends on the gradient's scale)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], ref_opt.state[q][key], torch.float32)


def test_clip_below_the_limit_or_without_an_owner_is_megatrons(stock_clip, device):
    import weakref

    ours = _params(device)
    opt = AdamW.adopt(torch.optim.AdamW(ours[:1], **KW))
    turbo_optimizer._ADOPTED.append(weakref.ref(opt))
    turbo_optimizer.clip_grad_by_total_norm_fp32(ours[:1], 1.0, 0.5)  # norm under max_norm: no factor
    assert opt._next_grad_scale is None and not stock_clip
    turbo_optimizer.clip_grad_by_total_norm_fp32(ours, 1.0, 5.0)  # one parameter not this optimizer's
    turbo_optimizer.clip_grad_by_total_norm_fp32(ours[:1], 1.0, 5.0, True)  # decoupled gradients
    assert [len(call[0]) for call in stock_clip] == [2, 1] and opt._next_grad_scale is None


@pytest.mark.parametrize("norm_on_device", [False, True])
def test_nan_norm_clips_nothing_as_megatron(stock_clip, norm_on_device, device):
    """Stock Megatron clips only when max_norm / norm < 1, which a NaN norm is not: the finite gradients stay
    as they are. The turbo factor was NaN and went to every parameter (audit, session 35)."""
    import weakref

    ours = _params(device)
    opt = AdamW.adopt(torch.optim.AdamW(ours, **KW))
    turbo_optimizer._ADOPTED.append(weakref.ref(opt))
    nan = torch.tensor(float("nan"), device=device)
    turbo_optimizer.clip_grad_by_total_norm_fp32(ours, 1.0, nan if norm_on_device else float("nan"))
    scale = opt._next_grad_scale
    assert scale is None or torch.equal(scale.cpu(), torch.ones(1))
    turbo_optimizer._ADOPTED.clear()  # no owner: the device factor multiplies the gradients in place
    grads = [p.grad.clone() for p in ours]
    if norm_on_device:
        turbo_optimizer.clip_grad_by_total_norm_fp32(ours, 1.0, nan)
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))
