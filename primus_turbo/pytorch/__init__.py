"""PyTorch frontend: ``import primus_turbo.pytorch as turbo``; ``turbo.ops.*``, ``turbo.modules.*``."""

from primus_turbo.pytorch import modules, ops, optim
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.float8_tensor import Float8Tensor
from primus_turbo.pytorch.core.fp8_autocast import fp8_autocast, fp8_checkpoint_context_fn
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    Format,
    ScalingGranularity,
    ScalingStrategy,
)

__all__ = [
    "ops",
    "modules",
    "optim",
    "BackendType",
    "Float8Tensor",
    "fp8_autocast",
    "fp8_checkpoint_context_fn",
    "GlobalBackendManager",
    "Float8QuantConfig",
    "Format",
    "ScalingGranularity",
    "ScalingStrategy",
]
