"""``grouped_gemm(..., main_grad_into=weights)`` / ``grouped_gemm_fp8(..., main_grad_into=...)``: b[g]'s
gradient is added into ``weights[g].main_grad`` (Megatron's gradient_accumulation_fusion), inside the wgrad
GEMM when the G buffers sit equally spaced in one flat buffer (forward or, as Megatron's DDP lays them out,
reverse order), else computed then added. Checked against an fp64 reference over two micro-batches on top
of a non-zero starting main_grad, with the buffer's padding between the slots left untouched."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import make_group_lens
from test_utils import assert_close, assert_snr

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.core.main_grad import main_grad_block
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import GroupedWgradIntoDispatcher
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import quantize_grouped_weight

PAD = 40  # fp32 elements between two slots of the flat buffer (a sentinel that must survive)


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    GlobalBackendManager.reset()


def _experts(G, N, K, order, device):
    """G bf16 parameters [N, K] whose main_grads are slots of one fp32 buffer: ``forward`` (expert g at slot
    g), ``reverse`` (Megatron's DDP: expert g at slot G-1-g), ``uneven`` (one slot displaced: no block)."""
    slot = N * K + PAD
    buf = torch.randn(G * slot + PAD, device=device)
    weights = []
    for g in range(G):
        pos = {"forward": g, "reverse": G - 1 - g, "uneven": g}[order]
        start = pos * slot + (PAD // 2 if order == "uneven" and g == G - 1 else 0)
        w = torch.nn.Parameter((torch.randn(N, K, device=device) / K**0.5).bfloat16())
        w.main_grad = buf[start : start + N * K].view(N, K)
        weights.append(w)
    return weights, buf


def _reference_wgrad(a, grad_out, lens):
    """[G, N, K] fp64: dC_g^T @ A_g."""
    out = torch.zeros(lens.shape[0], grad_out.shape[1], a.shape[1], dtype=torch.float64, device=a.device)
    start = 0
    for g, n in enumerate(lens.tolist()):
        out[g] = grad_out[start : start + n].double().t() @ a[start : start + n].double()
        start += n
    return out


def _untouched(buf, before, weights):
    """The buffer outside the main_grad slots is what it was."""
    mask = torch.ones_like(buf, dtype=torch.bool)
    base = buf.data_ptr()
    for w in weights:
        start = (w.main_grad.data_ptr() - base) // buf.element_size()
        mask[start : start + w.main_grad.numel()] = False
    return torch.equal(buf[mask], before[mask])


@pytest.mark.parametrize("backend", ["TRITON", "CUTLASS", "TORCH"])
@pytest.mark.parametrize("order", ["reverse", "forward", "uneven"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_weight_gradients_add_into_main_grads(backend, order, kind, device):
    if backend == "CUTLASS" and device.type != "cuda":
        pytest.skip("CUTLASS (torch._grouped_mm) runs on sm_90")
    GlobalBackendManager.set_grouped_wgrad_accumulate_backend(backend)
    G, M, N, K = 4, 96, 48, 32
    lens = make_group_lens(M, G, kind, device)
    weights, buf = _experts(G, N, K, order, device)
    block = main_grad_block(weights)
    assert (block is None) == (order == "uneven")
    if block is not None:
        assert block[1] == (order == "reverse")
    before = buf.clone()
    want = torch.stack([w.main_grad.double() for w in weights])
    b = torch.stack([w.detach() for w in weights])  # the step's stack: no gradient of its own
    for _ in range(2):  # two micro-batches accumulate
        a = torch.randn(M, K, device=device).bfloat16().requires_grad_()
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True, main_grad_into=weights)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
        want += _reference_wgrad(a.detach(), grad_out, lens)
        want_da = torch.cat(
            [grad_out[s : s + n].double() @ b[g].double() for g, (s, n) in enumerate(_spans(lens))]
        )
        assert_close(a.grad.double(), want_da, torch.bfloat16)
    if order != "uneven":  # the fused path went through the pinned backend
        assert GroupedWgradIntoDispatcher.last_backend is BackendType[backend]
    got = torch.stack([w.main_grad.double() for w in weights])
    scale = want.abs().max()
    assert_close(got / scale, want / scale, torch.bfloat16)
    assert all(w.grad is None for w in weights) and b.grad is None
    assert _untouched(buf, before, weights), "main_grad_into wrote outside the experts' main_grads"


def _spans(lens):
    start, out = 0, []
    for n in lens.tolist():
        out.append((start, n))
        start += n
    return out


@pytest.mark.parametrize("hp", [True, False], ids=["bf16-wgrad", "fp8-wgrad"])
@pytest.mark.parametrize("prequantized", [False, True])
def test_fp8_main_grad_into(hp, prequantized, device):
    """FP8 forward; the bf16 wgrad (fp8.wgrad=bf16, Megatron's deepseek_moe_fp8 default) summed into the
    reverse-ordered main_grads inside the GEMM, or the FP8 wgrad added in one pass."""
    G, M, N, K = 4, 128, 64, 64
    lens = make_group_lens(M, G, "skewed", device)
    config = Float8QuantConfig(Format.HYBRID, ScalingGranularity.ROWWISE, high_precision_wgrad=hp)
    weights, buf = _experts(G, N, K, "reverse", device)
    start = torch.stack([w.main_grad.clone() for w in weights]).double()
    b = torch.stack([w.detach() for w in weights])
    b_arg = quantize_grouped_weight(b, config) if prequantized else b
    a = torch.randn(M, K, device=device).bfloat16().requires_grad_()
    out = turbo.ops.grouped_gemm_fp8(a, b_arg, lens, trans_b=True, config=config, main_grad_into=weights)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    added = torch.stack([w.main_grad.double() for w in weights]) - start
    want = _reference_wgrad(a.detach(), grad_out, lens)
    assert_snr(added, want, 20.0 if not hp else 35.0, msg=f"hp={hp}")
    assert a.grad is not None and all(w.grad is None for w in weights)


def test_bad_main_grad_into_is_refused_naming_the_argument(device):
    G, N, K = 2, 8, 8
    lens = make_group_lens(16, G, "balanced", device)
    weights, _ = _experts(G, N, K, "reverse", device)
    b = torch.stack([w.detach() for w in weights])
    a = torch.randn(16, K, device=device).bfloat16()
    gemm = turbo.ops.grouped_gemm
    with pytest.raises(ValueError, match="main_grad_into needs trans_b=True"):
        gemm(a, b.transpose(1, 2), lens, trans_b=False, main_grad_into=weights)
    with pytest.raises(ValueError, match="main_grad_into has 1 weights; b has G=2"):
        gemm(a, b, lens, trans_b=True, main_grad_into=weights[:1])
    with pytest.raises(ValueError, match="wgrad_into or main_grad_into, not both"):
        w3 = torch.nn.Parameter(torch.zeros(G, N, K, device=device))
        gemm(a, b, lens, trans_b=True, main_grad_into=weights, wgrad_into=(w3,))
    bare = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    with pytest.raises(ValueError, match=r"main_grad_into\[0\].main_grad must be a tensor of shape \(8, 8\)"):
        gemm(a, b, lens, trans_b=True, main_grad_into=bare)
    weights[1].main_grad = torch.zeros(N, K + 1, device=device)  # would reach past it: refused in forward
    with pytest.raises(ValueError, match=r"main_grad_into\[1\].main_grad must be a tensor of shape \(8, 8\)"):
        gemm(a.requires_grad_(), b, lens, trans_b=True, main_grad_into=weights)
