"""turbo.optim.AdamW where a training stack meets it from outside: torch's GradScaler with ``fused=True``
(accepted for drop-in use) and optimizer state loaded from a model whose parameters had other shapes."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

from primus_turbo.pytorch.optim import AdamW

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("fused", [None, True])
def test_grad_scaler_unscales_and_skips_inf_steps(fused, device):
    """torch's AdamW(fused=True) tells GradScaler it unscales and skips inf steps itself; this step does
    neither, so GradScaler must do both (with fused=True it did not: scaled steps, then NaN after an inf)."""
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((37, 19), (5,))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref_opt = AdamW(ours, fused=fused, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    scaler = torch.amp.GradScaler(device.type, init_scale=1024.0)
    for step in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(device) for p in ours]
        if step == 1:
            grads[0][0, 0] = float("inf")  # the scaler skips this step
        scale = scaler.scale(torch.ones((), device=device))
        for p, g in zip(ours, grads):
            p.grad = g * scale
        scaler.step(opt)
        scaler.update()
        if step != 1:
            for q, g in zip(ref, grads):
                q.grad = g.clone()
            ref_opt.step()
    assert opt.turbo_steps == 3 * len(ours)
    for p, q in zip(ours, ref):
        assert_close(p, q, torch.float32)
        assert float(opt.state[p]["step"]) == 3.0


def test_state_of_another_shape_is_refused(device):
    """A checkpoint of a smaller embedding loaded into a resized one: torch's step raises, the kernel read and
    wrote the moments out of bounds."""
    small = torch.nn.Parameter(torch.randn(8, 4, device=device))
    small.grad = torch.randn(8, 4, device=device)
    saved = torch.optim.AdamW([small], **KW)
    saved.step()
    big = torch.nn.Parameter(torch.randn(10, 4, device=device))
    big.grad = torch.randn(10, 4, device=device)
    opt = AdamW([big], **KW)
    opt.load_state_dict(saved.state_dict())
    expected = r"state\['exp_avg'\] of a parameter of shape \(10, 4\) .* is \(8, 4\)"
    with pytest.raises(ValueError, match=expected):
        opt.step()
    opt.state[big]["exp_avg"] = torch.zeros_like(big)  # exp_avg_sq still the old shape
    with pytest.raises(ValueError, match=r"state\['exp_avg_sq'\] .* it must match the parameter"):
        opt.step()


def test_differentiable_update_keeps_its_graph(device):
    """differentiable=True steps through torch's AdamW, which enables autograd from its defaults: the update
    must stay differentiable (the step ran it under no_grad: no gradient reached the inputs)."""
    results = []
    for cls in (torch.optim.AdamW, AdamW):
        gen = torch.Generator().manual_seed(0)
        base = torch.randn(6, generator=gen).to(device).requires_grad_()
        grad = torch.randn(6, generator=gen).to(device).requires_grad_()
        param = base * 1.0  # a non-leaf parameter, differentiable w.r.t. base
        param.grad = grad
        cls([param], differentiable=True, **KW).step()
        results.append((param.detach(), torch.autograd.grad((param * param).sum(), (base, grad))))
    (ref, ref_grads), (ours, our_grads) = results
    assert_close(ours, ref, torch.float32)
    for a, b in zip(our_grads, ref_grads):
        assert_close(a, b, torch.float32)


def test_deepcopy_of_a_stepped_optimizer_steps_on(device):
    """copy.deepcopy / pickling restore only torch's fields (Optimizer.__getstate__); the copy's step then
    failed on this class's missing ones. Both go on as torch's AdamW does, the copy on its own tensors."""
    import copy

    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((37, 19), (5,))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    for step in range(3):
        if step == 2:
            twin = copy.deepcopy(opt)
            twin_params = twin.param_groups[0]["params"]
        grads = [torch.randn(p.shape, generator=gen).to(device) for p in ours]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 2:
            for p, g in zip(twin_params, grads):
                p.grad = g.clone()
            twin.step()
        opt.step()
        ref_opt.step()
    assert twin.turbo_steps == len(ours)
    for p, t, q in zip(ours, twin_params, ref):
        assert t is not p
        assert_close(p, q, torch.float32)
        assert_close(t, q, torch.float32)
        assert float(twin.state[t]["step"]) == 3.0


@pytest.mark.gpu
def test_fused_fallback_after_kernel_steps():
    """With fused=True, a parameter the kernel stepped (its counter on the CPU) whose gradient then turns
    non-contiguous takes torch's fused step, which reads the counter on the parameter's device and wants the
    gradient laid out as the parameter (torch's own fused AdamW raises on that gradient: the fallback steps a
    copy and leaves the gradient as it was); then the kernel again. Matches torch's fused AdamW over the same
    gradients (GPU, session 36: failed with torch's layout error before the copy)."""
    gen = torch.Generator().manual_seed(1)
    ours = torch.nn.Parameter(torch.randn(37, 19, generator=gen).cuda())
    ref = torch.nn.Parameter(ours.detach().clone())
    opt, ref_opt = AdamW([ours], fused=True, **KW), torch.optim.AdamW([ref], fused=True, **KW)
    for step in range(4):
        g = torch.randn(37, 19, generator=gen).cuda()
        ours.grad = g.T.contiguous().T if step == 2 else g  # step 2: a non-contiguous gradient (torch's path)
        ref.grad = g.clone()
        opt.step()
        ref_opt.step()
        assert ours.grad.stride() == ((1, 37) if step == 2 else (19, 1))
    assert opt.turbo_steps == 3
    assert_close(ours, ref, torch.float32)
    assert float(opt.state[ours]["step"]) == 4.0
