"""fp64 references for the gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def glu_ref(x: torch.Tensor, probs: torch.Tensor | None, act: str) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    y = (F.silu(gate) if act == "silu" else F.gelu(gate)) * up
    if probs is not None:
        y = y * probs.double().reshape(*y.shape[:-1], 1)
    return y
