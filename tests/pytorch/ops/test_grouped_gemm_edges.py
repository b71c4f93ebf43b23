"""grouped_gemm / grouped_gemm_fp8 at the edges an audit found: a strided group_lens view, group lengths that
sum past M (out of contract, clipped the way the other backends clip), and main_grad_into weights whose
main_grad does not fit."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import grouped_gemm_grads_ref, grouped_gemm_ref
from test_utils import assert_close, assert_snr

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize("fp8", [False, True])
def test_strided_group_lens_view(fp8, device):
    """group_lens sliced out of a wider table (stride 2): the Triton kernels read it as contiguous."""
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    torch.manual_seed(0)
    table = torch.tensor([[20, 99], [0, 99], [28, 99], [16, 99]], device=device)
    lens = table[:, 0]
    assert not lens.is_contiguous() and lens.dtype == torch.int64
    a = torch.randn(64, 32, device=device).bfloat16().requires_grad_()
    b = (torch.randn(4, 24, 32, device=device) / 32**0.5).bfloat16().requires_grad_()
    grad_out = torch.randn(64, 24, device=device).bfloat16()
    if fp8:
        cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
        out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=True, config=cfg)
    else:
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
    out.backward(grad_out)
    ref = grouped_gemm_ref(a, b, lens.contiguous(), trans_b=True)
    ref_da, ref_db = grouped_gemm_grads_ref(a, b, lens.contiguous(), grad_out, trans_b=True)
    for name, got, want in (("out", out, ref), ("da", a.grad, ref_da), ("db", b.grad, ref_db)):
        if fp8:
            assert_snr(got, want, 20.0, name)
        else:
            assert_close(got, want, torch.bfloat16, name)


def test_group_lengths_past_m_are_clipped_like_the_other_backends(device):
    """sum(group_lens) > M is outside the contract (PRIMUS_TURBO_DEBUG_CHECKS=1 raises), but no group may
    move back over an earlier one: TRITON put group 1 of lens [5, 10] with M = 8 over rows [0, 8)."""
    torch.manual_seed(0)
    a = torch.randn(8, 16, device=device)
    b = torch.randn(2, 16, 12, device=device)
    lens = torch.tensor([5, 10], device=device)
    outs = {}
    for backend in ("TORCH", "TRITON"):
        GlobalBackendManager.set_grouped_gemm_backend(backend)
        outs[backend] = turbo.ops.grouped_gemm(a, b, lens)
    assert_close(outs["TRITON"][:5], a[:5] @ b[0], torch.float32, "group 0 rows")
    assert_close(outs["TRITON"], outs["TORCH"], torch.float32, "clipped like TORCH")


@pytest.mark.parametrize("fp8", [False, True])
def test_main_grad_into_checks_every_weight(fp8, device):
    """A main_grad of the wrong shape on any weight (not only the first) is refused in forward, naming it:
    the FP8 path wrote the gradients flat and unchecked (past the end of a short buffer)."""
    G, N, K = 3, 16, 32
    weights = [torch.nn.Parameter(torch.randn(N, K, device=device)) for _ in range(G)]
    for w in weights:
        w.main_grad = torch.zeros(N, K, device=device)
    weights[1].main_grad = torch.zeros(K, N, device=device)  # transposed
    b = torch.stack([w.detach() for w in weights]).bfloat16()
    a = torch.randn(24, K, device=device).bfloat16()
    lens = torch.tensor([8, 8, 8], device=device)
    op = turbo.ops.grouped_gemm_fp8 if fp8 else turbo.ops.grouped_gemm
    with pytest.raises(ValueError, match=r"main_grad_into\[1\].main_grad must be a tensor of shape \(16, 32"):
        op(a, b, lens, trans_b=True, main_grad_into=weights)


@pytest.mark.parametrize("fp8", [False, True])
def test_pinned_cutlass_answers_an_empty_batch(fp8, device):
    """An EP rank that receives no token (a = [0, K]) under a pinned CUTLASS: an empty output, a zero weight
    gradient, not "backend CUTLASS cannot handle these inputs"."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        pytest.skip("CUTLASS (torch._grouped_mm) runs on sm_90")
    GlobalBackendManager.set_grouped_gemm_backend("CUTLASS")
    a = torch.randn(0, 64, device=device).bfloat16().requires_grad_()
    b = torch.randn(4, 32, 64, device=device).bfloat16().requires_grad_()
    lens = torch.zeros(4, dtype=torch.int64, device=device)
    if fp8:
        cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
        out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=True, config=cfg)
    else:
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert a.grad.shape == (0, 64) and torch.equal(b.grad, torch.zeros_like(b))


@pytest.mark.parametrize("trans_b", ["false", 1, None])
def test_trans_b_must_be_a_bool(trans_b, device):
    """A truthy non-bool (the string "false") read b [G, K, N] as [G, N, K] when K == N, silently."""
    a = torch.randn(8, 16, device=device)
    b = torch.randn(2, 16, 16, device=device)
    with pytest.raises(TypeError, match="grouped_gemm: trans_b must be a bool"):
        turbo.ops.grouped_gemm(a, b, torch.tensor([4, 4], device=device), trans_b=trans_b)
