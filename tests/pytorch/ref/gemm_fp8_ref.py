"""fp64 reference of C = op(a) @ op(b) and its gradients (what gemm_fp8 approximates in FP8)."""

from __future__ import annotations

import torch


def gemm_ref(a, b, trans_a: bool, trans_b: bool, grad_out: torch.Tensor):
    """Returns (out, grad_a, grad_b) in fp64 for high-precision a, b and an upstream gradient."""
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    out = (a64.t() if trans_a else a64) @ (b64.t() if trans_b else b64)
    out.backward(grad_out.double())
    return out.detach(), a64.grad, b64.grad
