"""fp64 reference for RMSNorm (plain and fused residual) and its gradients."""

from __future__ import annotations

import torch


def _norm(s: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    w = weight + 1.0 if zero_centered_gamma else weight
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w


def rmsnorm_ref(x, weight, eps=1e-6, zero_centered_gamma=False, residual=None):
    """(y fp64, s): s = x + residual rounded to x.dtype (what the unfused ops produce), or x."""
    s = (x.detach() + residual.detach()) if residual is not None else x.detach()
    return _norm(s.double(), weight.detach().double(), eps, zero_centered_gamma), s


def rmsnorm_grads_ref(x, weight, dy, eps=1e-6, zero_centered_gamma=False, residual=None, dsum=None):
    """(dx, dweight) in fp64; dx is also d(residual) for the residual variant (+ dsum)."""
    s = (x.detach() + residual.detach()) if residual is not None else x.detach()
    s64 = s.double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    _norm(s64, w64, eps, zero_centered_gamma).backward(dy.detach().double())
    dx = s64.grad if dsum is None else s64.grad + dsum.detach().double()
    return dx, w64.grad
