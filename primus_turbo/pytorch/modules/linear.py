"""``turbo.modules.Linear``: a drop-in ``torch.nn.Linear`` whose matmul runs on ``turbo.ops.gemm``."""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_turbo.pytorch.core.fp8_autocast import DelayedScalingState, resolve_fp8_config
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingStrategy
from primus_turbo.pytorch.core.utils import autocast_cast
from primus_turbo.pytorch.ops.gemm import gemm
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

__all__ = ["Linear"]


class Linear(nn.Module):
    """y = x @ weight.T + bias over any leading dims, like ``torch.nn.Linear``.

    Same parameter names, shapes and initialisation as ``torch.nn.Linear`` (state dicts load both
    ways). Leading dims are flattened to one GEMM of [prod(leading), in_features].

    ``gradient_accumulation_fusion=True`` accumulates the weight gradient into ``weight.main_grad``
    (allocated by the caller, e.g. Megatron DDP) instead of ``weight.grad``; see ``ops.gemm``.

    FP8 seam: the GEMM is the single method ``_matmul(x2d)``; a low-precision variant (the FP8
    helper's config) overrides or branches there and nothing else changes.

    ``fp8_config`` (a ``Float8QuantConfig``) runs forward, dgrad and wgrad through
    ``turbo.ops.gemm_fp8``; without one, the layer follows ``turbo.fp8_autocast`` (FP8 inside
    ``fp8_autocast(enabled=True)``, high precision otherwise and inside ``enabled=False``).
    With FP8, ``gradient_accumulation_fusion`` needs ``high_precision_wgrad=True`` in the config (the
    weight gradient is then a bf16 GEMM summed into ``main_grad``); ``gemm_fp8`` says so otherwise.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        gradient_accumulation_fusion: bool = False,
        fp8_config: Float8QuantConfig | None = None,
    ) -> None:
        super().__init__()
        if fp8_config is not None and not isinstance(fp8_config, Float8QuantConfig):
            raise TypeError(
                f"fp8_config: expected a Float8QuantConfig or None, got {type(fp8_config).__name__}"
            )
        self.fp8_config = fp8_config
        self.fp8_delayed_state: DelayedScalingState | None = None
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Exactly torch.nn.Linear.reset_parameters (kaiming_uniform with a=sqrt(5)).
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.in_features
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        """[T, in_features] @ weight.T -> [T, out_features]. The FP8 seam."""
        fp8 = resolve_fp8_config(self.fp8_config, fp8_by_default=False)
        if fp8 is not None:
            return self._fp8_matmul(x2d, fp8)
        return gemm(
            x2d,
            self.weight,
            trans_b=True,
            accumulate_into_main_grad=self.gradient_accumulation_fusion,
        )

    def _fp8_accumulate(self, config: Float8QuantConfig) -> bool:
        """``accumulate_into_main_grad`` of an FP8 GEMM (gradient_accumulation_fusion: bf16 wgrad only)."""
        if self.gradient_accumulation_fusion and not config.high_precision_wgrad:
            raise ValueError(
                f"{type(self).__name__}: gradient_accumulation_fusion with FP8 needs high_precision_wgrad="
                "True in the Float8QuantConfig (a bf16 wgrad GEMM then sums into main_grad)"
            )
        return self.gradient_accumulation_fusion

    def _fp8_matmul(self, x2d: torch.Tensor, config: Float8QuantConfig) -> torch.Tensor:
        state = None
        if config.strategy is ScalingStrategy.DELAYED:
            if self.fp8_delayed_state is None or not self.fp8_delayed_state.matches(config):
                self.fp8_delayed_state = DelayedScalingState(config, device=self.weight.device)
            state = self.fp8_delayed_state
        return gemm_fp8(
            x2d, self.weight, trans_b=True, config=config, delayed_state=state,
            accumulate_into_main_grad=self._fp8_accumulate(config),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"Linear: input's last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}"
            )
        out = self._matmul(x.reshape(x.shape[:-1].numel(), self.in_features))  # not -1: in_features may be 0
        if self.bias is not None:
            out = out + autocast_cast(self.bias)  # under autocast, in its dtype as F.linear's bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )
