"""Rotary position embedding, forward and backward as one kernel each.

``apply_rotary_pos_emb``: rotate-half form, for [S, B, H, D] (Megatron's bshd layout).
``apply_rotary_emb_complex``: the complex (interleaved-pair) form of TorchTitan / DeepSeek on the last
``rope_dim`` elements of [B, S, H, D] rows, the rest copied (MLA's q = [q_nope, rope(q_pe)] in one pass).

``apply_rotary_pos_emb(t, freqs)`` equals Megatron-Core's ``_apply_rotary_pos_emb_bshd(t, freqs,
rotary_interleaved=False, multi_latent_attention=interleaved_input, mscale=mscale)`` for a rotary dim equal
to t's last dim, up to rounding: cos / sin are rounded to t's dtype as Megatron rounds them, the rest runs in
fp32 with one rounding of the result (Megatron's eager ops round after every multiply and the add).
``interleaved_input=True`` is MLA's layout (the rotary part of q / k arrives interleaved and leaves in
rotate-half order, as Megatron's strided cat does).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.kernels.rope.rope_impl import rope_bwd, rope_complex, rope_fwd

__all__ = ["apply_rotary_pos_emb", "apply_rotary_emb_complex", "clear_rope_cache"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, interleaved_input, nope):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved_input, ctx.nope = interleaved_input, nope
        return rope_fwd(t, cos, sin, interleaved_input, nope)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        grad = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        return rope_bwd(grad, cos, sin, ctx.interleaved_input, ctx.nope), None, None, None, None


# (id(freqs), data pointer, version, dtype, mscale) -> (freqs, cos, sin): Megatron's RotaryEmbedding returns
# one cached angle tensor for the whole run, so cos / sin are computed once, not on every call (two launches
# each). In-place writes bump the version and ``freqs.data = other`` moves the pointer; a write through
# ``freqs.data`` (``freqs.data.copy_(...)``) changes neither: call ``clear_rope_cache()`` after one.
_COS_SIN: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def clear_rope_cache() -> None:
    """Forget the cached cos / sin tables (after writing new angles through ``freqs.data``)."""
    _COS_SIN.clear()


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin(freqs) * mscale rounded to ``dtype`` as Megatron's eager RoPE rounds them, as fp32 [S, D]."""
    # Not cached: traced (computed in the graph; data_ptr does not trace), or an inference tensor (made under
    # torch.inference_mode: no version counter, so an in-place write of new angles could not be seen).
    cached = not torch.compiler.is_compiling() and not freqs.is_inference()
    key = (id(freqs), freqs.data_ptr(), freqs._version, dtype, mscale) if cached else None
    hit = _COS_SIN.get(key) if cached else None
    if hit is not None and hit[0] is freqs:
        return hit[1], hit[2]
    seq, dim = freqs.shape[0], freqs.shape[-1]
    f = freqs.reshape(seq, dim)
    cos = (torch.cos(f) * mscale).to(dtype).float().contiguous()
    sin = (torch.sin(f) * mscale).to(dtype).float().contiguous()
    if cached:
        if len(_COS_SIN) >= 16:
            _COS_SIN.clear()
        _COS_SIN[key] = (freqs, cos, sin)
    return cos, sin


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, *, interleaved_input: bool = False, mscale: float = 1.0,
    nope_dim: int = 0,
) -> torch.Tensor:  # fmt: skip
    """t [S, B, H, nope_dim + D] (any strides with unit stride along the last dim; float32/bf16/fp16), freqs
    [S, 1, 1, D] or [S, D] angles (D even, a power of two) -> a new contiguous tensor of t's shape: the first
    ``nope_dim`` elements of each row copied, the last D rotated (MLA's query ``cat([q_nope, rope(q_pe)])`` in
    one pass each way); differentiable in t."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype not in _FLOAT_DTYPES:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"apply_rotary_pos_emb: t must be a 4-D [S, B, H, D] float tensor, got {got}")
    if isinstance(nope_dim, bool) or not isinstance(nope_dim, int) or not 0 <= nope_dim < t.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: nope_dim={nope_dim!r} must be an int in [0, {t.shape[-1]})")
    seq, dim = t.shape[0], t.shape[-1] - nope_dim
    if (
        not isinstance(freqs, torch.Tensor)
        or freqs.numel() != seq * dim
        or freqs.shape[0] != seq
        or freqs.shape[-1] != dim  # e.g. [S, D / 2, 2] has the size but not the layout
    ):
        got = tuple(freqs.shape) if isinstance(freqs, torch.Tensor) else type(freqs).__name__
        raise ValueError(
            f"apply_rotary_pos_emb: freqs must be [S, 1, 1, D] or [S, D] with S={seq}, D={dim} (t's last "
            f"dim minus nope_dim={nope_dim}; a partial rotary dim with the pass-through part last is not "
            f"supported), got {got}"
        )
    if not freqs.is_floating_point():
        raise ValueError(
            f"apply_rotary_pos_emb: freqs must be real angles (a floating-point tensor, e.g. float32), got "
            f"{freqs.dtype}; complex freqs_cis are apply_rotary_emb_complex's input"
        )
    if dim < 2 or dim & (dim - 1):
        raise ValueError(f"apply_rotary_pos_emb: the rotary dim must be a power of two >= 2, got {dim}")
    if freqs.device != t.device:
        raise ValueError(f"apply_rotary_pos_emb: freqs on {freqs.device} but t on {t.device}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    cos, sin = _cos_sin(freqs, t.dtype, float(mscale))
    return _Rope.apply(t, cos, sin, bool(interleaved_input), nope_dim)


class _RopeComplex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, freqs, rope_dim):
        ctx.save_for_backward(freqs)
        ctx.rope_dim = rope_dim
        return rope_complex(x, freqs, rope_dim, False)

    @staticmethod
    def backward(ctx, grad_out):
        (freqs,) = ctx.saved_tensors
        grad = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        return rope_complex(grad, freqs, ctx.rope_dim, True), None, None


def apply_rotary_emb_complex(
    x: torch.Tensor, freqs_cis: torch.Tensor, rope_dim: int | None = None
) -> torch.Tensor:
    """TorchTitan's ``apply_rotary_emb`` (x times complex freqs_cis, pairs (2j, 2j + 1) as complex numbers, in
    fp32 with one rounding) on the last ``rope_dim`` (default: all) elements of x [B, S, H, D], the first
    D - rope_dim copied: a new contiguous [B, S, H, D] tensor, differentiable in x. freqs_cis: complex64
    [>= S, rope_dim / 2] (row s rotates position s, as with TorchTitan's positions=None)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.dtype not in _FLOAT_DTYPES:
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"apply_rotary_emb_complex: x must be a 4-D [B, S, H, D] float tensor, got {got}")
    dim, seq = x.shape[-1], x.shape[1]
    rope_dim = dim if rope_dim is None else rope_dim
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, (int, torch.SymInt)):  # SymInt: traced
        raise ValueError(f"apply_rotary_emb_complex: rope_dim must be an int or None, got {rope_dim!r}")
    if rope_dim < 2 or rope_dim % 2 or rope_dim > dim or dim % 2:
        raise ValueError(
            f"apply_rotary_emb_complex: rope_dim={rope_dim} must be even, >= 2 and <= x's last dim {dim} "
            "(itself even)"
        )
    if not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dtype != torch.complex64 or freqs_cis.dim() != 2:
        got = (f"{tuple(freqs_cis.shape)} {freqs_cis.dtype}" if isinstance(freqs_cis, torch.Tensor)
               else type(freqs_cis).__name__)  # fmt: skip
        raise ValueError(
            f"apply_rotary_emb_complex: freqs_cis must be complex64 [S, rope_dim / 2], got {got}"
        )
    if freqs_cis.shape[0] < seq or freqs_cis.shape[1] != rope_dim // 2:
        raise ValueError(
            f"apply_rotary_emb_complex: freqs_cis {tuple(freqs_cis.shape)} must cover S={seq} positions and "
            f"rope_dim / 2 = {rope_dim // 2} frequencies"
        )
    if freqs_cis.device != x.device:
        raise ValueError(f"apply_rotary_emb_complex: freqs_cis on {freqs_cis.device} but x on {x.device}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    freqs = torch.view_as_real(freqs_cis)
    if freqs.stride(-1) != 1 or freqs.stride(-2) != 2:
        freqs = freqs.contiguous()
    return _RopeComplex.apply(x, freqs, rope_dim)
