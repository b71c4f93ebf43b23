"""fp64 reference for C = op(a) @ op(b) and its gradients."""

from __future__ import annotations

import torch


def _op(x: torch.Tensor, trans: bool) -> torch.Tensor:
    return x.t() if trans else x


def gemm_ref(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False) -> torch.Tensor:
    """op(a) @ op(b) in fp64 (fp32 for tensors too large to upcast cheaply is the caller's choice)."""
    return _op(a.detach().double(), trans_a) @ _op(b.detach().double(), trans_b)


def gemm_grads_ref(a, b, grad_out, trans_a: bool = False, trans_b: bool = False, acc=torch.float64):
    """(grad_a, grad_b) of op(a) @ op(b) through autograd, computed in ``acc`` precision."""
    a_ = a.detach().to(acc).requires_grad_()
    b_ = b.detach().to(acc).requires_grad_()
    (_op(a_, trans_a) @ _op(b_, trans_b)).backward(grad_out.detach().to(acc))
    return a_.grad, b_.grad
