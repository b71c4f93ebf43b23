"""Optimizers: ``turbo.optim.AdamW`` (torch's AdamW as one Triton pass per parameter, scaling fused)."""

from primus_turbo.pytorch.optim.adamw import AdamW

__all__ = ["AdamW"]
