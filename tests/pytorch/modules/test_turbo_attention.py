"""TurboAttention: every layout equals flash_attn_func on the same data; sinks learn."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_utils import assert_close

from primus_turbo.pytorch.modules.attention import TurboAttention
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_varlen_func


def _bshd(b=2, s=24, h=4, hk=2, d=16):
    return (torch.randn(b, s, h, d), torch.randn(b, s, hk, d), torch.randn(b, s, hk, d))


def test_sbhd_megatron_layout():
    q, k, v = _bshd()
    ref = flash_attn_func(q, k, v, causal=True)
    mod = TurboAttention(causal=True, layout="sbhd")
    out = mod(*(t.transpose(0, 1).contiguous() for t in (q, k, v)), None)
    assert out.shape == (24, 2, 4 * 16)
    assert_close(out, ref.transpose(0, 1).reshape(24, 2, -1), torch.float32, "sbhd")


def test_bhsd_torchtitan_layout_with_window():
    q, k, v = _bshd()
    ref = flash_attn_func(q, k, v, causal=True, window_size=(5, -1))
    mod = TurboAttention(causal=True, window_size=(5, -1), layout="bhsd")
    out = mod(*(t.transpose(1, 2) for t in (q, k, v)))
    assert_close(out, ref.transpose(1, 2), torch.float32, "bhsd")


def test_packed_seq_params_varlen():
    lens = [5, 1, 10]
    cu = torch.tensor([0, 5, 6, 16], dtype=torch.int32)
    q, k, v = (torch.randn(16, 2, 8) for _ in range(3))
    params = SimpleNamespace(
        cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens), max_seqlen_kv=max(lens)
    )
    out = TurboAttention(causal=True, layout="sbhd")(
        q[:, None], k[:, None], v[:, None], packed_seq_params=params
    )
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 10, 10, causal=True)
    assert_close(out, ref.reshape(16, -1), torch.float32, "thd")


def test_sink_parameter_gets_gradient():
    mod = TurboAttention(causal=False, num_sink_heads=4)
    q, k, v = _bshd()
    mod(q, k, v).square().sum().backward()
    assert mod.sink.grad is not None and mod.sink.grad.abs().sum() > 0


def test_bad_layout():
    with pytest.raises(ValueError, match="layout"):
        TurboAttention(layout="bsh")
