"""turbo.optim.AdamW against torch.optim.AdamW (for-loop, fp32): the same parameters and moments after several
steps, with and without a gradient scale (gradient clipping's factor, which torch applies to .grad first), a
state_dict either optimizer loads, the 16-bit copies of fp32 masters written by the step, and ``adopt``."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

from primus_turbo.pytorch.optim import AdamW

KW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(device, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(37, 19), (5,), (3, 4, 8)]  # odd sizes: partial kernel blocks
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]


def _grads(params, step):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for p in params]


@pytest.mark.parametrize("clip", [None, 0.5])
def test_matches_torch_adamw_over_steps(clip, device):
    ours, ref = _params(device), _params(device)
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    for step in range(4):
        for p, q, g in zip(ours, ref, _grads(ours, step)):
            p.grad, q.grad = g.clone(), g.clone()
        scale = None
        if clip is not None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in ours])
            scale = (clip / (norm + 1e-6)).clamp(max=1.0)
            torch.nn.utils.clip_grads_with_norm_(ref, clip, norm)  # torch's way: .grad scaled in place
        if step % 2:
            opt.step(grad_scale=scale)
        else:  # the container form: set before a step() without arguments, used once
            opt.set_next_grad_scale(scale)
            opt.step()
        ref_opt.step()
    assert opt.turbo_steps == 4 * len(ours) and opt._next_grad_scale is None
    for p, q in zip(ours, ref):
        assert_close(p, q, torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], ref_opt.state[q][key], torch.float32)
        assert float(opt.state[p]["step"]) == 4.0
    if clip is not None:  # the gradients are read, never written
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, _grads(ours, 3)))


def test_state_dict_round_trips_with_torch_adamw(device):
    ours, ref = _params(device), _params(device)
    opt = AdamW(ours, **KW)
    for p, g in zip(ours, _grads(ours, 0)):
        p.grad = g
    opt.step()
    ref_opt = torch.optim.AdamW(ref, foreach=False, **KW)
    ref_opt.load_state_dict(opt.state_dict())
    back = AdamW(_params(device), **KW)
    back.load_state_dict(ref_opt.state_dict())
    assert set(back.state_dict()["state"]) == set(opt.state_dict()["state"])


def test_options_the_kernel_does_not_take_step_through_torch(device):
    """amsgrad: torch's AdamW does the update (the grad_scale applied to gradient copies), same result."""
    ours, ref = _params(device), _params(device)
    opt = AdamW(ours, amsgrad=True, **KW)
    ref_opt = torch.optim.AdamW(ref, amsgrad=True, foreach=False, **KW)
    for step in range(2):
        for p, q, g in zip(ours, ref, _grads(ours, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step(grad_scale=torch.tensor(0.5, device=device))
        for q in ref:
            q.grad.mul_(0.5)
        ref_opt.step()
    assert opt.turbo_steps == 0
    for p, q in zip(ours, ref):
        assert_close(p, q, torch.float32)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_grad_scale_leaves_the_gradients_as_they_were(amsgrad, device):
    """The scale is applied on the fly on the Triton path and to copies on the torch path (amsgrad): after the
    step every .grad holds exactly what backward wrote, on both paths (session 31 found the torch path scaling
    .grad in place)."""
    ours = _params(device)
    opt = AdamW(ours, amsgrad=amsgrad, **KW)
    grads = _grads(ours, 0)
    for p, g in zip(ours, grads):
        p.grad = g.clone()
    opt.step(grad_scale=torch.tensor(0.25, device=device))
    for p, g in zip(ours, grads):
        assert torch.equal(p.grad, g)
    assert opt.turbo_steps == (0 if amsgrad else len(ours))


def test_bf16_parameters_update_in_fp32_and_round_once(device):
    ours = _params(device, torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    for p, q, g in zip(ours, ref, _grads(ours, 0)):
        p.grad, q.grad = g, g.float()
    opt.step()
    ref_opt.step()
    for p, q in zip(ours, ref):
        assert p.dtype == torch.bfloat16 and opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert_close(p.float(), q, torch.bfloat16)


def test_bad_grad_scale_is_refused(device):
    (p,) = _params(device)[:1]
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="grad_scale must be a one-element tensor"):
        AdamW([p], **KW).step(grad_scale=0.5)


def test_many_parameters_in_one_launch_per_dtype_and_step_count(device, monkeypatch):
    """One launch per (dtypes, step count): 43 fp32 parameters of 0 to 3 blocks + 3 bf16 ones, some with a
    bf16 copy, two joining after the first step (their own step count). Every tensor against torch's
    AdamW, and the launch table: kept while the addresses stay, rebuilt when a gradient is a new tensor."""
    from primus_turbo.triton.optim import adamw_kernel

    launches = []
    launch = adamw_kernel.launch_adamw
    counted = lambda *a, **k: launches.append(a[1]) or launch(*a, **k)  # noqa: E731
    monkeypatch.setattr(adamw_kernel, "launch_adamw", counted)
    gen = torch.Generator().manual_seed(1)
    sizes = [int(n) for n in torch.randint(1, 3 * adamw_kernel.BLOCK, (40,), generator=gen)] + [0, 4096, 1]
    ours = [torch.nn.Parameter(torch.randn(n, generator=gen).to(device)) for n in sizes]
    bf16 = [torch.randn(n, generator=gen).to(device, torch.bfloat16) for n in (7, 5000, 1)]
    ours += [torch.nn.Parameter(t) for t in bf16]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    late = {3, 41}  # no gradient in the first step
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    copies = [p.detach().reshape(-1).to(torch.bfloat16) for p in ours[:10]]  # a model's weights start equal
    opt.set_param_copies(zip(ours[:10], copies))
    tables = {}
    for step in range(3):
        launches.clear()
        for i, (p, q) in enumerate(zip(ours, ref)):
            if step == 0 and i in late:
                continue
            g = torch.randn(p.shape, generator=gen).to(device)
            p.grad, q.grad = g.to(p.dtype), g.to(p.dtype).float()
        opt.step()
        ref_opt.step()
        # step 0: fp32 with / without copy, bf16; later: the late ones (one with a copy) a step behind
        assert launches == ([9, 32, 3] if step == 0 else [9, 1, 32, 1, 3]), launches
        for p, q in zip(ours, ref):
            assert_close(p.float(), q, p.dtype)
        for p, c in zip(ours[:10], copies):
            assert torch.equal(c, p.detach().reshape(-1).to(torch.bfloat16))
        # the gradients are new tensors every step: the tables follow their addresses
        assert all(tables.get(k) is not v[1] for k, v in opt._tables.items())
        tables = {k: v[1] for k, v in opt._tables.items()}
    opt.step()  # the same gradient tensors: every device table reused
    assert all(tables[k] is v[1] for k, v in opt._tables.items()) and len(tables) == 5
    assert len(opt.launches()) == 5
    assert sum(launch["tensors"] for launch in opt.launches()) == len(ours)
    assert sum(launch["elements"] for launch in opt.launches()) == sum(p.numel() for p in ours)


def _flat_views(params, dtype, device):
    """One NaN-filled buffer (a guard element before and after) cut into one flat view per parameter, as
    Megatron's parameter buffer holds the model's bf16 weights."""
    buffer = torch.full((sum(p.numel() for p in params) + 2,), float("nan"), dtype=dtype, device=device)
    views, start = [], 1
    for p in params:
        views.append(buffer[start : start + p.numel()])
        start += p.numel()
    return buffer, views


@pytest.mark.parametrize("amsgrad", [False, True], ids=["kernel", "torch-path"])
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_param_copies_hold_each_updated_master_cast(copy_dtype, amsgrad, device):
    """fp32 masters with 16-bit model copies: after each step (with a grad scale) every copy is bit for bit
    the cast of its updated master, on the kernel path and on the torch path (amsgrad), nothing else is
    written, and copies_fresh() says so once per step."""
    ours, ref = _params(device), _params(device)
    buffer, views = _flat_views(ours, copy_dtype, device)
    opt = AdamW(ours, amsgrad=amsgrad, **KW)
    ref_opt = torch.optim.AdamW(ref, amsgrad=amsgrad, foreach=False, **KW)
    assert opt.set_param_copies(zip(ours, views)) == len(ours)
    assert not opt.copies_fresh()
    for step in range(3):
        for p, q, g in zip(ours, ref, _grads(ours, step)):
            p.grad, q.grad = g.clone(), g * 0.25
        opt.step(grad_scale=torch.tensor(0.25, device=device))
        ref_opt.step()
        assert opt.copies_fresh() and not opt.copies_fresh()
        for p, q, view in zip(ours, ref, views):
            assert torch.equal(view, p.detach().reshape(-1).to(copy_dtype))
            assert_close(p, q, torch.float32)
    assert opt.turbo_steps == (0 if amsgrad else 3 * len(ours))
    assert buffer[0].isnan() and buffer[-1].isnan()


def test_param_copies_are_checked(device):
    ours = _params(device)
    opt = AdamW(ours[:2], **KW)
    p = ours[0]
    flat = torch.empty(p.numel(), dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="not one of this optimizer's parameters"):
        opt.set_param_copies([(ours[2], torch.empty(ours[2].numel(), device=device))])
    with pytest.raises(ValueError, match="copy has 3 elements .* must match"):
        opt.set_param_copies([(p, flat[:3])])
    with pytest.raises(ValueError, match="contiguous floating-point tensor, got torch.bfloat16"):
        opt.set_param_copies([(p, torch.empty(2 * p.numel(), dtype=torch.bfloat16, device=device)[::2])])
    with pytest.raises(ValueError, match="contiguous floating-point tensor, got torch.int32"):
        opt.set_param_copies([(p, torch.empty(p.numel(), dtype=torch.int32, device=device))])
    # the parameter's own memory in its dtype (Megatron's fp32 parameters): nothing to write
    assert opt.set_param_copies([(p, p.detach().view(-1)), (ours[1], flat[: ours[1].numel()])]) == 1
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.copies_fresh()
    assert opt.set_param_copies([]) == 0
    opt.step()
    assert not opt.copies_fresh()  # no copies registered: the caller must cast itself


def test_adopt_turns_a_stepped_torch_adamw_into_this_class(device):
    ours, ref = _params(device), _params(device)
    torch_opt = torch.optim.AdamW(ours, foreach=False, **KW)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **KW)
    for step in range(3):
        if step == 1:
            assert AdamW.adopt(torch_opt) is torch_opt and isinstance(torch_opt, AdamW)
        for p, q, g in zip(ours, ref, _grads(ours, step)):
            p.grad, q.grad = g.clone(), g.clone()
        torch_opt.step()
        ref_opt.step()
    assert torch_opt.turbo_steps == 2 * len(ours)
    for p, q in zip(ours, ref):
        assert_close(p, q, torch.float32)
    with pytest.raises(TypeError, match="must be a torch.optim.AdamW, got SGD"):
        AdamW.adopt(torch.optim.SGD(_params(device), lr=0.1))


def test_moments_made_by_a_framework_initializer_step_from_zero(device):
    """Megatron's init_state_fn makes exp_avg / exp_avg_sq without a step count (checkpoint loading)."""
    ours, ref = _params(device), _params(device)
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    for p in ours:
        opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
    for p, q, g in zip(ours, ref, _grads(ours, 0)):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    for p, q in zip(ours, ref):
        assert float(opt.state[p]["step"]) == 1.0
        assert_close(p, q, torch.float32)


def test_non_leaf_parameters_as_megatron_assigns_them(device):
    """Megatron's DistributedOptimizer builds its AdamW, then assigns param_groups of views of one fp32 buffer
    (non-leaf tensors, which torch's constructor refuses): both the kernel and the torch path step them."""
    for amsgrad in (False, True):
        bases = [torch.randn(120, device=device, requires_grad=True) for _ in range(2)]
        views = [[b[:50], b[50:]] for b in bases]
        opts = []
        for cls, vs in ((AdamW, views[0]), (torch.optim.AdamW, views[1])):
            opt = cls([torch.zeros(1, device=device, requires_grad=True)], amsgrad=amsgrad, **KW)
            opt.param_groups[0]["params"] = vs
            opts.append(opt)
        bases[1].data.copy_(bases[0].data)
        for v0, v1 in zip(*views):
            v0.grad = torch.randn(v0.shape, device=device)
            v1.grad = v0.grad.clone()
        for opt in opts:
            opt.step()
        assert opts[0].turbo_steps == (0 if amsgrad else 2)
        assert_close(bases[0].detach(), bases[1].detach(), torch.float32)


def test_moments_in_another_layout_step_through_torch(device):
    """A moment that is not contiguous (e.g. loaded so) cannot go through the kernel's flat table: that
    parameter steps through torch's AdamW, the others through the kernel, all correct."""
    ours, ref = _params(device), _params(device)
    opt, ref_opt = AdamW(ours, **KW), torch.optim.AdamW(ref, foreach=False, **KW)
    p = ours[0]
    opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros(p.shape[::-1], device=device).t(),
                        exp_avg_sq=torch.zeros_like(p))  # fmt: skip
    for q, r, g in zip(ours, ref, _grads(ours, 0)):
        q.grad, r.grad = g.clone(), g.clone()
    opt.step()
    ref_opt.step()
    assert opt.turbo_steps == len(ours) - 1
    for q, r in zip(ours, ref):
        assert_close(q, r, torch.float32)


def _compile_all() -> None:
    import triton.language as tl
    from triton_compile_utils import compile_for_sm90

    from primus_turbo.triton.optim import adamw_kernel as ak

    sig = {
        "table_ptr": "*i64", "num_tensors": "i32", "search_steps": "i32", "scale_ptr": "*fp32", "lr": "fp32",
        "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "weight_decay": "fp32", "bias_correction1": "fp32",
        "bias_correction2_sqrt": "fp32", "P_DTYPE": "constexpr", "G_DTYPE": "constexpr",
        "M_DTYPE": "constexpr", "COPY_DTYPE": "constexpr", "HAS_SCALE": "constexpr", "HAS_COPY": "constexpr",
        "ALIGNED": "constexpr", "BLOCK": "constexpr", "ROW": "constexpr",
    }  # fmt: skip
    variants = ((tl.float32, True, True), (tl.float32, False, False), (tl.bfloat16, True, False))
    for dtype, has_scale, has_copy in variants:
        consts = {"P_DTYPE": dtype, "G_DTYPE": dtype, "M_DTYPE": dtype, "COPY_DTYPE": tl.bfloat16,
                  "HAS_SCALE": has_scale, "HAS_COPY": has_copy, "ALIGNED": has_scale, "BLOCK": ak.BLOCK,
                  "ROW": ak.ROW}  # fmt: skip
        compiled = compile_for_sm90(ak.adamw_kernel, sig, consts, num_warps=8)
        if has_scale:  # aligned addresses: whole blocks move in 16-byte vectors
            assert "ld.global.v4" in compiled.asm["ptx"], "no vector loads in the aligned variant"


def test_kernel_compiles_for_sm90():
    from triton_compile_utils import run_compile_check

    run_compile_check(__file__)


if __name__ == "__main__":
    _compile_all()


@pytest.mark.parametrize("plan", ["first step", "kept plan"])
def test_step_bumps_the_version_of_what_it_writes(plan, device):
    """The kernels write parameters (and their 16-bit copies) in place: their ``_version`` moves as a torch
    step's does, so a Float8Linear with ``cache_weight=True`` re-quantizes the updated weight instead of
    reusing the FP8 copy of the old one (it did with this optimizer), in the plain and the copies form."""
    from primus_turbo.pytorch.modules.float8_linear import Float8Linear

    torch.manual_seed(0)
    lin = Float8Linear(64, 32, bias=False, cache_weight=True, device=device)
    master = torch.nn.Parameter(torch.randn(32, 64, device=device))
    copy = torch.zeros(32, 64, device=device, dtype=torch.bfloat16)
    opt = AdamW([lin.weight, master], lr=0.1)
    opt.set_param_copies([(master, copy)])
    x = torch.randn(16, 64, device=device)
    for step in range(2 if plan == "kept plan" else 1):
        lin(x).sum().backward()
        master.grad = torch.randn_like(master)
        versions = (lin.weight._version, master._version, copy._version)
        opt.step()
        assert all(after > before for after, before in zip((lin.weight._version, master._version,
                                                             copy._version), versions)), step  # fmt: skip
        lin.weight.grad = None
    assert opt.turbo_steps > 0  # the kernel path ran
    cached = lin(x)
    lin.invalidate_weight_cache()
    assert torch.equal(cached, lin(x))
