"""gemm_fp8 / grouped_gemm_fp8 API audit: stale or mismatched Float8Tensor inputs, DELAYED state checks,
the TT layout and microbatch reuse of one quantized weight (fp64 references, SNR gates)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ref.gemm_fp8_ref import gemm_ref
from test_utils import assert_snr, fp8_snr_gate

from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.core.float8_tensor import Float8Tensor
from primus_turbo.pytorch.core.fp8_autocast import DelayedScalingState
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingStrategy
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8

E4M3 = torch.float8_e4m3fn


def _weight_block(gran):
    return (128, 128) if gran is G.BLOCKWISE else None


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.name)
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_gemm_fp8_tt_layout(gran, fmt, backend, device):
    """trans_a and trans_b together (test_gemm_fp8 covers NN / NT / TN), sizes off the 128 block."""
    GlobalBackendManager.set_gemm_backend(backend, precision="fp8")
    a = torch.randn(144, 40, device=device, dtype=torch.bfloat16, requires_grad=True)  # [K, M]
    b = torch.randn(72, 144, device=device, dtype=torch.bfloat16, requires_grad=True)  # [N, K]
    cfg = Float8QuantConfig(format=fmt, granularity=gran)
    out = gemm_fp8(a, b, True, True, config=cfg)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ref_ga, ref_gb = gemm_ref(a, b, True, True, grad)
    gate = fp8_snr_gate(fmt)
    assert_snr(out, ref, gate, "TT out")
    assert_snr(a.grad, ref_ga, gate, "TT dgrad")
    assert_snr(b.grad, ref_gb, gate, "TT wgrad")


@pytest.mark.parametrize("hp_wgrad", [False, True])
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_one_float8_weight_two_microbatches_accumulates(gran, hp_wgrad, device):
    cfg = Float8QuantConfig(granularity=gran, high_precision_wgrad=hp_wgrad)
    w = torch.randn(64, 96, device=device, requires_grad=True)
    w8 = Float8Tensor.from_tensor(w, E4M3, gran, _weight_block(gran))
    xs = [torch.randn(40, 96, device=device), torch.randn(24, 96, device=device)]
    grads = [torch.randn(40, 64, device=device), torch.randn(24, 64, device=device)]
    for x, g in zip(xs, grads):
        gemm_fp8(x, w8, trans_b=True, config=cfg).backward(g)
    ref = sum(g.double().t() @ x.double() for x, g in zip(xs, grads))
    assert_snr(w.grad, ref, fp8_snr_gate(Format.E4M3), "wgrad summed over two microbatches")


def test_stale_float8tensor_is_refused(device):
    """A Float8Tensor used after its source was updated in place (an optimizer step) held the old values: the
    forward silently ran on the old weight (SNR -6 dB against the new one) while the gradient went to it."""
    x = torch.randn(40, 96, device=device)
    w = torch.randn(64, 96, device=device, requires_grad=True)
    w8 = Float8Tensor.from_tensor(w, E4M3, G.TENSORWISE)
    gemm_fp8(x, w8, trans_b=True)  # fresh: accepted
    with torch.no_grad():
        w.mul_(-1.0)
    with pytest.raises(ValueError, match=r"b: Float8Tensor.source was written in place"):
        gemm_fp8(x, w8, trans_b=True)
    x8 = Float8Tensor.from_tensor(x, E4M3, G.TENSORWISE)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(ValueError, match=r"a: Float8Tensor.source was written in place"):
        gemm_fp8(x8, w, trans_b=True)
    out = gemm_fp8(x, Float8Tensor.from_tensor(w, E4M3, G.TENSORWISE), trans_b=True)  # re-quantized
    assert_snr(out, x.double() @ w.detach().double().t(), fp8_snr_gate(Format.E4M3), "re-quantized weight")
    # a new container over the same FP8 copies re-records the version (the caller vouches for them)
    gemm_fp8(x, dataclasses.replace(w8, source=w), trans_b=True)


def test_float8tensor_source_must_match_data(device):
    """A source of another shape failed in backward with autograd's 'invalid gradient at index 1'."""
    w = torch.randn(64, 96, device=device)
    q, s = Float8Tensor.from_tensor(w, E4M3, G.TENSORWISE).data, torch.ones((), device=device)
    with pytest.raises(ValueError, match=r"source must be a tensor of data's shape \(64, 96\)"):
        Float8Tensor(q, s, G.TENSORWISE, source=torch.randn(96, 64, device=device))
    with pytest.raises(ValueError, match="source must be a tensor"):
        Float8Tensor(q, s, G.TENSORWISE, source=torch.randn(64, 96, device="meta"))
    w8 = Float8Tensor.from_tensor(w, E4M3, G.TENSORWISE)
    w8.source = torch.randn(96, 64, device=device, requires_grad=True)  # set after construction
    with pytest.raises(ValueError, match=r"b: Float8Tensor.source must be a tensor"):
        gemm_fp8(torch.randn(40, 96, device=device), w8, trans_b=True)


def test_float8tensor_on_another_device_than_a(device):
    """The device check skipped Float8Tensors: the dispatcher failed naming the backends instead."""
    w8 = Float8Tensor(
        torch.empty(64, 96, dtype=E4M3, device="meta"), torch.ones((), device="meta"), G.TENSORWISE
    )
    with pytest.raises(ValueError, match="a/b: on different devices"):
        gemm_fp8(torch.randn(40, 96, device=device), w8, trans_b=True)


def test_delayed_state_of_another_config_is_refused(device):
    """A DelayedScalingState with another history length / reduction than the config was used silently."""
    cfg = Float8QuantConfig(strategy=ScalingStrategy.DELAYED, amax_history_len=16)
    other = DelayedScalingState(dataclasses.replace(cfg, amax_history_len=4), device=device)
    x, w = torch.randn(40, 96, device=device), torch.randn(64, 96, device=device)
    with pytest.raises(ValueError, match=r"delayed_state: built for another amax history \(length 4"):
        gemm_fp8(x, w, trans_b=True, config=cfg, delayed_state=other)
    algo = DelayedScalingState(dataclasses.replace(cfg, amax_compute_algo="most_recent"), device=device)
    with pytest.raises(ValueError, match="most_recent"):
        gemm_fp8(x, w, trans_b=True, config=cfg, delayed_state=algo)
    with pytest.raises(ValueError, match="delayed_state: DELAYED scaling needs"):
        gemm_fp8(x, w, trans_b=True, config=cfg, delayed_state={"a": None})
    gemm_fp8(x, w, trans_b=True, config=cfg, delayed_state=DelayedScalingState(cfg, device=device))


def test_grouped_gemm_fp8_trans_b_must_be_bool(device):
    """trans_b="false" was truthy: b [G, K, N] read as [G, N, K] when K == N, silently."""
    a = torch.randn(32, 16, device=device)
    b = torch.randn(2, 16, 16, device=device)
    lens = torch.tensor([20, 12], device=device)
    with pytest.raises(TypeError, match="grouped_gemm_fp8: trans_b must be a bool, got 'false'"):
        grouped_gemm_fp8(a, b, lens, trans_b="false")


def test_triton_blockwise_second_block_size_same_shape(device):
    """The Triton FP8 GEMM's autotune key lacked SCALE_BLOCK while its pruning forces BLOCK_K == SCALE_BLOCK:
    a second block size at a shape already tuned reused the first one's BLOCK_K (garbage, no error)."""
    GlobalBackendManager.set_gemm_backend("TRITON", precision="fp8")
    x, w = torch.randn(40, 100, device=device), torch.randn(72, 100, device=device)
    ref = x.double() @ w.double().t()
    for bs in (128, 64):
        cfg = Float8QuantConfig(granularity=G.BLOCKWISE, block_size=bs)
        assert_snr(gemm_fp8(x, w, trans_b=True, config=cfg), ref, fp8_snr_gate(Format.E4M3), f"bs={bs}")
