"""Float8Tensor: an already-quantized 2-D matrix (FP8 data + scale_inv + how it was scaled).

Pass one to ``turbo.ops.gemm_fp8`` instead of a high-precision tensor to quantize a weight once
per optimizer step rather than once per microbatch. It is a plain container, not a
``torch.Tensor`` subclass: autograd flows through ``source`` (the high-precision tensor it was made
from, if any), so ``gemm_fp8`` still returns a gradient for the master weight.

Layout: ``data`` [R, C] is scaled along C (its last axis); ``data_t`` [C, R] (optional) is the
transposed copy scaled along R. A GEMM reads the copy whose last axis is its reduction axis, so
forward and backward both find a K-major operand (sm_90 FP8 tensor cores need K-major).

``block_size``: None (TENSORWISE/ROWWISE), ``bs`` (1 x bs groups along the last axis, as for
activations) or ``(bs, bs)`` (2-D tiles, as for weights; ``scale_inv_t`` is ``scale_inv.T``).

``source`` must have data's shape and device. Its version counter is recorded at construction: once
``source`` is written in place (an optimizer step), the FP8 copies are stale and ``gemm_fp8`` refuses
them (build a new Float8Tensor per step; ``dataclasses.replace(x8, source=...)`` re-records).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from primus_turbo.pytorch.core.low_precision import ScalingGranularity, is_fp8_dtype

__all__ = ["Float8Tensor"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_scale_shapes(rows: int, cols: int, granularity: ScalingGranularity, block_size):
    """(scale_inv shape for data [rows, cols], scale_inv_t shape for data_t [cols, rows])."""
    if granularity is ScalingGranularity.TENSORWISE:
        return (), ()
    if granularity is ScalingGranularity.ROWWISE:
        return (rows, 1), (cols, 1)
    if isinstance(block_size, tuple):
        br, bc = block_size
        return (_cdiv(rows, br), _cdiv(cols, bc)), (_cdiv(cols, bc), _cdiv(rows, br))
    return (rows, _cdiv(cols, block_size)), (cols, _cdiv(rows, block_size))


@dataclass
class Float8Tensor:
    data: torch.Tensor
    scale_inv: torch.Tensor
    granularity: ScalingGranularity
    block_size: int | tuple[int, int] | None = None
    data_t: torch.Tensor | None = None
    scale_inv_t: torch.Tensor | None = None
    source: torch.Tensor | None = None  # high-precision origin: gradients flow to it
    # (id(source), source._version) when built; None where the counter cannot be read (inference tensors,
    # torch.compile tracing)
    _source_stamp: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.granularity, ScalingGranularity):
            raise TypeError(
                f"Float8Tensor.granularity: expected a ScalingGranularity, got {self.granularity!r}"
            )
        if (
            not isinstance(self.data, torch.Tensor)
            or not is_fp8_dtype(self.data.dtype)
            or self.data.dim() != 2
        ):
            raise TypeError(
                f"Float8Tensor.data: expected a 2-D float8_e4m3fn/float8_e5m2 tensor, got "
                f"{getattr(self.data, 'dtype', type(self.data).__name__)} "
                f"{tuple(getattr(self.data, 'shape', ()))}"
            )
        if isinstance(self.block_size, list):
            self.block_size = tuple(self.block_size)
        blockwise = self.granularity is ScalingGranularity.BLOCKWISE
        if blockwise != (self.block_size is not None):
            raise ValueError(
                f"Float8Tensor.block_size: required for BLOCKWISE and only for it, got "
                f"block_size={self.block_size!r} with {self.granularity.name}"
            )
        rows, cols = self.data.shape
        exp, exp_t = expected_scale_shapes(rows, cols, self.granularity, self.block_size)
        self._check_scale("scale_inv", self.scale_inv, exp, self.data)
        if self.data_t is not None:
            if self.data_t.shape != (cols, rows) or self.data_t.dtype != self.data.dtype:
                raise ValueError(
                    f"Float8Tensor.data_t: expected {self.data.dtype} of shape {(cols, rows)}, got "
                    f"{self.data_t.dtype} {tuple(self.data_t.shape)}"
                )
            self._check_scale("scale_inv_t", self.scale_inv_t, exp_t, self.data_t)
        self.check_source()
        if self.source is not None and not torch.compiler.is_compiling() and not self.source.is_inference():
            self._source_stamp = (id(self.source), self.source._version)

    def check_source(self, name: str = "Float8Tensor") -> None:
        """Raise unless ``source`` is None or a tensor of data's shape on data's device that was not written
        in place since this Float8Tensor was built (its FP8 copies would be silently stale)."""
        src = self.source
        if src is None:
            return
        stamp = self._source_stamp
        if stamp is not None and stamp[0] == id(src):  # the tensor checked when built: only its version
            if not torch.compiler.is_compiling() and src._version != stamp[1]:
                raise ValueError(
                    f"{name}: Float8Tensor.source was written in place after it was quantized (version "
                    f"{stamp[1]} -> {src._version}, e.g. an optimizer step): its FP8 copies are stale; "
                    "quantize the updated tensor again (Float8Tensor.from_tensor)"
                )
            return
        if (
            not isinstance(src, torch.Tensor)
            or src.shape != self.data.shape
            or src.device != self.data.device
        ):
            raise ValueError(
                f"{name}: Float8Tensor.source must be a tensor of data's shape {tuple(self.data.shape)} on "
                f"{self.data.device}, got {type(src).__name__} {tuple(getattr(src, 'shape', ()))} on "
                f"{getattr(src, 'device', None)}"
            )

    @staticmethod
    def _check_scale(name, scale, expected, data) -> None:
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError(
                f"Float8Tensor.{name}: expected a float32 tensor, got {getattr(scale, 'dtype', scale)}"
            )
        if tuple(scale.shape) != tuple(expected):
            raise ValueError(
                f"Float8Tensor.{name}: shape {tuple(scale.shape)} does not match data {tuple(data.shape)}; "
                f"expected {tuple(expected)}"
            )
        if scale.device != data.device:
            raise ValueError(f"Float8Tensor.{name}: on {scale.device}, data on {data.device}")

    @classmethod
    def from_tensor(
        cls,
        x: torch.Tensor,
        dtype: torch.dtype,
        granularity: ScalingGranularity,
        block_size: int | tuple[int, int] | None = None,
        *,
        with_transpose: bool = True,
        power_of_two_scales: bool = False,
    ) -> Float8Tensor:
        """Quantize a 2-D ``x``; ``with_transpose`` also builds the transposed copy in the same pass."""
        from primus_turbo.pytorch.ops.quantization import quantize_fp8, quantize_fp8_with_transpose

        kw = {"block_size": block_size, "power_of_two_scales": power_of_two_scales}
        if with_transpose:
            q, s, qt, st = quantize_fp8_with_transpose(x.detach(), dtype, granularity, **kw)
        else:
            (q, s), qt, st = quantize_fp8(x.detach(), dtype, granularity, **kw), None, None
        return cls(q, s, granularity, block_size, qt, st, source=x)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from primus_turbo.pytorch.ops.quantization import dequantize_fp8

        return dequantize_fp8(
            self.data, self.scale_inv, self.granularity, block_size=self.block_size, out_dtype=out_dtype
        )
