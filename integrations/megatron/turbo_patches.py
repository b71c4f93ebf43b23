"""Turbo feature entries of the Megatron-Core patch registry (importing this module registers them)."""

from __future__ import annotations

from primus_turbo.integrations.megatron.patches import REGISTRY, TESTED, _needs_moe, _needs_op  # noqa: F401
