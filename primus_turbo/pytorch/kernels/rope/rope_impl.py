"""Rotary position embedding kernels as torch custom ops: the Triton kernel on GPU / interpreter, the same
fp32 math in eager torch otherwise (and as the test twin). Inputs are validated already
(primus_turbo.pytorch.ops.rope): x [S, B, H, nope + D] with unit stride along the last dim (the first
``nope`` elements pass through); cos / sin contiguous fp32 [S, D] holding cos / sin(freqs) * mscale already
rounded to x's dtype."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.utils import eager_direct, triton_can_run_on

__all__ = ["rope_fwd", "rope_bwd", "rope_eager", "rope_complex", "rope_complex_eager"]


def rope_eager(x, cos, sin, interleaved_input: bool, backward: bool, nope: int = 0) -> torch.Tensor:
    """fp32 twin of rope_kernel (one rounding of the result); the first ``nope`` elements pass through."""
    if nope:
        rotated = rope_eager(x[..., nope:], cos, sin, interleaved_input, backward)
        return torch.cat([x[..., :nope], rotated], dim=-1)
    half = cos.shape[-1] // 2
    c, s = cos[:, None, None, :], sin[:, None, None, :]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    xf = x.float()
    if not backward:
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved_input else (xf[..., :half], xf[..., half:])
        return torch.cat([x1 * c1 - x2 * s1, x2 * c2 + x1 * s2], dim=-1).to(x.dtype)
    g1, g2 = xf[..., :half], xf[..., half:]
    d1, d2 = g1 * c1 + g2 * s2, g2 * c2 - g1 * s1
    if interleaved_input:
        return torch.stack([d1, d2], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([d1, d2], dim=-1).to(x.dtype)


def _run(x, cos, sin, interleaved_input, backward, nope):
    if not triton_can_run_on(x, cos, sin):
        return rope_eager(x, cos, sin, interleaved_input, backward, nope)
    from primus_turbo.triton.rope.rope_kernel import launch_rope

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_rope(x, cos, sin, out, interleaved_input, backward, nope)
    return out


@eager_direct
@torch.library.custom_op("primus_turbo::rope_fwd", mutates_args=())
def rope_fwd(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved_input: bool, nope: int = 0
) -> torch.Tensor:
    return _run(x, cos, sin, interleaved_input, False, nope)


@rope_fwd.register_fake
def _(x, cos, sin, interleaved_input, nope=0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@eager_direct
@torch.library.custom_op("primus_turbo::rope_bwd", mutates_args=())
def rope_bwd(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved_input: bool, nope: int = 0
) -> torch.Tensor:
    return _run(grad, cos, sin, interleaved_input, True, nope)


@rope_bwd.register_fake
def _(grad, cos, sin, interleaved_input, nope=0):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


# -- complex (interleaved-pair) form on the tail of the last dim: TorchTitan / DeepSeek MLA ---------------


def rope_complex_eager(x, freqs, rope_dim: int, backward: bool) -> torch.Tensor:
    """fp32 twin of rope_complex_kernel: x [B, S, H, D]; freqs fp32 [>= S, rope_dim / 2, 2]."""
    seq, nope = x.shape[1], x.shape[-1] - rope_dim
    pe = x[..., nope:].float().unflatten(-1, (-1, 2))
    c, s = freqs[:seq, None, :, 0], freqs[:seq, None, :, 1]
    s = -s if backward else s
    xr, xi = pe[..., 0], pe[..., 1]
    rot = torch.stack([xr * c - xi * s, xr * s + xi * c], dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :nope], rot], dim=-1)


@eager_direct
@torch.library.custom_op("primus_turbo::rope_complex", mutates_args=())
def rope_complex(x: torch.Tensor, freqs: torch.Tensor, rope_dim: int, backward: bool) -> torch.Tensor:
    """x [B, S, H, D] (unit stride along D) with its last ``rope_dim`` elements rotated by freqs (fp32
    [>= S, rope_dim / 2, 2]; conjugated when ``backward``), the rest copied; a new contiguous tensor."""
    if not triton_can_run_on(x, freqs):
        return rope_complex_eager(x, freqs, rope_dim, backward)
    from primus_turbo.triton.rope.rope_complex_kernel import launch_rope_complex

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_rope_complex(x, freqs, out, rope_dim, backward)
    return out


@rope_complex.register_fake
def _(x, freqs, rope_dim, backward):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
