"""Rotary position embedding kernels as torch custom ops: the Triton kernel on GPU / interpreter, the same
fp32 math in eager torch otherwise (and as the test twin). Inputs are validated already
(primus_turbo.pytorch.ops.rope): x [S, B, H, D] with unit stride along D; cos / sin contiguous fp32 [S, D]
holding cos / sin(freqs) * mscale already rounded to x's dtype."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.utils import eager_direct, triton_can_run_on

__all__ = ["rope_fwd", "rope_bwd", "rope_eager"]


def rope_eager(x, cos, sin, interleaved_input: bool, backward: bool) -> torch.Tensor:
    """fp32 twin of rope_kernel (one rounding of the result)."""
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


def _run(x, cos, sin, interleaved_input, backward):
    if not triton_can_run_on(x, cos, sin):
        return rope_eager(x, cos, sin, interleaved_input, backward)
    from primus_turbo.triton.rope.rope_kernel import launch_rope

    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_rope(x, cos, sin, out, interleaved_input, backward)
    return out


@eager_direct
@torch.library.custom_op("primus_turbo::rope_fwd", mutates_args=())
def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved_input: bool) -> torch.Tensor:
    return _run(x, cos, sin, interleaved_input, False)


@rope_fwd.register_fake
def _(x, cos, sin, interleaved_input):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@eager_direct
@torch.library.custom_op("primus_turbo::rope_bwd", mutates_args=())
def rope_bwd(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved_input: bool
) -> torch.Tensor:
    return _run(grad, cos, sin, interleaved_input, True)


@rope_bwd.register_fake
def _(grad, cos, sin, interleaved_input):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)
