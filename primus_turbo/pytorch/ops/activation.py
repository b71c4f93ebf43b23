"""Gated activations for MoE experts: swiglu / geglu, optionally scaled by router probs.

    y = act(x[:, :H]) * x[:, H:]                (swiglu: act = silu, geglu: act = exact gelu)
    y = act(x[:, :H]) * x[:, H:] * probs[:, None]   (the *_with_probs variants)

``x`` is ``[..., 2H]`` (any leading dims), ``probs`` has one value per row of ``x``: shape ``x.shape[:-1]``
or ``[rows]``, either optionally with a trailing 1 (Megatron's ``[T, 1]``). Fusing the
router probability into the activation saves one full read+write of the expert activations, which
is why Megatron-Core's permute-with-probs path applies probs here instead of in unpermute.
Forward and backward are single Triton kernels (fp32 math, storage dtype preserved); the probs
gradient is returned in the probs dtype.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.kernels.activation.activation_impl import glu_bwd, glu_fwd

__all__ = ["swiglu", "geglu", "swiglu_with_probs", "geglu_with_probs"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _validate(name: str, x: torch.Tensor, probs: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: x dtype {x.dtype} not supported; accepted: float32, bfloat16, float16")
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"{name}: x must be [..., 2H] with an even last dim, got shape {tuple(x.shape)}")
    if probs is None:
        return
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"{name}: probs must be a torch.Tensor, got {type(probs).__name__}")
    if probs.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name}: probs dtype {probs.dtype} not supported; accepted: float32, bfloat16, float16"
        )
    lead, rows = tuple(x.shape[:-1]), x.shape[:-1].numel()
    # the row layout of x or all rows flat, each with an optional trailing 1 (Megatron's [T, 1]); not any
    # shape of the right size: probs [S, B] against x [B, S, 2H] would scale the wrong rows
    accepted = (lead, (*lead, 1), (rows,), (rows, 1))
    if tuple(probs.shape) not in accepted:
        raise ValueError(
            f"{name}: probs must hold one value per row of x ({rows} rows, x shape {tuple(x.shape)}): "
            f"shape {lead}, {(*lead, 1)}, ({rows},) or ({rows}, 1), got probs shape {tuple(probs.shape)}"
        )
    if probs.device != x.device:
        raise ValueError(f"{name}: probs on {probs.device} but x on {x.device}")


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, act):
        lead = x.shape[:-1]
        x2 = x.reshape(lead.numel(), x.shape[-1]).contiguous()  # not -1: the last dim may be 0
        p = probs.reshape(-1).contiguous() if probs is not None else None
        out = glu_fwd(x2, p, act)
        ctx.save_for_backward(x2, p)
        ctx.act, ctx.x_shape = act, x.shape
        ctx.probs_shape = probs.shape if probs is not None else None
        ctx.probs_dtype = probs.dtype if probs is not None else None
        return out.reshape(*lead, x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, grad_out):
        x2, p = ctx.saved_tensors
        g = grad_out.reshape(x2.shape[0], x2.shape[1] // 2)
        grad_x, grad_p = glu_bwd(g, x2, p, ctx.act)
        grad_probs = None
        if p is not None:
            grad_probs = grad_p.to(ctx.probs_dtype).reshape(ctx.probs_shape)
        return grad_x.reshape(ctx.x_shape), grad_probs, None


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :H]) * x[..., H:]."""
    _validate("swiglu", x, None)
    return _GLU.apply(x, None, "silu")


def geglu(x: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :H]) * x[..., H:] (exact erf GeLU)."""
    _validate("geglu", x, None)
    return _GLU.apply(x, None, "gelu")


def swiglu_with_probs(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :H]) * x[..., H:] * probs[..., None]; probs has one value per row."""
    _validate("swiglu_with_probs", x, probs)
    return _GLU.apply(x, probs, "silu")


def geglu_with_probs(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """gelu(x[..., :H]) * x[..., H:] * probs[..., None]; probs has one value per row."""
    _validate("geglu_with_probs", x, probs)
    return _GLU.apply(x, probs, "gelu")
