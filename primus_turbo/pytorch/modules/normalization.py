"""``RMSNorm``: a replacement for ``torch.nn.RMSNorm(hidden_size)`` and Megatron's RMSNorm (same ``weight``
parameter name and shape, so state dicts load either way) over ``turbo.ops.rmsnorm``. Its default ``eps`` is
1e-6; torch's default is ``finfo(dtype).eps`` and Megatron's ``layernorm_epsilon`` 1e-5: pass the model's eps
to get the same numbers."""

from __future__ import annotations

import torch
from torch import nn

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.ops.normalization import rmsnorm, rmsnorm_residual

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learnable ``weight`` of shape [hidden_size].

    zero_centered_gamma: the parameter stores gamma - 1 and starts at 0 (Megatron's
    ``apply_layernorm_1p``); a torch.nn.RMSNorm checkpoint then needs ``weight - 1``.
    ``forward(x, residual)`` is the fused pre-norm residual and returns (norm(x + residual), x + residual).
    A weight whose dtype differs from x (fp32 master weights under bf16 activations) is cast to
    x.dtype for the call; its gradient flows back in the parameter's dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        backend: BackendType | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size < 0:
            raise ValueError(f"RMSNorm: hidden_size must be an int >= 0, got {hidden_size!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"RMSNorm: eps must be a number > 0, got {eps!r}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.zero_centered_gamma = bool(zero_centered_gamma)
        # parsed here, eagerly: forward (maybe under torch.compile) then passes a plain name
        if backend is not None:
            backend = BackendType.parse(backend, source="RMSNorm(backend=...)").name
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.zero_centered_gamma:
                self.weight.zero_()
            else:
                self.weight.fill_(1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if residual is None:
            return rmsnorm(x, weight, self.eps, self.zero_centered_gamma, self.backend)
        return rmsnorm_residual(x, residual, weight, self.eps, self.zero_centered_gamma, self.backend)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"
