"""turbo.optim.AdamW's step plan: once a whole group has stepped through the kernel, later steps reuse its
launches (no per-parameter set-up) while everything they were built from holds, and rebuild it when anything
changes. Each case runs against torch's AdamW given the same gradients and the same change, several steps."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

from primus_turbo.pytorch.optim import AdamW

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = [(37, 19), (5,), (3, 4, 8), (0,)]


def _setup(device):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    # gradients as Megatron hands them over: fresh views of one persistent buffer, same addresses every step
    numel = sum(p.numel() for p in ours)
    return ours, ref, torch.empty(numel, device=device), torch.empty(numel, device=device)


def _set_grads(ours, ref, buffer, ref_buffer, step):
    gen = torch.Generator().manual_seed(100 + step)
    buffer.copy_(torch.randn(buffer.numel(), generator=gen).to(buffer.device))
    ref_buffer.copy_(buffer)
    start = 0
    for p, q in zip(ours, ref):
        p.grad = buffer[start : start + p.numel()].view(p.shape)
        q.grad = ref_buffer[start : start + p.numel()].view(p.shape)
        start += p.numel()


def _counting(opt, monkeypatch):
    built = []
    plan = opt._plan
    monkeypatch.setattr(opt, "_plan", lambda *a: built.append(1) or plan(*a))
    return built


def _check(ours, ref, opt, ref_opt):
    for p, q in zip(ours, ref):
        assert_close(p, q, torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], ref_opt.state[q][key], torch.float32)
        assert float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])


def test_steady_state_reuses_one_plan(device, monkeypatch):
    ours, ref, buffer, ref_buffer = _setup(device)
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    built = _counting(opt, monkeypatch)
    for step in range(5):
        _set_grads(ours, ref, buffer, ref_buffer, step)
        scale = torch.tensor([0.5 + 0.1 * step], device=device)
        opt.step(grad_scale=scale)
        for q in ref:
            q.grad.mul_(scale)
        ref_opt.step()
    assert len(built) == 1 and opt.turbo_steps == 5 * len(ours)
    _check(ours, ref, opt, ref_opt)
    # the step counters are views of one tensor while stepping; state_dict hands out their own tensors
    assert opt.state[ours[0]]["step"]._base is not None
    assert all(s["step"]._base is None for s in opt.state_dict()["state"].values())


def _new_grad_memory(opt, ours, ref, ref_opt):
    ours[1].grad = ours[1].grad.clone()  # the same values at another address


def _load_state_dict(opt, ours, ref, ref_opt):
    opt.load_state_dict(opt.state_dict())


def _step_counter_written(opt, ours, ref, ref_opt):
    opt.state[ours[2]]["step"].fill_(1.0)  # in place, as a checkpoint load may write it
    ref_opt.state[ref[2]]["step"].fill_(1.0)


def _moment_replaced(opt, ours, ref, ref_opt):
    opt.state[ours[0]]["exp_avg"] = opt.state[ours[0]]["exp_avg"] * 0.5
    ref_opt.state[ref[0]]["exp_avg"] = ref_opt.state[ref[0]]["exp_avg"] * 0.5


def _grad_missing(opt, ours, ref, ref_opt):
    ours[3].grad = ref[3].grad = None  # this step leaves that parameter alone


def _copies_registered(opt, ours, ref, ref_opt):
    opt.set_param_copies(
        [(ours[0], torch.empty(ours[0].numel(), dtype=torch.bfloat16, device=ours[0].device))]
    )


@pytest.mark.parametrize(
    "change",
    [
        _new_grad_memory,
        _load_state_dict,
        _step_counter_written,
        _moment_replaced,
        _grad_missing,
        _copies_registered,
    ],
    ids=lambda f: f.__name__.lstrip("_"),
)
def test_any_change_rebuilds_the_plan(device, monkeypatch, change):
    ours, ref, buffer, ref_buffer = _setup(device)
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    for step in range(2):
        _set_grads(ours, ref, buffer, ref_buffer, step)
        opt.step()
        ref_opt.step()
    built = _counting(opt, monkeypatch)
    _set_grads(ours, ref, buffer, ref_buffer, 2)
    change(opt, ours, ref, ref_opt)
    opt.step()
    ref_opt.step()
    assert len(built) == 1, f"{change.__name__}: the plan was not rebuilt"
    _check(ours, ref, opt, ref_opt)
    if change is _copies_registered:
        copy = opt._copies[ours[0]]
        assert torch.equal(copy, ours[0].detach().to(torch.bfloat16))
    for step in range(3, 5):  # and steady again
        _set_grads(ours, ref, buffer, ref_buffer, step)
        opt.step()
        ref_opt.step()
    # the buffer's gradients back (their old address), a gradient back: one more build, then steady
    assert len(built) == (2 if change in (_grad_missing, _new_grad_memory) else 1)
    _check(ours, ref, opt, ref_opt)


def test_a_transposed_gradient_at_the_same_address_is_not_read_as_contiguous(device):
    gen = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(19, 19, generator=gen).to(device))]
    ref = [torch.nn.Parameter(ours[0].detach().clone())]
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    buffer = torch.empty(19, 19, device=device)
    for step in range(4):
        buffer.copy_(torch.randn(19, 19, generator=gen).to(device))
        # step 2: the same memory in another layout (the torch path steps it); step 3 contiguous again
        ours[0].grad = buffer.t() if step == 2 else buffer.view(19, 19)
        ref[0].grad = ours[0].grad.clone()
        opt.step()
        ref_opt.step()
    _check(ours, ref, opt, ref_opt)
    assert opt.turbo_steps == 3
