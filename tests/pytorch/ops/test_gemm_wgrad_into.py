"""``gemm(a, b, trans_b=True, wgrad_into=w)``: b (a half-precision copy of the fp32 parameter w) gets no
gradient; the wgrad GEMM writes w.grad (fp32, unrounded) at the first backward and sums into it after, against
an fp64 reference over two backward passes."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

import primus_turbo.pytorch as turbo


def _reference(a, g):
    return g.double().t() @ a.double()  # dW of out = a @ W^T


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_gradient_is_written_then_accumulated_into_grad(dtype, device):
    w = torch.nn.Parameter(torch.randn(24, 40, device=device) / 40**0.5)
    b = w.detach().to(dtype)
    want = torch.zeros(24, 40, dtype=torch.float64, device=device)
    for _ in range(2):
        a = torch.randn(33, 40, device=device).to(dtype).requires_grad_()
        out = turbo.ops.gemm(a, b, trans_b=True, wgrad_into=w)
        g = torch.randn_like(out)
        out.backward(g)
        want += _reference(a.detach(), g)
        assert a.grad is not None and b.grad is None
    assert w.grad.dtype == torch.float32 and w.grad.shape == w.shape
    assert_close(w.grad.double() / want.abs().max(), want / want.abs().max(), dtype)


def test_a_cast_copy_that_requires_grad_does_not_add_a_second_gradient(device):
    """b = w.to(bf16) keeps w in b's autograd graph: b's own gradient (documented as none) would reach w.grad
    through the cast as well, doubling it."""
    w = torch.nn.Parameter(torch.randn(24, 40, device=device) / 40**0.5)
    a = torch.randn(33, 40, device=device).to(torch.bfloat16)
    out = turbo.ops.gemm(a, w.to(torch.bfloat16), trans_b=True, wgrad_into=w)
    g = torch.randn_like(out)
    out.backward(g)
    want = _reference(a, g)
    assert_close(w.grad.double() / want.abs().max(), want / want.abs().max(), torch.bfloat16)


def test_create_graph_hands_the_gradient_to_autograd(device):
    w = torch.nn.Parameter(torch.randn(8, 16, device=device))
    a = torch.randn(5, 16, device=device, requires_grad=True)
    out = turbo.ops.gemm(a, w.detach(), trans_b=True, wgrad_into=w)
    g = torch.randn_like(out)
    (gw,) = torch.autograd.grad(out, w, g, create_graph=True)
    assert w.grad is None
    assert_close(gw, _reference(a.detach(), g).float(), torch.float32)


def test_bad_wgrad_into_is_refused(device):
    w = torch.nn.Parameter(torch.randn(8, 16, device=device))
    a = torch.randn(5, 16, device=device)
    with pytest.raises(ValueError, match="leaf tensor that requires grad"):
        turbo.ops.gemm(a, w.detach(), trans_b=True, wgrad_into=w.detach())
    with pytest.raises(ValueError, match=r"expected b's shape \(8, 16\)"):
        turbo.ops.gemm(a, w.detach(), trans_b=True, wgrad_into=torch.nn.Parameter(torch.zeros(16, 8)))
