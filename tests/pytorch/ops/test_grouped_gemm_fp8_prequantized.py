"""turbo.ops.grouped_gemm_fp8 with a pre-quantized weight (``quantize_grouped_weight``): the same numbers as
quantizing on every call, gradients to ``source``, and the checks on mismatched weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ref.grouped_gemm_ref import grouped_gemm_grads_ref, make_group_lens
from test_utils import assert_snr, fp8_snr_gate

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import (
    GroupedFloat8Weight,
    grouped_gemm_fp8,
    quantize_grouped_weight,
)


def _inputs(G, M, K, N, kind, device):
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    b = (torch.randn(G, N, K, device=device) / K**0.5).bfloat16()
    return a, b, make_group_lens(M, G, kind, device), torch.randn(M, N, dtype=torch.bfloat16, device=device)


def _fwd_bwd(a, b, lens, grad_out, config):
    """(out, da, db) with b a tensor or a GroupedFloat8Weight (db from its source)."""
    a = a.detach().clone().requires_grad_(True)
    out = grouped_gemm_fp8(a, b, lens, trans_b=True, config=config)
    out.backward(grad_out)
    source = b.source if isinstance(b, GroupedFloat8Weight) else b
    return out.detach(), a.grad, source.grad


@pytest.mark.parametrize("granularity", list(ScalingGranularity))
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
@pytest.mark.parametrize("N", [160, 256])  # 256: BLOCKWISE takes the fused dgrad copy too
def test_prequantized_weight_matches_per_call_quantization(granularity, fmt, N, device):
    config = Float8QuantConfig(format=fmt, granularity=granularity)
    a, b, lens, grad_out = _inputs(3, 96, 128, N, "skewed", device)
    per_call = _fwd_bwd(a, b.clone().requires_grad_(True), lens, grad_out, config)
    w8 = quantize_grouped_weight(b.clone().requires_grad_(True), config)
    assert w8.shape == (3, N, 128) and w8.data.dtype == fmt.fwd_dtype
    for microbatch in range(2):  # reused: the same numbers each time
        got = _fwd_bwd(a, w8, lens, grad_out, config)
        for name, x, y in zip(("out", "grad_a", "grad_b"), got, per_call, strict=True):
            assert torch.equal(x, y * (microbatch + 1) if name == "grad_b" else y), f"{name} mb {microbatch}"
    ref_da, ref_db = grouped_gemm_grads_ref(a, b, lens, grad_out, True)
    gate = fp8_snr_gate(fmt)
    assert_snr(per_call[1], ref_da, gate, "grad_a vs reference")
    live = lens > 0
    assert_snr(per_call[2][live], ref_db[live], gate, "grad_b vs reference")


def test_prequantized_weight_gradient_goes_to_a_stand_in_source(device):
    """The op never reads source's values: a zero-storage stand-in carries the gradient."""
    config = Float8QuantConfig(format=Format.HYBRID, granularity=ScalingGranularity.ROWWISE)
    a, b, lens, grad_out = _inputs(4, 128, 128, 128, "empty", device)
    expected = _fwd_bwd(
        a, quantize_grouped_weight(b.clone().requires_grad_(True), config), lens, grad_out, config
    )
    stand_in = torch.zeros((), dtype=b.dtype, device=device).expand(b.shape).requires_grad_(True)
    got = _fwd_bwd(
        a, dataclasses.replace(quantize_grouped_weight(b, config), source=stand_in), lens, grad_out, config
    )
    for x, y in zip(got, expected, strict=True):
        assert torch.equal(x, y)
    no_grad = quantize_grouped_weight(b, config)
    no_grad.source = None
    assert torch.equal(grouped_gemm_fp8(a, no_grad, lens, config=config), expected[0])


def test_prequantized_weight_with_zero_tokens(device):
    config = Float8QuantConfig()
    b = torch.randn(2, 32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    a = torch.randn(0, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = grouped_gemm_fp8(
        a, quantize_grouped_weight(b, config), torch.zeros(2, dtype=torch.int64, device=device)
    )
    assert out.shape == (0, 32)
    out.sum().backward()
    assert b.grad.shape == b.shape and torch.count_nonzero(b.grad) == 0


def test_prequantized_weight_refuses_mismatches(device):
    a = torch.randn(16, 64, dtype=torch.bfloat16, device=device)
    lens = torch.tensor([16, 0], device=device)
    w8 = quantize_grouped_weight(torch.randn(2, 32, 64, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="trans_b=True"):
        grouped_gemm_fp8(a, w8, lens, trans_b=False)
    with pytest.raises(ValueError, match="config asks ROWWISE"):
        grouped_gemm_fp8(a, w8, lens, config=Float8QuantConfig(granularity=ScalingGranularity.ROWWISE))
    with pytest.raises(ValueError, match="config asks"):
        grouped_gemm_fp8(a, w8, lens, config=Float8QuantConfig(format=Format.E5M2))
    with pytest.raises(ValueError, match="reduction dims differ"):
        grouped_gemm_fp8(a[:, :32], w8, lens)
    with pytest.raises(TypeError, match="3-D"):
        quantize_grouped_weight(torch.randn(32, 64, device=device))
