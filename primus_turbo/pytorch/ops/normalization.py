"""RMSNorm: ``rmsnorm(x, weight)`` and the fused pre-norm residual ``rmsnorm_residual(x, residual, weight)``.

    y = x * rsqrt(mean(x^2, -1) + eps) * w,   w = weight (+ 1 when zero_centered_gamma)

x: any leading dims, last dim = hidden (any size >= 0); weight: [hidden]; x, residual and weight share
one dtype (float32, float16 or bfloat16) and one device. Math in fp32; rstd is saved for the
backward. Backend per call: TURBO (csrc CUDA) > TRITON > TORCH, or pinned with ``backend=``
(see primus_turbo/pytorch/kernels/normalization/rmsnorm_impl.py).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.kernels.normalization.rmsnorm_impl import (
    SUPPORTED_DTYPES,
    rmsnorm_bwd,
    rmsnorm_bwd_impl,
    rmsnorm_fwd,
    rmsnorm_fwd_traced,
)

__all__ = ["rmsnorm", "rmsnorm_residual"]

# Backend names, built at import: parsing ``backend=`` is then a membership test / dict lookup that
# torch.compile (Dynamo) traces as constants on every torch version (no Enum-class ``__members__`` /
# ``BackendType[...]`` access inside the traced region). Strings never touch the enum-keyed dict.
_BACKEND_NAMES = frozenset(m.name for m in BackendType)
_ENUM_NAMES = {m: m.name for m in BackendType}
_ACCEPTED = ", ".join(m.name for m in BackendType)
_INF = float("inf")


def _backend_name(backend: BackendType | str, op: str) -> str:
    if isinstance(backend, str):
        name = backend.strip().upper()
        if name in _BACKEND_NAMES:
            return name
    elif isinstance(backend, BackendType):
        return _ENUM_NAMES[backend]
    raise ValueError(f"{op}: unknown backend {backend!r}; accepted: {_ACCEPTED} (case-insensitive)")


def _validate(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centered_gamma: bool,
    backend: BackendType | str | None,
    op: str,
) -> str:
    """Check every argument; return the backend name ('' = automatic)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: weight must be a torch.Tensor, got {type(weight).__name__}")
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim (last = hidden), got a 0-dim tensor")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: x dtype {x.dtype} is not supported; accepted: float32, float16, bfloat16")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight dtype {weight.dtype} != x dtype {x.dtype}; cast one so they match")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight must have shape [{x.shape[-1]}] (x.shape[-1]), got {list(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"{op}: weight is on {weight.device} but x is on {x.device}; use one device")
    if residual is not None:
        if not isinstance(residual, torch.Tensor):
            raise TypeError(f"{op}: residual must be a torch.Tensor, got {type(residual).__name__}")
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual shape {list(residual.shape)} != x shape {list(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual dtype {residual.dtype} != x dtype {x.dtype}")
        if residual.device != x.device:
            raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < _INF):
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")
    if isinstance(zero_centered_gamma, str) or zero_centered_gamma not in (True, False):
        # a string such as "false" would be truthy: the weight read as gamma - 1
        raise TypeError(f"{op}: zero_centered_gamma must be a bool, got {zero_centered_gamma!r}")
    if backend is None:
        return ""
    return _backend_name(backend, f"{op}(backend=...)")


def _rows(t: torch.Tensor | None) -> torch.Tensor | None:
    """[..., hidden] -> contiguous [rows, hidden] (a view when already contiguous)."""
    if t is None:
        return None
    rows = 1  # not reshape(-1, ...): ambiguous when hidden == 0; a loop, not math.prod, for Dynamo
    for d in t.shape[:-1]:
        rows = rows * d
    return t.reshape(rows, t.shape[-1]).contiguous()


class _RMSNormFunction(torch.autograd.Function):
    """Plain and residual variants; outputs (y,) or (y, x + residual)."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, zero_centered_gamma, backend):
        if not torch.compiler.is_compiling():
            # eager: an unused output's gradient stays None (no zero tensor is read). Dynamo does not
            # trace every ctx method on every torch version; compiled graphs materialise grads anyway.
            ctx.set_materialize_grads(False)
        x_rows, weight = _rows(x), weight.contiguous()
        fwd = rmsnorm_fwd_traced if torch.compiler.is_compiling() else rmsnorm_fwd  # see rmsnorm_impl.py
        y, sum_out, rstd = fwd(x_rows, _rows(residual), weight, float(eps), zero_centered_gamma, backend)
        # the backward needs the normalised input: x, or x + residual for the fused variant
        ctx.save_for_backward(x_rows if residual is None else sum_out, weight, rstd)
        ctx.zero_centered_gamma, ctx.backend = zero_centered_gamma, backend
        ctx.has_residual, ctx.x_shape = residual is not None, x.shape
        if residual is None:
            return y.view(x.shape)
        return y.view(x.shape), sum_out.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dsum=None):
        normalised, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(normalised)
        bwd = rmsnorm_bwd_impl if torch.compiler.is_compiling() else rmsnorm_bwd
        dx, dweight = bwd(
            _rows(dy),
            normalised,
            weight,
            rstd,
            _rows(dsum),
            ctx.zero_centered_gamma,
            ctx.backend,
        )
        dx = dx.view(ctx.x_shape)
        return dx, (dx if ctx.has_residual else None), dweight, None, None, None


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    zero_centered_gamma: bool = False,
    backend: BackendType | str | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x``; differentiable in x and weight.

    zero_centered_gamma: the stored weight is gamma - 1 (weight initialised to 0, Megatron's
    ``apply_layernorm_1p`` convention). backend: None (automatic) or 'TURBO' / 'TRITON' / 'TORCH'.
    """
    name = _validate(x, None, weight, eps, zero_centered_gamma, backend, "rmsnorm")
    return _RMSNormFunction.apply(x, None, weight, eps, bool(zero_centered_gamma), name)


def rmsnorm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    zero_centered_gamma: bool = False,
    backend: BackendType | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused pre-norm residual: s = x + residual (in x.dtype); returns (rmsnorm(s, weight), s).

    One pass over memory instead of an add kernel and a norm kernel; gradients flow to x and
    residual (both get d(s) = norm backward + the gradient of the returned s) and to weight.
    """
    name = _validate(x, residual, weight, eps, zero_centered_gamma, backend, "rmsnorm_residual")
    return _RMSNormFunction.apply(x, residual, weight, eps, bool(zero_centered_gamma), name)
