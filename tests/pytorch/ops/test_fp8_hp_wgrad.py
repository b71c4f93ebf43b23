"""``Float8QuantConfig(high_precision_wgrad=True)``: FP8 forward and dgrad, the weight gradient as a bf16
GEMM of the saved high-precision input (gemm_fp8 and grouped_gemm_fp8), and its fp32 main_grad mode."""

from __future__ import annotations

import importlib

import pytest
import torch
from ref.gemm_fp8_ref import gemm_ref
from ref.grouped_gemm_ref import grouped_gemm_grads_ref, grouped_gemm_ref, make_group_lens
from test_utils import assert_close, assert_snr, compute_snr, fp8_snr_gate

from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.core.float8_tensor import Float8Tensor
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8

# the modules (ops/__init__ re-exports the functions under the same names)
gemm_fp8_module = importlib.import_module("primus_turbo.pytorch.ops.gemm_fp8")
grouped_module = importlib.import_module("primus_turbo.pytorch.ops.grouped_gemm_fp8")

LAYOUTS = {"NN": (False, False), "NT": (False, True), "TN": (True, False)}
# A bf16 wgrad from bf16 operands sits ~50 dB from the fp64 product; an FP8 one at 25-32 dB: this gate
# tells them apart, so a silent fall back to the FP8 wgrad fails.
SNR_BF16_WGRAD_DB = 40.0


def _cfg(gran, fmt=Format.HYBRID, hp=True):
    return Float8QuantConfig(format=fmt, granularity=gran, high_precision_wgrad=hp)


def _record_transposed_quantization(monkeypatch, module, name):
    """Shapes of every tensor the op quantizes with a transposed copy."""
    seen, real = [], getattr(module, name)

    def spy(x, *args, **kwargs):
        seen.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_gemm_fp8_bf16_wgrad(gran, layout, device, monkeypatch):
    m, n, k = 136, 144, 160  # partial 128-blocks on every axis, all sizes distinct
    ta, tb = LAYOUTS[layout]
    a = torch.randn((k, m) if ta else (m, k), device=device, dtype=torch.bfloat16).requires_grad_()
    b = torch.randn((n, k) if tb else (k, n), device=device, dtype=torch.bfloat16).requires_grad_()
    seen = _record_transposed_quantization(monkeypatch, gemm_fp8_module, "quantize_fp8_with_transpose_impl")
    cfg = _cfg(gran)
    out = gemm_fp8(a, b, ta, tb, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ref_ga, ref_gb = gemm_ref(a, b, ta, tb, grad)
    gate = fp8_snr_gate(cfg.format)
    tag = f"{gran.name}/{layout}"
    assert_snr(out, ref, gate, f"{tag} out")
    assert_snr(a.grad, ref_ga, gate, f"{tag} dgrad")
    assert b.grad.dtype == b.dtype and b.grad.shape == b.shape
    assert_snr(b.grad, ref_gb, SNR_BF16_WGRAD_DB, f"{tag} wgrad")
    assert_close(b.grad, ref_gb, torch.bfloat16, f"{tag} wgrad")
    # no transposed (column-scaled) FP8 copy of the output gradient, nor of the activation unless its
    # forward operand is one (trans_a: a is stored [K, M])
    assert (m, n) not in seen and (ta or (m, k) not in seen), f"{tag}: transposed copies {seen}"


def test_gemm_fp8_bf16_wgrad_fails_without_the_flag(device):
    """The gate above is not loose: the FP8 wgrad misses it."""
    a = torch.randn(256, 192, device=device, dtype=torch.bfloat16).requires_grad_()
    b = torch.randn(160, 192, device=device, dtype=torch.bfloat16).requires_grad_()
    out = gemm_fp8(a, b, trans_b=True, config=_cfg(G.ROWWISE, hp=False))
    grad = torch.randn_like(out)
    out.backward(grad)
    _, _, ref_gb = gemm_ref(a, b, False, True, grad)
    assert compute_snr(ref_gb, b.grad) < SNR_BF16_WGRAD_DB


@pytest.mark.parametrize("cached", [False, True], ids=["weight", "float8_weight"])
def test_gemm_fp8_accumulates_into_main_grad(cached, device):
    x = torch.randn(96, 160, device=device, dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(144, 160, device=device, dtype=torch.bfloat16).requires_grad_()
    start = torch.randn(144, 160, device=device, dtype=torch.float32)
    w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = start.clone(), False, True
    cfg = _cfg(G.ROWWISE)
    b = Float8Tensor.from_tensor(w, torch.float8_e4m3fn, G.ROWWISE) if cached else w
    out = gemm_fp8(x, b, trans_b=True, out_dtype=torch.bfloat16, config=cfg, accumulate_into_main_grad=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = start.double() + grad.double().t() @ x.double()
    torch.testing.assert_close(w.main_grad.double(), want, rtol=1e-4, atol=1e-3)  # fp32, no bf16 rounding
    assert w.grad_added_to_main_grad and torch.count_nonzero(w.grad) == 0  # Megatron's placeholder
    assert_snr(x.grad, grad.double() @ w.double(), fp8_snr_gate(cfg.format), "dgrad")


def test_gemm_fp8_bf16_wgrad_bad_input(device):
    x = torch.randn(32, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(48, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.zeros(48, 64, device=device)
    with pytest.raises(ValueError, match="accumulate_into_main_grad=True needs config.high_precision_wgrad"):
        gemm_fp8(x, w, trans_b=True, config=_cfg(G.ROWWISE, hp=False), accumulate_into_main_grad=True)
    w.main_grad = torch.zeros(64, 48, device=device)
    with pytest.raises(ValueError, match="main_grad must match b"):
        gemm_fp8(x, w, trans_b=True, config=_cfg(G.ROWWISE), accumulate_into_main_grad=True)
    x8 = Float8Tensor.from_tensor(x, torch.float8_e4m3fn, G.ROWWISE)
    with pytest.raises(ValueError, match="high_precision_wgrad computes b's gradient from a's high-prec"):
        gemm_fp8(x8, w, trans_b=True, config=_cfg(G.ROWWISE))
    with pytest.raises(TypeError, match="high_precision_wgrad must be a bool"):
        Float8QuantConfig(high_precision_wgrad="yes")


@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("kind", ["skewed", "empty"])
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_grouped_gemm_fp8_bf16_wgrad(gran, kind, trans_b, device, monkeypatch):
    GlobalBackendManager.set_grouped_gemm_backend("TRITON" if device.type == "cuda" else "TORCH")
    groups, m, k, n = 4, 200, 256, 128  # m != groups * n: the weight's fused copy has another shape
    lens = make_group_lens(m, groups, kind, device)
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    shape = (groups, n, k) if trans_b else (groups, k, n)
    b = (torch.randn(shape, device=device, dtype=torch.bfloat16) / k**0.5).requires_grad_()
    seen = _record_transposed_quantization(monkeypatch, grouped_module, "quantize_fp8_with_transpose")
    cfg = _cfg(gran)
    out = grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    tag = f"{gran.name} {kind} trans_b={trans_b}"
    assert_snr(out, grouped_gemm_ref(a, b, lens, trans_b), fp8_snr_gate(Format.E4M3), f"out {tag}")
    ref_da, ref_db = grouped_gemm_grads_ref(a, b, lens, grad, trans_b)
    assert_snr(a.grad, ref_da, fp8_snr_gate(cfg.format), f"grad_a {tag}")
    for g in torch.nonzero(lens > 0).flatten().tolist():
        assert_snr(b.grad[g], ref_db[g], SNR_BF16_WGRAD_DB, f"grad_b expert {g} {tag}")
    assert_close(b.grad, ref_db, torch.bfloat16, f"grad_b {tag}")
    assert torch.count_nonzero(b.grad[lens == 0]) == 0, f"{tag}: an empty expert's wgrad is not zero"
    assert (m, k) not in seen and (m, n) not in seen, f"{tag}: transposed copies {seen}"


def test_grouped_gemm_fp8_bf16_wgrad_one_expert(device):
    a = torch.randn(64, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1, 96, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    lens = torch.tensor([64], device=device)
    out = grouped_gemm_fp8(a, b, lens, trans_b=True, config=_cfg(G.ROWWISE))
    grad = torch.randn_like(out)
    out.backward(grad)
    _, ref_db = grouped_gemm_grads_ref(a, b, lens, grad, True)
    assert_snr(b.grad, ref_db, SNR_BF16_WGRAD_DB, "one expert")


@pytest.mark.gpu
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_bf16_wgrad_training_shapes_gpu(gran):
    """Dense 4096x2048x5632 (cuBLAS FP8 + cuBLAS bf16 wgrad into main_grad) and 64 experts (CUTLASS)."""
    dev = torch.device("cuda")
    GlobalBackendManager.set_grouped_gemm_backend(None)
    cfg = _cfg(gran)
    x = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5632, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w.main_grad = torch.zeros(5632, 2048, device=dev)
    out = gemm_fp8(x, w, trans_b=True, config=cfg, accumulate_into_main_grad=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert_snr(w.main_grad, grad.double().t() @ x.double(), 60.0, "dense wgrad in fp32")
    lens = make_group_lens(8192, 64, "skewed", dev)
    a = torch.randn(8192, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = (torch.randn(64, 1408, 2048, device=dev, dtype=torch.bfloat16) / 2048**0.5).requires_grad_()
    out = grouped_gemm_fp8(a, b, lens, trans_b=True, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    _, ref_db = grouped_gemm_grads_ref(a, b, lens, grad, True)
    for g in torch.nonzero(lens > 0).flatten().tolist():
        assert_snr(b.grad[g], ref_db[g], SNR_BF16_WGRAD_DB, f"expert {g}")
