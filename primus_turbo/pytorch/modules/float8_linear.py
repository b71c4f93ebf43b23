"""``turbo.modules.Float8Linear``: nn.Linear whose forward, dgrad and wgrad GEMMs run in FP8.

Same parameters, shapes, initialisation and state dict as ``torch.nn.Linear`` (it subclasses
``turbo.modules.Linear``); the FP8 recipe is ``config`` (a ``Float8QuantConfig``), else the config
of the active ``turbo.fp8_autocast``, else the default (E4M3 tensorwise, current scaling). Inside
``turbo.fp8_autocast(enabled=False)`` it runs the high-precision GEMM.

Weight quantization cache (``cache_weight=True``, off by default): the FP8 weight (both K-major
copies, one fused pass) is rebuilt only when the weight changes (``weight._version`` / storage), so
gradient-accumulation microbatches reuse one quantization per optimizer step. It is opt-in because
writes that do not bump ``weight._version`` (``weight.data.copy_``, FSDP all-gathers into a reused
unsharded buffer, optimizers that update a tensor sharing the storage) would otherwise leave a stale
FP8 weight silently in use; with the cache on, call ``layer.invalidate_weight_cache()`` after such
a write. DELAYED scaling owns a ``DelayedScalingState``
(amax histories for input, weight and output gradient; non-persistent buffers, so state dicts stay
nn.Linear-compatible) and quantizes the weight every call from its history.
"""

from __future__ import annotations

import torch
from torch import nn

from primus_turbo.pytorch.core.float8_tensor import Float8Tensor
from primus_turbo.pytorch.core.fp8_autocast import DelayedScalingState, resolve_fp8_config
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingStrategy
from primus_turbo.pytorch.modules.linear import Linear
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

__all__ = ["Float8Linear", "quantize_weight"]


def quantize_weight(weight: torch.Tensor, config: Float8QuantConfig) -> Float8Tensor:
    """A [out, in] weight as ``gemm_fp8(x, w8, trans_b=True)`` reads it: both K-major copies in one
    fused pass (128x128 tiles for BLOCKWISE); gradients flow back to ``weight``."""
    block = (
        (config.block_size, config.block_size) if config.granularity is ScalingGranularity.BLOCKWISE else None
    )
    return Float8Tensor.from_tensor(
        weight,
        config.format.fwd_dtype,
        config.granularity,
        block,
        power_of_two_scales=config.power_of_two_scales,
    )


class Float8Linear(Linear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        config: Float8QuantConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        cache_weight: bool = False,
    ) -> None:
        if config is not None and not isinstance(config, Float8QuantConfig):
            raise TypeError(
                f"Float8Linear: config must be a Float8QuantConfig or None, got {type(config).__name__}"
            )
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config
        self.cache_weight = bool(cache_weight)
        self._weight_cache: tuple[tuple, Float8Tensor] | None = None
        self.delayed_state: DelayedScalingState | None = None
        if config is not None and config.strategy is ScalingStrategy.DELAYED:
            self.delayed_state = DelayedScalingState(config, device=device)

    @classmethod
    def from_float(cls, linear: nn.Linear, config: Float8QuantConfig | None = None) -> Float8Linear:
        """Wrap an existing nn.Linear (or turbo Linear), sharing its Parameters (no copy).

        From a turbo Linear / Float8Linear it keeps ``gradient_accumulation_fusion``, ``cache_weight`` and,
        when ``config`` is None, its FP8 config (``fp8_config`` or ``config``); and the training mode."""
        if not isinstance(linear, nn.Linear | Linear):
            raise TypeError(f"Float8Linear.from_float: expected an nn.Linear, got {type(linear).__name__}")
        if config is None:
            config = getattr(linear, "config", None) or getattr(linear, "fp8_config", None)
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            config=config,
            device="meta",
            cache_weight=getattr(linear, "cache_weight", False),
        )
        new.gradient_accumulation_fusion = getattr(linear, "gradient_accumulation_fusion", False)
        new.train(linear.training)
        new.weight = linear.weight
        new.bias = linear.bias
        if new.delayed_state is not None:
            new.delayed_state = DelayedScalingState(config, device=linear.weight.device)
        return new

    def _quantized_weight(self, config: Float8QuantConfig) -> Float8Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device, config)
        if self._weight_cache is not None and self._weight_cache[0] == key:
            return self._weight_cache[1]
        w8 = quantize_weight(w, config)
        if self.cache_weight:
            self._weight_cache = (key, w8)
        return w8

    def invalidate_weight_cache(self) -> None:
        """Drop the cached FP8 weight (after a write that does not bump ``weight._version``)."""
        self._weight_cache = None

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        config = resolve_fp8_config(self.config, fp8_by_default=True)
        if config is None:
            return super()._matmul(x2d)
        if config.strategy is ScalingStrategy.DELAYED:
            if self.delayed_state is None or not self.delayed_state.matches(config):
                self.delayed_state = DelayedScalingState(config, device=self.weight.device)
            return gemm_fp8(
                x2d, self.weight, trans_b=True, config=config, delayed_state=self.delayed_state,
                accumulate_into_main_grad=self._fp8_accumulate(config),
            )  # fmt: skip
        return gemm_fp8(
            x2d, self._quantized_weight(config), trans_b=True, config=config,
            accumulate_into_main_grad=self._fp8_accumulate(config),
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, config={self.config}"
