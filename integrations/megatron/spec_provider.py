"""TurboSpecProvider: Megatron-Core's LocalSpecProvider with turbo leaf modules switched in per feature.

The patch registry (turbo_patches.py) turns features on after probing the turbo ops; a feature that is off
returns exactly what LocalSpecProvider returns, so ``turbo.enabled=false`` builds the stock local model.
Parameter names are those of the stock modules (weight, weight0..N-1 for grouped experts), so checkpoints move
between turbo on and off.
"""

from __future__ import annotations

import contextlib

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from omegaconf import DictConfig
from primus_turbo.integrations.common.patch_registry import ACTIVE, ReportRow


class TurboSpecProvider(LocalSpecProvider):
    """Feature switches (all False until the registry enables them): linear, attention, norm, grouped_mlp."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.linear = False
        self.attention = False
        self.norm = False
        self.grouped_mlp = False
        self.mla_qkv = False
        self.stock_core_attention = None  # a stock replacement set by a gap fix (fix.mla_core_attention)
        self.fp8_recipe = None  # a primus_turbo Float8QuantConfig when precision=fp8 is owned by turbo
        self.fp8_autocast = None

    # ---- BackendSpecProvider ----------------------------------------------------------------------------

    def column_parallel_linear(self) -> type:
        if self.linear:
            from primus_turbo.integrations.megatron.turbo_layers import TurboColumnParallelLinear

            return TurboColumnParallelLinear
        return super().column_parallel_linear()

    def row_parallel_linear(self) -> type:
        if self.linear:
            from primus_turbo.integrations.megatron.turbo_layers import TurboRowParallelLinear

            return TurboRowParallelLinear
        return super().row_parallel_linear()

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        if self.norm and rms_norm:
            from primus_turbo.integrations.megatron.turbo_layers import TurboRMSNorm

            return TurboRMSNorm
        return WrappedTorchNorm if rms_norm else super().layer_norm(rms_norm, for_qk)

    def mla_self_attention(self) -> type:
        if self.mla_qkv:
            from primus_turbo.integrations.megatron.turbo_mla import TurboMLASelfAttention

            return TurboMLASelfAttention
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        return MLASelfAttention

    def core_attention(self) -> type:
        if self.attention:
            from primus_turbo.integrations.megatron.turbo_layers import TurboCoreAttention

            return TurboCoreAttention
        if self.stock_core_attention is not None:
            return self.stock_core_attention
        return super().core_attention()

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        if self.grouped_mlp:
            from primus_turbo.integrations.megatron.turbo_layers import (
                TurboColumnParallelGroupedLinear,
                TurboRowParallelGroupedLinear,
            )
            from primus_turbo.integrations.megatron.turbo_moe import TurboGroupedMLP

            return TurboGroupedMLP, MLPSubmodules(
                linear_fc1=TurboColumnParallelGroupedLinear, linear_fc2=TurboRowParallelGroupedLinear
            )
        # Stock: SequentialMLP (GroupedMLP needs the external grouped_gemm package).
        return super().grouped_mlp_modules(False, False)

    # ---- plugin-side state ------------------------------------------------------------------------------

    @property
    def uses_grouped_gemm(self) -> bool:
        return self.grouped_mlp

    def fp8_context(self):
        """Context factory for the forward: turbo fp8_autocast when the plugin owns FP8, else a no-op."""
        if self.fp8_autocast is None:
            return contextlib.nullcontext
        autocast, recipe = self.fp8_autocast, self.fp8_recipe
        return lambda: autocast(enabled=True, config=recipe)

    def report_rows(self) -> list[ReportRow]:
        rows = []
        for what, fn in (
            ("spec.column_parallel_linear", self.column_parallel_linear),
            ("spec.row_parallel_linear", self.row_parallel_linear),
            ("spec.core_attention", self.core_attention),
            ("spec.rms_norm", lambda: self.layer_norm(rms_norm=True)),
        ):
            cls = fn()
            rows.append(ReportRow(what, ACTIVE, f"{cls.__module__}.{cls.__qualname__}"))
        if self.cfg.model.mla is not None:
            cls = self.mla_self_attention()
            rows.append(ReportRow("spec.mla_self_attention", ACTIVE, f"{cls.__module__}.{cls.__qualname__}"))
        if self.cfg.model.moe is not None:
            expert_cls, subs = self.grouped_mlp_modules(self.grouped_mlp, False)
            leaf = f" ({subs.linear_fc1.__qualname__}/{subs.linear_fc2.__qualname__})" if subs else ""
            target = f"{expert_cls.__module__}.{expert_cls.__qualname__}{leaf}"
            rows.append(ReportRow("spec.experts", ACTIVE, target))
        return rows
