"""fp8_autocast under activation checkpointing: the recomputed forward (run in backward, outside the block)
replays the original forward's autocast state through ``turbo.fp8_checkpoint_context_fn``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.fp8_autocast import fp8_autocast_state
from primus_turbo.pytorch.modules.linear import Linear


@pytest.mark.parametrize("enabled", [True, False])
def test_recompute_replays_the_forward_autocast_state(enabled):
    torch.manual_seed(0)
    cfg = turbo.Float8QuantConfig(granularity=turbo.ScalingGranularity.ROWWISE)
    layer = Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    dy = torch.randn(16, 32)
    with turbo.fp8_autocast(enabled=enabled, config=cfg):
        layer(x).backward(dy)
    want = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    with turbo.fp8_autocast(enabled=enabled, config=cfg):
        y = checkpoint(layer, x, use_reentrant=False, context_fn=turbo.fp8_checkpoint_context_fn)
    assert fp8_autocast_state() is None
    y.backward(dy)  # recomputes here, outside the block
    assert fp8_autocast_state() is None  # the replayed state is gone again
    assert torch.equal(x.grad, want[0]) and torch.equal(layer.weight.grad, want[1])
    if enabled:  # without the context_fn the recomputation runs in high precision: torch notices
        with turbo.fp8_autocast(enabled=True, config=cfg):
            y = checkpoint(layer, x, use_reentrant=False)
        with pytest.raises(Exception, match="(?i)recomput|checkpoint"):
            y.backward(dy)
