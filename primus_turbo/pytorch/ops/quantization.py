"""FP8 quantization ops (not differentiable): quantize_fp8, dequantize_fp8, quantize_fp8_with_transpose.

Scaling groups and the shape of ``scale_inv`` (``x`` of shape ``(..., R, C)``):

=================================  ===============================  ==========================
granularity / arguments            one scale per                    scale_inv shape
=================================  ===============================  ==========================
TENSORWISE                         tensor                           ``()``
ROWWISE, axis=-1 (default)         row (amax along the last axis)   ``(..., R, 1)``
ROWWISE, axis=0 (2-D only)         column                           ``(1, C)``
BLOCKWISE, block_size=bs (int)     1 x bs along the last axis       ``(..., R, ceil(C/bs))``
BLOCKWISE, block_size=bs, axis=0   bs x 1 (2-D only)                ``(ceil(R/bs), C)``
BLOCKWISE, block_size=(br, bc)     br x bc tile (weights)           ``(..., ceil(R/br), ceil(C/bc))``
=================================  ===============================  ==========================

Activations and gradients use 1 x 128 (``block_size=128``), weights 128 x 128
(``block_size=(128, 128)``). Sizes that are not multiples of the block are fine: the last group is
partial (as if zero-padded). For 2-D inputs the 1 x bs ``scale_inv`` (both of them, with transpose) is
returned column-major (stride ``(1, R)``), the layout cuBLAS block-scaled GEMMs read; values and shape
are unaffected. Every other ``scale_inv`` is contiguous. ROWWISE and BLOCKWISE need at least 1 dim
(a 0-D ``x`` is an error).

Numerics: ``scale = fp8_max / amax`` (``amax == 0`` -> 1; capped at the fp32 max, which only groups
with amax below ~1e-36 reach: their values, fp32 denormals included, then quantize coarsely),
``scale_inv = 1 / scale``,
``q = cast(clamp(x * scale, +-fp8_max))``; ``dequantize(q) = q * scale_inv``.
``power_of_two_scales`` rounds ``scale`` down to a power of two (exact rescaling).

The ops are not differentiable: ``q`` and ``scale_inv`` never require grad, on every backend.

Non-finite inputs: the amax is taken over the *finite* values of each group, so an inf or NaN
does not destroy the scale of its neighbours; ``+-inf`` saturates to ``+-fp8_max`` (dequantizes to
``+-fp8_max * scale_inv``); ``NaN`` stays ``NaN``.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity, is_fp8_dtype
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    dequantize_fp8_impl,
    quantize_fp8_op,
    quantize_fp8_with_transpose_op,
)

__all__ = ["quantize_fp8", "dequantize_fp8", "quantize_fp8_with_transpose"]

_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_out_dtype(out_dtype, name: str = "out_dtype") -> None:
    if not isinstance(out_dtype, torch.dtype) or not is_fp8_dtype(out_dtype):
        raise TypeError(f"{name}: expected torch.float8_e4m3fn or torch.float8_e5m2, got {out_dtype!r}")


def _check_pow2(power_of_two_scales) -> bool:
    """A bool (or 0 / 1): a string such as "no" would otherwise read as true."""
    if isinstance(power_of_two_scales, (bool, int)) and power_of_two_scales in (0, 1):
        return bool(power_of_two_scales)
    raise TypeError(f"power_of_two_scales: expected True or False, got {power_of_two_scales!r}")


def _check_granularity(granularity) -> ScalingGranularity:
    if isinstance(granularity, str) and granularity.upper() in ScalingGranularity.__members__:
        return ScalingGranularity[granularity.upper()]
    if not isinstance(granularity, ScalingGranularity):
        raise TypeError(
            f"granularity: expected a ScalingGranularity (TENSORWISE/ROWWISE/BLOCKWISE), got {granularity!r}"
        )
    return granularity


def _check_block(b, name: str = "block_size") -> int:
    if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b > 1024 or b & (b - 1):
        raise ValueError(f"{name}: expected a power of two in [16, 1024], got {b!r}")
    return b


def normalize_spec(x_dim: int, granularity, block_size, axis) -> tuple[str, int | None, int, int]:
    """Validate (granularity, block_size, axis) for an x of x_dim dims.

    Returns (granularity name, axis in {None, -1, 0}, block_r, block_c) as the impl expects."""
    g = _check_granularity(granularity)
    if g is ScalingGranularity.TENSORWISE:
        if block_size is not None:
            raise ValueError(f"block_size: only used by BLOCKWISE, got {block_size!r} with TENSORWISE")
        if axis is not None:
            raise ValueError(f"axis: TENSORWISE has one scale per tensor, got axis={axis!r}; pass None")
        return "tensorwise", None, 0, 0
    if x_dim == 0:  # a 0-D tensor has no axis to scale along (its scale_inv shape would be made up)
        raise ValueError(f"x: {g.name} scales along an axis and needs at least 1 dim; use TENSORWISE for 0-D")
    if g is ScalingGranularity.ROWWISE and block_size is not None:
        raise ValueError(f"block_size: only used by BLOCKWISE, got {block_size!r} with ROWWISE")
    if g is ScalingGranularity.BLOCKWISE and isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size: a 2-D block is (rows, cols), got {block_size!r}")
        br, bc = (_check_block(b, "block_size") for b in block_size)
        if axis is not None:
            raise ValueError(f"axis: a 2-D block_size {tuple(block_size)} takes no axis, got axis={axis!r}")
        if x_dim < 2:
            raise ValueError(f"x: 2-D blocks need at least 2 dims, got {x_dim}")
        return "blockwise", None, br, bc
    axis = -1 if axis is None else axis
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis: expected an int, got {axis!r}")
    if axis in (-1, x_dim - 1):
        axis = -1
    elif axis in (0, -2) and x_dim == 2:
        axis = 0
    else:
        raise ValueError(
            f"axis: expected -1 (the last axis, any ndim) or 0/-2 (2-D tensors only), got axis={axis} "
            f"for a {x_dim}-D tensor"
        )
    if g is ScalingGranularity.ROWWISE:
        return "rowwise", axis, 0, 0
    bs = _check_block(128 if block_size is None else block_size)
    return ("blockwise", 0, bs, 1) if axis == 0 else ("blockwise", -1, 1, bs)


def _check_input(x, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _HP_DTYPES:
        raise TypeError(f"{name}: expected float32, bfloat16 or float16, got {x.dtype}")


def quantize_fp8(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: ScalingGranularity,
    *,
    block_size: int | tuple[int, int] | None = None,
    axis: int | None = None,
    power_of_two_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8. Returns ``(q, scale_inv)`` with ``x ~= q.float() * scale_inv``
    (scale_inv broadcast over its groups, see the module docstring for the shapes)."""
    _check_input(x)
    _check_out_dtype(out_dtype)
    g, ax, br, bc = normalize_spec(x.dim(), granularity, block_size, axis)
    x = x.detach() if x.requires_grad else x  # not differentiable (module doc)
    return quantize_fp8_op(x, out_dtype, g, ax, br, bc, _check_pow2(power_of_two_scales))


def quantize_fp8_with_transpose(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: ScalingGranularity,
    *,
    block_size: int | tuple[int, int] | None = None,
    power_of_two_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a 2-D ``x`` (R, C) into the two copies a GEMM's forward and backward need, in one pass.

    Returns ``(q, scale_inv, q_t, scale_inv_t)``: ``q`` (R, C) scaled along C (as ``quantize_fp8``
    with axis=-1) and ``q_t`` (C, R) = the transpose of x, contiguous, scaled along R. TENSORWISE:
    both share one scale. ROWWISE: (R, 1) and (C, 1). BLOCKWISE int bs: (R, C/bs) and (C, R/bs).
    BLOCKWISE (br, bc): (R/br, C/bc) and its transpose (C/bc, R/br).
    """
    _check_input(x)
    _check_out_dtype(out_dtype)
    if x.dim() != 2:
        raise ValueError(f"x: quantize_fp8_with_transpose takes a 2-D tensor, got shape {tuple(x.shape)}")
    g, _, br, bc = normalize_spec(2, granularity, block_size, None)
    x = x.detach() if x.requires_grad else x  # not differentiable (module doc)
    return quantize_fp8_with_transpose_op(x, out_dtype, g, br, bc, _check_pow2(power_of_two_scales))


def dequantize_fp8(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    granularity: ScalingGranularity,
    *,
    block_size: int | tuple[int, int] | None = None,
    axis: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Inverse of ``quantize_fp8`` (same granularity/block_size/axis): ``q * scale_inv``."""
    if not isinstance(q, torch.Tensor) or not is_fp8_dtype(q.dtype):
        raise TypeError(
            f"q: expected an FP8 tensor (float8_e4m3fn/float8_e5m2), got {getattr(q, 'dtype', q)}"
        )
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32:
        raise TypeError(f"scale_inv: expected a float32 tensor, got {getattr(scale_inv, 'dtype', scale_inv)}")
    if out_dtype not in _HP_DTYPES:
        raise TypeError(f"out_dtype: expected float32, bfloat16 or float16, got {out_dtype}")
    g, ax, br, bc = normalize_spec(q.dim(), granularity, block_size, axis)
    expected = expected_scale_shape(tuple(q.shape), g, ax, br, bc)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv: shape {tuple(scale_inv.shape)} does not match q {tuple(q.shape)} with "
            f"{g.upper()} block_size={block_size} axis={axis}; expected {expected}"
        )
    return dequantize_fp8_impl(q, scale_inv, g, ax, br, bc, out_dtype)


def expected_scale_shape(shape: tuple, g: str, axis, br: int, bc: int) -> tuple:
    """scale_inv shape for a tensor of ``shape`` under a normalized spec (see ``normalize_spec``)."""
    cdiv = lambda a, b: -(-a // b)
    if g == "tensorwise":
        return ()
    if g == "rowwise":
        return (1, shape[1]) if axis == 0 else (*shape[:-1], 1)
    if axis is None:
        return (*shape[:-2], cdiv(shape[-2], br), cdiv(shape[-1], bc))
    if axis == 0:
        return (cdiv(shape[0], br), shape[1])
    return (*shape[:-1], cdiv(shape[-1], bc))
