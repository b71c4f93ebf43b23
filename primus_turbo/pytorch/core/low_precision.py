"""FP8 formats, scaling granularities and the quantization config shared by every FP8 op."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

__all__ = [
    "Format",
    "ScalingGranularity",
    "ScalingStrategy",
    "Float8QuantConfig",
    "float8_e4m3",
    "float8_e5m2",
    "fp8_max",
    "is_fp8_dtype",
]

# Hopper uses the OCP "fn" E4M3 (max 448, no inf) and the IEEE-like E5M2 (max 57344).
float8_e4m3 = torch.float8_e4m3fn
float8_e5m2 = torch.float8_e5m2


def is_fp8_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    if not is_fp8_dtype(dtype):
        raise TypeError(f"fp8_max: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return float(torch.finfo(dtype).max)


class Format(Enum):
    """E4M3 everywhere, E5M2 everywhere, or HYBRID: E4M3 forward / E5M2 gradients."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return float8_e5m2 if self is Format.E5M2 else float8_e4m3

    @property
    def bwd_dtype(self) -> torch.dtype:
        return float8_e4m3 if self is Format.E4M3 else float8_e5m2


class ScalingGranularity(Enum):
    TENSORWISE = "TENSORWISE"  # one scale per tensor
    ROWWISE = "ROWWISE"  # one scale per row along the reduction axis
    BLOCKWISE = "BLOCKWISE"  # 1 x block for activations/gradients, block x block for weights


class ScalingStrategy(Enum):
    CURRENT = "CURRENT"  # scale from this tensor's amax (default)
    DELAYED = "DELAYED"  # scale from an amax history owned by the module (TENSORWISE only)


@dataclass(frozen=True)
class Float8QuantConfig:
    """How an FP8 op quantizes its operands.

    ``block_size`` is required by BLOCKWISE (default 128) and rejected otherwise.
    ``power_of_two_scales`` rounds every scale down to a power of two (exact rescaling).
    DELAYED scaling keeps ``amax_history_len`` amaxes and reduces them with ``amax_compute_algo``
    ("max" or "most_recent"); it applies to TENSORWISE only.
    ``high_precision_wgrad`` computes the weight gradient from the high-precision input and output
    gradient (a bf16 GEMM with fp32 accumulation) instead of their FP8 copies, as torchao's
    ``rowwise_with_gw_hp`` recipe does: the forward and dgrad GEMMs stay FP8, no transposed
    (column-scaled) copy of the input or the gradient is made, and the op saves the high-precision
    input for backward (2 bytes per element instead of 1).
    """

    format: Format = Format.E4M3
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    block_size: int | None = None
    power_of_two_scales: bool = False
    strategy: ScalingStrategy = ScalingStrategy.CURRENT
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    high_precision_wgrad: bool = False

    def __post_init__(self) -> None:
        for name in ("high_precision_wgrad", "power_of_two_scales"):  # a string like "false" would be truthy
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Float8QuantConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name, enum in (
            ("format", Format),
            ("granularity", ScalingGranularity),
            ("strategy", ScalingStrategy),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum):  # a string would never compare equal to a member
                members = ", ".join(f"{enum.__name__}.{m}" for m in enum.__members__)
                raise TypeError(
                    f"Float8QuantConfig.{name} must be a {enum.__name__} ({members}), got {value!r}"
                )
        # checked whatever the strategy: a bad value must not wait for dataclasses.replace(strategy=DELAYED)
        length = self.amax_history_len
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:  # True is not a length
            raise ValueError(
                f"Float8QuantConfig.amax_history_len must be an int >= 1, got {self.amax_history_len!r}"
            )
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"Float8QuantConfig.amax_compute_algo must be 'max' or 'most_recent', "
                f"got {self.amax_compute_algo!r}"
            )
        if self.granularity is ScalingGranularity.BLOCKWISE:
            if self.block_size is None:
                object.__setattr__(self, "block_size", 128)
            elif (
                not isinstance(self.block_size, int)
                or not 16 <= self.block_size <= 1024
                or self.block_size & (self.block_size - 1)
            ):  # what the kernels tile by
                raise ValueError(
                    f"Float8QuantConfig.block_size must be a power of two in [16, 1024] for BLOCKWISE, "
                    f"got {self.block_size!r}"
                )
        elif self.block_size is not None:
            raise ValueError(
                f"Float8QuantConfig.block_size is only used by BLOCKWISE granularity, "
                f"got block_size={self.block_size} with {self.granularity.name}"
            )
        if self.strategy is ScalingStrategy.DELAYED and self.granularity is not ScalingGranularity.TENSORWISE:
            raise ValueError(
                f"Float8QuantConfig: DELAYED scaling supports TENSORWISE granularity only, "
                f"got {self.granularity.name}"
            )
