"""``grouped_gemm(..., wgrad_into=weights)`` / ``grouped_gemm_fp8(..., wgrad_into=...)``: b's gradient goes
into the weights' ``.grad`` (split along N; written when None, summed in fp32 otherwise) on every backend of
the in-place variable-K op, against an fp64 reference over two backward passes (gradient accumulation)."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import make_group_lens
from test_utils import assert_close, assert_snr

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import GroupedWgradIntoDispatcher
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import quantize_grouped_weight

BACKENDS = ["TRITON", "CUTLASS", "TORCH"]


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    GlobalBackendManager.reset()


def _pin(backend, device):
    if backend == "CUTLASS" and device.type != "cuda":
        pytest.skip("CUTLASS (torch._grouped_mm) runs on sm_90")
    GlobalBackendManager.set_grouped_wgrad_accumulate_backend(backend)


def _weights(G, sizes, K, device):
    return [torch.nn.Parameter(torch.randn(G, n, K, device=device) / K**0.5) for n in sizes]


def _reference_wgrad(a, grad_out, lens, sizes):
    """Per weight: sum over groups of dC_g^T @ A_g in fp64, [G, N_i, K]."""
    out = torch.zeros(lens.shape[0], grad_out.shape[1], a.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, n in enumerate(lens.tolist()):
        out[g] = grad_out[start : start + n].double().t() @ a[start : start + n].double()
        start += n
    return out.split(sizes, dim=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_weight_gradients_are_written_then_accumulated_into_grad(backend, kind, device):
    _pin(backend, device)
    G, M, K, sizes = 4, 96, 32, [24, 24]  # w1 and w3 of a gate/up pair
    lens = make_group_lens(M, G, kind, device)
    w1, w3 = _weights(G, sizes, K, device)
    b = torch.cat([w1, w3], dim=1).detach().bfloat16()  # the step's cast copy: no gradient of its own
    want = [torch.zeros_like(w, dtype=torch.float64) for w in (w1, w3)]
    for _ in range(2):  # two micro-batches: the first writes .grad, the second adds to it
        a = torch.randn(M, K, device=device).bfloat16().requires_grad_()
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True, wgrad_into=(w1, w3))
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        for acc, ref in zip(want, _reference_wgrad(a.detach(), grad_out, lens, sizes)):
            acc += ref
        assert a.grad is not None and b.grad is None
    assert GroupedWgradIntoDispatcher.last_backend is BackendType[backend]
    for w, ref in zip((w1, w3), want):
        assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
        scale = ref.abs().max()
        assert_close(w.grad.double() / scale, ref / scale, torch.bfloat16)
    for g in torch.nonzero(lens == 0).flatten().tolist():
        assert torch.count_nonzero(w1.grad[g]) == 0, f"empty expert {g} got a gradient"


def test_create_graph_hands_the_weights_gradients_to_autograd(device):
    """Under create_graph the gradients go through autograd (torch.autograd.grad sees them), not .grad."""
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")  # the TORCH loop's mm(out=) refuses create_graph
    G, M, K = 2, 16, 8
    lens = make_group_lens(M, G, "balanced", device)
    (w,) = _weights(G, [8], K, device)
    a = torch.randn(M, K, device=device, requires_grad=True)
    out = turbo.ops.grouped_gemm(a, w.detach(), lens, trans_b=True, wgrad_into=(w,))
    grad_out = torch.randn_like(out)
    (gw,) = torch.autograd.grad(out, w, grad_out, create_graph=True)
    assert w.grad is None
    (want,) = _reference_wgrad(a.detach(), grad_out, lens, [8])
    assert_close(gw, want, torch.float32)


def test_fp8_high_precision_wgrad_into_grad(device):
    """FP8 forward with the bf16 wgrad (the TorchTitan recipe's fp8.wgrad=bf16) summed into .grad, and the
    FP8 wgrad added in one pass: both against the same op's b gradient."""
    G, M, K, sizes = 4, 128, 64, [32, 32]
    lens = make_group_lens(M, G, "skewed", device)
    for hp in (True, False):
        config = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE, high_precision_wgrad=hp)
        w1, w3 = _weights(G, sizes, K, device)
        b16 = torch.cat([w1, w3], dim=1).detach().bfloat16()
        a = torch.randn(M, K, device=device).bfloat16()
        grad_out = torch.randn(M, sum(sizes), device=device).bfloat16()
        b_ref = b16.clone().requires_grad_()
        turbo.ops.grouped_gemm_fp8(a, b_ref, lens, trans_b=True, config=config).backward(grad_out)
        for _ in range(2):
            w8 = quantize_grouped_weight(b16, config)
            out = turbo.ops.grouped_gemm_fp8(a, w8, lens, trans_b=True, config=config, wgrad_into=(w1, w3))
            out.backward(grad_out)
        want = (2 * b_ref.grad.float()).split(sizes, dim=1)
        for w, ref in zip((w1, w3), want):
            assert w.grad.dtype == torch.float32
            scale = ref.abs().max()
            assert_close(w.grad / scale, ref / scale, torch.bfloat16, msg=f"hp_wgrad={hp}")


@pytest.mark.parametrize("fp8", [False, True])
def test_a_cast_copy_that_requires_grad_does_not_add_a_second_gradient(fp8, device):
    """b = cat(w1, w3).to(bf16) keeps the weights in b's autograd graph: b's own gradient (documented as none)
    would reach their .grad through the cast as well, doubling it."""
    G, M, K, sizes = 2, 32, 16, [8, 8]
    lens = make_group_lens(M, G, "balanced", device)
    w1, w3 = _weights(G, sizes, K, device)
    a = torch.randn(M, K, device=device).bfloat16()
    b = torch.cat([w1, w3], dim=1).bfloat16()
    assert b.requires_grad
    if fp8:  # the FP8 wgrad (added into .grad in one pass, and returned for b as well)
        config = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
        out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=True, config=config, wgrad_into=(w1, w3))
    else:
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True, wgrad_into=(w1, w3))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    for w, ref in zip((w1, w3), _reference_wgrad(a, grad_out, lens, sizes)):
        if fp8:
            assert_snr(w.grad, ref, 20.0, "FP8 wgrad")
        else:
            assert_close(w.grad.double() / ref.abs().max(), ref / ref.abs().max(), torch.bfloat16)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda w: (w.detach(),), "leaf tensor that requires grad"),
        (lambda w: (torch.nn.Parameter(torch.zeros(2, 8, 9)),), r"expected \[2, N_i, 8\]"),
        (lambda w: (w, w), r"sum\(N_i\) = 8"),
    ],
)
def test_bad_wgrad_into_is_refused_naming_the_argument(bad, match, device):
    lens = make_group_lens(16, 2, "balanced", device)
    (w,) = _weights(2, [8], 8, device)
    a = torch.randn(16, 8, device=device)
    with pytest.raises(ValueError, match=match):
        turbo.ops.grouped_gemm(a, w.detach(), lens, trans_b=True, wgrad_into=bad(w))
    with pytest.raises(ValueError, match="needs trans_b=True"):
        turbo.ops.grouped_gemm(a, w.detach().transpose(1, 2), lens, trans_b=False, wgrad_into=(w,))


def test_default_backend_rule():
    """Measured on an H200: writing fp32 (the step's first micro-batch) the Triton kernel beats CUTLASS + a
    cast; adding, CUTLASS + the add pass won at the recipe's real routing (the Triton kernel only with
    balanced experts). CPU: the TORCH reference."""
    from types import SimpleNamespace

    on = SimpleNamespace(device=torch.device("cuda"))
    assert GroupedWgradIntoDispatcher.default_backend(x=on, accumulate=True) is BackendType.CUTLASS
    assert GroupedWgradIntoDispatcher.default_backend(x=on, accumulate=False) is BackendType.TRITON
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert GroupedWgradIntoDispatcher.default_backend(x=cpu, accumulate=True) is BackendType.TORCH
