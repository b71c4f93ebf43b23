"""Turbo grouped experts: the per-step weight cache (bf16 stack, FP8 copies) and the fused main_grad
accumulation, against per-expert fp32 matmuls (bf16 tolerance / FP8 SNR gates) and DDP's accumulation."""

import dataclasses
import types

import pytest
import torch
from megatron_utils import transformer_config as _config
from test_utils import assert_close

megatron = pytest.importorskip("megatron.core")


# -- grouped experts: per-step weight cache and main_grad fusion ---------------------------------------------
_EXPERT_PRECISIONS = {  # name -> "granularity format" of the experts' Float8QuantConfig (None: bf16)
    "bf16": None,
    "fp8-tensorwise-e4m3": "TENSORWISE E4M3",
    "fp8-rowwise-hybrid": "ROWWISE HYBRID",
    "fp8-blockwise-e4m3": "BLOCKWISE E4M3",
}


@pytest.fixture
def expert_precision(request):
    """Sets turbo_layers.FP8_GROUPED_CONFIG for the test (None for bf16); restores the cache state."""
    from primus_turbo.integrations.megatron import turbo_layers as tl

    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity

    if _EXPERT_PRECISIONS[request.param] is not None:
        granularity, fmt = _EXPERT_PRECISIONS[request.param].split()
        tl.FP8_GROUPED_CONFIG = Float8QuantConfig(
            format=Format[fmt], granularity=ScalingGranularity[granularity]
        )
    yield tl.FP8_GROUPED_CONFIG
    tl.FP8_GROUPED_CONFIG = None
    tl.disable_weight_cache()


_BF16 = types.SimpleNamespace(high_precision_wgrad=True)  # bf16 experts: the wgrad is the bf16 GEMM


def _experts(groups=3, n_in=128, n_out=128, seed=0):
    from primus_turbo.integrations.megatron.turbo_layers import TurboColumnParallelGroupedLinear

    torch.manual_seed(seed)
    return TurboColumnParallelGroupedLinear(
        groups, n_in, n_out, config=_config(params_dtype=torch.bfloat16),
        init_method=lambda w: torch.nn.init.normal_(w, std=n_in**-0.5), bias=False, skip_bias_add=False,
        is_expert=True,
    )  # fmt: skip


def _expert_grad(tokens):
    """Keeps the weight gradients (sums over ~50 tokens) O(1), where the bf16 tolerance is meaningful."""
    return (torch.randn(tokens, 128) * 0.1).bfloat16()


def _expert_step(layer, x, splits, grad_out):
    """One microbatch: (out, dx); weight gradients land where autograd / the main_grad fusion puts them."""
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x, splits)
    out.backward(grad_out)
    return out.detach(), x.grad


def _expert_reference(layer, x, splits, grad_out):
    """fp32 per-expert matmuls on the same bf16 values: (out, dx, [dW_g])."""
    weights = [
        getattr(layer, f"weight{i}").detach().float().requires_grad_(True) for i in range(layer.num_gemms)
    ]
    xr = x.detach().float().requires_grad_(True)
    out = torch.cat([chunk @ w.t() for chunk, w in zip(xr.split(splits), weights)])
    out.backward(grad_out.float())
    return out.detach(), xr.grad, [w.grad for w in weights]


def _check_against_reference(fp8_config, got, want, msg):
    from test_utils import assert_snr, fp8_snr_gate

    if fp8_config is None:
        assert_close(got, want, torch.bfloat16, msg=msg)
    else:
        assert_snr(got, want, fp8_snr_gate(fp8_config.format), msg)


@pytest.mark.parametrize("expert_precision", list(_EXPERT_PRECISIONS), indirect=True)
def test_grouped_weight_cache_matches_uncached_and_reference(megatron_world, expert_precision):
    """Cached (one stack / quantization per step) and uncached experts give bitwise the same outputs and
    gradients, both within the bf16 tolerance / FP8 SNR gate of per-expert fp32 matmuls."""
    from primus_turbo.integrations.megatron import turbo_layers as tl

    layer = _experts()
    splits = [40, 0, 56]  # expert 1 gets no tokens
    x = torch.randn(sum(splits), 128, dtype=torch.bfloat16)
    grad_out = _expert_grad(sum(splits))
    tl.disable_weight_cache()
    out_plain, dx_plain = _expert_step(layer, x, splits, grad_out)
    wgrads_plain = [getattr(layer, f"weight{i}").grad.clone() for i in range(3)]
    layer.zero_grad(set_to_none=True)
    tl.new_weight_step()
    for microbatch in (1, 2):
        out, dx = _expert_step(layer, x, splits, grad_out)
        assert torch.equal(out, out_plain) and torch.equal(dx, dx_plain), f"microbatch {microbatch}"
        for i in range(3):  # bf16 doubling is exact
            assert torch.equal(getattr(layer, f"weight{i}").grad, wgrads_plain[i] * microbatch), f"wgrad {i}"
    out_ref, dx_ref, wgrads_ref = _expert_reference(layer, x, splits, grad_out)
    _check_against_reference(expert_precision, out_plain, out_ref, "experts out")
    _check_against_reference(expert_precision, dx_plain, dx_ref, "experts dgrad")
    for i in (0, 2):
        _check_against_reference(expert_precision, wgrads_plain[i], wgrads_ref[i], f"experts wgrad {i}")
    assert torch.count_nonzero(wgrads_plain[1]) == 0  # the expert without tokens


@pytest.mark.parametrize("expert_precision", ["bf16", "fp8-rowwise-hybrid"], indirect=True)
def test_grouped_weight_cache_rebuilds_on_new_step_and_in_place_update(
    megatron_world, expert_precision, monkeypatch
):
    """One stack (and FP8 quantization) per optimizer step; an in-place write to any weight{i} or a new step
    rebuilds; without announced steps every call rebuilds."""
    import importlib

    from primus_turbo.integrations.megatron import turbo_layers as tl

    fp8_module = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")  # ops.<name> is the op
    builds = []
    real_stack = tl.torch.stack
    monkeypatch.setattr(tl.torch, "stack", lambda *a, **k: builds.append(1) or real_stack(*a, **k))
    quantizations = []
    real_quant_b = fp8_module._quant_b
    monkeypatch.setattr(fp8_module, "_quant_b", lambda *a: quantizations.append(1) or real_quant_b(*a))
    layer = _experts()
    splits = [48, 16, 32]
    x = torch.randn(sum(splits), 128, dtype=torch.bfloat16)
    grad_out = _expert_grad(sum(splits))
    fp8 = expert_precision is not None

    tl.new_weight_step()
    out_first, _ = _expert_step(layer, x, splits, grad_out)
    out_second, _ = _expert_step(layer, x, splits, grad_out)
    assert torch.equal(out_first, out_second)
    assert len(builds) == 1 and len(quantizations) == int(fp8)
    with torch.no_grad():
        layer.weight1.mul_(-0.5)  # bumps weight1._version only
    out_updated, _ = _expert_step(layer, x, splits, grad_out)
    assert len(builds) == 2 and len(quantizations) == 2 * int(fp8)
    rows = slice(48, 64)  # expert 1's tokens
    assert torch.equal(out_updated[:48], out_first[:48]) and torch.equal(out_updated[64:], out_first[64:])
    out_ref, _, _ = _expert_reference(layer, x, splits, grad_out)
    _check_against_reference(expert_precision, out_updated[rows], out_ref[rows], "after the in-place update")
    tl.new_weight_step()
    _expert_step(layer, x, splits, grad_out)
    assert len(builds) == 3 and len(quantizations) == 3 * int(fp8)
    tl.disable_weight_cache()
    for _ in range(2):
        _expert_step(layer, x, splits, grad_out)
    assert len(builds) == 5 and len(quantizations) == 5 * int(fp8)


def _attach_main_grads(layer, layout):
    """fp32 main_grads as Megatron DDP lays them out ("ddp": one buffer, weight{G-1} first), with a gap
    between two experts (a bucket boundary: two equally spaced runs), or as separate tensors."""
    weights = [getattr(layer, f"weight{i}") for i in range(layer.num_gemms)]
    numel, groups = weights[0].numel(), len(weights)
    if layout == "separate":
        main_grads = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    else:
        gap = 64 if layout == "gapped" else 0
        buffer = torch.zeros(groups * numel + gap)
        starts = [(groups - 1 - i) * numel + (gap if i == 0 else 0) for i in range(groups)]
        main_grads = [buffer[s : s + numel].view_as(w) for s, w in zip(starts, weights)]
    for w, main_grad in zip(weights, main_grads):
        w.main_grad = main_grad
        w.grad_added_to_main_grad = False
    return weights


@pytest.mark.parametrize(
    "expert_precision, layout, wgrad_backend",
    [
        ("bf16", "ddp", None), ("bf16", "gapped", None), ("bf16", "separate", None),
        ("fp8-rowwise-hybrid", "ddp", None), ("bf16", "ddp", "TRITON"), ("bf16", "gapped", "TRITON"),
        ("fp8-rowwise-hybrid", "ddp", "TRITON"),
    ],
    indirect=["expert_precision"],
)  # fmt: skip
def test_grouped_linear_accumulates_into_main_grad(megatron_world, expert_precision, layout, wgrad_backend):
    """With main_grad on every weight (Megatron DDP) two microbatches leave what DDP's hook would (bf16 wgrad
    added into fp32: bitwise with the CPU default's compute-then-add; within bf16 tolerance where TRITON
    sums into main_grad inside the wgrad GEMM, the GPU default), the fp32 reference within tolerance, and a
    placeholder in every weight.grad on every microbatch."""
    from primus_turbo.integrations.megatron import turbo_layers as tl

    from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import GroupedWgradIntoDispatcher

    GlobalBackendManager.set_grouped_wgrad_accumulate_backend(wgrad_backend)
    GroupedWgradIntoDispatcher.last_backend = None
    if expert_precision is not None and wgrad_backend is not None:  # the recipe's fp8.wgrad=bf16
        tl.FP8_GROUPED_CONFIG = dataclasses.replace(expert_precision, high_precision_wgrad=True)
    through_gemm = layout == "ddp" and (tl.FP8_GROUPED_CONFIG or _BF16).high_precision_wgrad

    layer, plain = _experts(), _experts()
    plain.load_state_dict(layer.state_dict())
    weights = _attach_main_grads(layer, layout)
    hook_calls = [0] * len(weights)
    for i, w in enumerate(weights):
        w.register_post_accumulate_grad_hook(lambda _, i=i: hook_calls.__setitem__(i, hook_calls[i] + 1))
    splits = [[40, 0, 56], [8, 64, 24]]
    xs = [torch.randn(96, 128, dtype=torch.bfloat16) for _ in splits]
    grads = [_expert_grad(96) for _ in splits]
    tl.new_weight_step()
    hook_main_grads = [torch.zeros_like(w, dtype=torch.float32) for w in weights]  # DDP's hook, emulated
    ref_main_grads = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    for microbatch, (x, split, grad_out) in enumerate(zip(xs, splits, grads)):
        out, dx = _expert_step(layer, x, split, grad_out)
        out_plain, dx_plain = _expert_step(plain, x, split, grad_out)
        assert torch.equal(out, out_plain) and torch.equal(dx, dx_plain)
        for i, w in enumerate(weights):
            hook_main_grads[i] += getattr(plain, f"weight{i}").grad.float()
            assert w.grad_added_to_main_grad and w.grad.shape == w.shape  # Megatron's placeholder
            assert hook_calls[i] == microbatch + 1, f"weight{i} got no gradient in microbatch {microbatch}"
        plain.zero_grad(set_to_none=True)
        for i, wgrad in enumerate(_expert_reference(layer, x, split, grad_out)[2]):
            ref_main_grads[i] += wgrad
    # through the wgrad GEMM into main_grad (one equally spaced block), or computed and added (gapped)
    fused = GroupedWgradIntoDispatcher.last_backend
    GlobalBackendManager.reset()
    assert fused is (BackendType[wgrad_backend or "TORCH"] if through_gemm else None)
    for i, w in enumerate(weights):
        if wgrad_backend is None or not through_gemm:
            assert torch.equal(w.main_grad, hook_main_grads[i]), f"weight{i}.main_grad != DDP hook's sum"
        else:  # summed in fp32: the hook's sum had the bf16-rounded gradient
            assert_close(w.main_grad, hook_main_grads[i], torch.bfloat16, msg=f"weight{i}.main_grad")
        _check_against_reference(expert_precision, w.main_grad, ref_main_grads[i], f"weight{i}.main_grad")


@pytest.mark.parametrize("expert_precision", list(_EXPERT_PRECISIONS), indirect=True)
def test_microbatches_before_the_last_skip_the_per_weight_ddp_hooks(megatron_world, expert_precision):
    """Inside DDP's no_sync (every micro-batch but the last; trainer: accumulating_microbatch) the experts add
    their gradient into main_grad with no per-weight autograd edge: no hook, no placeholder. The last one
    fires every weight's hook once, and main_grad holds the same sum as with a hook on every micro-batch."""
    import contextlib

    from primus_turbo.integrations.megatron import turbo_layers as tl

    layer, plain = _experts(), _experts()
    plain.load_state_dict(layer.state_dict())
    weights = _attach_main_grads(layer, "ddp")
    hook_calls = [0] * len(weights)
    for i, w in enumerate(weights):
        w.register_post_accumulate_grad_hook(lambda _, i=i: hook_calls.__setitem__(i, hook_calls[i] + 1))
    splits = [[40, 0, 56], [8, 64, 24], [30, 30, 36]]
    xs = [torch.randn(96, 128, dtype=torch.bfloat16) for _ in splits]
    grads = [_expert_grad(96) for _ in splits]
    tl.new_weight_step()
    want = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
    last = len(splits) - 1
    for microbatch, (x, split, grad_out) in enumerate(zip(xs, splits, grads)):
        no_sync = contextlib.nullcontext  # stands for DDP's no_sync
        with tl.accumulating_microbatch(no_sync) if microbatch < last else no_sync():
            assert tl._SKIP_EXPERT_GRAD_HOOKS == (microbatch < last)
            out, dx = _expert_step(layer, x, split, grad_out)
        assert not tl._SKIP_EXPERT_GRAD_HOOKS
        out_plain, dx_plain = _expert_step(plain, x, split, grad_out)
        assert torch.equal(out, out_plain) and torch.equal(dx, dx_plain)
        for i, w in enumerate(weights):
            want[i] += getattr(plain, f"weight{i}").grad.float()
            assert hook_calls[i] == (1 if microbatch == last else 0), (microbatch, hook_calls)
            assert (w.grad is None) == (microbatch < last)
        plain.zero_grad(set_to_none=True)
    for i, w in enumerate(weights):
        assert torch.equal(w.main_grad, want[i]), f"weight{i}.main_grad != the per-micro-batch hooks' sum"


def test_grouped_linear_main_grad_placeholders(megatron_world):
    """Megatron's placeholder rules, as for the dense linears: zeros with zero_out_wgrad, None without DDP's
    grad_added_to_main_grad attribute (main_grad is still accumulated)."""
    layer = _experts(groups=2)
    weights = _attach_main_grads(layer, "ddp")
    weights[0].zero_out_wgrad = True
    del weights[1].grad_added_to_main_grad
    splits = [32, 32]
    x, grad_out = torch.randn(64, 128, dtype=torch.bfloat16), _expert_grad(64)
    _expert_step(layer, x, splits, grad_out)
    assert weights[0].grad is not None and torch.count_nonzero(weights[0].grad) == 0
    assert weights[1].grad is None and not hasattr(weights[1], "grad_added_to_main_grad")
    ref = _expert_reference(layer, x, splits, grad_out)[2]
    for w, wgrad in zip(weights, ref):
        assert_close(w.main_grad, wgrad, torch.bfloat16, msg="main_grad")
    weights[1].main_grad = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="weight1.main_grad must match weight1"):
        layer(x, splits)


def test_grouped_linear_gpu_init_draws_from_the_expert_rng_stream(megatron_world, monkeypatch):
    """With use_cpu_initialization=False Megatron draws expert weights inside the expert-parallel RNG tracker
    (seeded per EP rank, as TE GroupedLinear and SequentialMLP do); the default generator, seeded alike on
    every rank, would give every EP rank the same experts. Under the CPU shims the tracker runs on the CPU
    generator (seeded for real here: the shims make torch.cuda.manual_seed a no-op), so this checks the
    GPU code path."""
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        get_expert_parallel_rng_tracker_name,
        model_parallel_cuda_manual_seed,
    )
    from primus_turbo.integrations.megatron.turbo_layers import TurboRowParallelGroupedLinear

    def init(w):
        return torch.nn.init.normal_(w, std=0.02)

    monkeypatch.setattr(torch.cuda, "manual_seed", torch.manual_seed)
    model_parallel_cuda_manual_seed(1234)
    layer = TurboRowParallelGroupedLinear(
        3, 64, 32, config=_config(params_dtype=torch.bfloat16, use_cpu_initialization=False),
        init_method=init, bias=False, skip_bias_add=False, is_expert=True,
    )  # fmt: skip
    model_parallel_cuda_manual_seed(1234)
    default_stream = [init(torch.empty(32, 64, dtype=torch.bfloat16)) for _ in range(3)]
    model_parallel_cuda_manual_seed(1234)
    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
        expert_stream = [init(torch.empty(32, 64, dtype=torch.bfloat16)) for _ in range(3)]
    for i in range(3):
        got = getattr(layer, f"weight{i}").detach().cpu()
        torch.testing.assert_close(got, expert_stream[i], rtol=0, atol=0)
        assert not torch.equal(got, default_stream[i]), "expert weights came from the default generator"
    assert layer.weight0.partition_dim == 1 and not layer.weight0.allreduce
