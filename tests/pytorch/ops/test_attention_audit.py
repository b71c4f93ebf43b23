"""Attention audit: refusals of a pinned backend say which argument and what is accepted; causal ring
attention refuses seqlen_q != seqlen_k (its zigzag plan is wrong there); softmax_scale is checked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.kernels.attention import attention_impl
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_usp_func


def _qkv(d=16, dv=16, dtype=torch.float32):
    q = torch.randn(1, 8, 2, d, dtype=dtype)
    k = torch.randn(1, 8, 1, d, dtype=dtype)
    v = torch.randn(1, 8, 1, dv, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize(
    "backend, dims, kwargs, match",
    [
        ("TRITON", (320, 16), {}, r"head dims q/k 320, v 16 \(accepted: 1\.\.256 each\)"),
        ("TRITON", (16, 300), {}, r"head dims q/k 16, v 300 \(accepted: 1\.\.256 each\)"),
        ("TRITON", (16, 16), dict(dropout_p=0.1), r"dropout_p=0\.1 \(accepted: 0\.0"),
        ("CUDNN", (16, 16), dict(sink=torch.zeros(2)), r"refuses (q on cpu|sink)"),
        ("FLASH", (16, 16), dict(return_lse=True), r"refuses (q on cpu|return_lse=True)"),
    ],
)
def test_pinned_backend_refusal_names_the_argument(backend, dims, kwargs, match):
    """The dispatcher's message listed every input but not which one the pinned backend refused."""
    GlobalBackendManager.set_attention_backend(backend)
    q, k, v = _qkv(*dims)
    with pytest.raises(ValueError, match=match) as err:
        flash_attn_func(q, k, v, **kwargs)
    assert backend in str(err.value) and "set_attention_backend" in str(err.value)


def test_env_pinned_triton_refusal_names_the_argument(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"PRIMUS_TURBO_ATTENTION_BACKEND\) refuses dropout_p=0\.2"):
        flash_attn_func(*_qkv(), dropout_p=0.2)


def test_pinned_triton_refuses_fp32_outside_the_interpreter(monkeypatch):
    """On the GPU TRITON takes fp16/bf16 only: fp32 is refused by name, never run on another backend."""
    monkeypatch.setattr(attention_impl, "triton_interpret_enabled", lambda: False)
    monkeypatch.setattr(attention_impl, "triton_can_run_on", lambda *tensors: True)
    GlobalBackendManager.set_attention_backend("TRITON")
    with pytest.raises(ValueError, match=r"refuses dtype torch\.float32 \(accepted: fp16, bf16\)"):
        flash_attn_func(*_qkv())
    assert attention_impl.TritonAttentionBackend.can_handle(
        q=torch.empty(1, 8, 2, 16, dtype=torch.bfloat16), k=torch.empty(1, 8, 1, 16, dtype=torch.bfloat16),
        v=torch.empty(1, 8, 1, 16, dtype=torch.bfloat16), cu_seqlens_q=None, dropout_p=0.0,
    )  # fmt: skip


def test_unpinned_refusal_still_falls_back():
    """Only a pinned backend raises; the automatic choice still picks one that serves the inputs."""
    out = flash_attn_func(*_qkv(320, 16))
    assert out.shape == (1, 8, 2, 16)


@pytest.mark.parametrize("sq, sk", [(8, 16), (16, 8)])
def test_causal_ring_rejects_unequal_q_k_lengths(monkeypatch, sq, sk):
    """The zigzag ring plan pairs query chunk i with key chunk i (a square mask): with Sq != Sk it returned
    wrong outputs silently (max error 0.89 vs flash_attn_func, 2 gloo ranks, Sq 8 / Sk 16)."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    q = torch.randn(1, sq, 2, 16)
    k, v = torch.randn(1, sk, 2, 16), torch.randn(1, sk, 2, 16)
    with pytest.raises(ValueError, match=rf"seqlen_q == seqlen_k.*q {sq}, k {sk}"):
        flash_attn_usp_func(q, k, v, causal=True, ring_group=object())


@pytest.mark.parametrize("scale", ["a", float("nan"), float("inf"), torch.randn(2)])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        flash_attn_func(*_qkv(), softmax_scale=scale)


def test_explicit_softmax_scale_matches_reference():
    GlobalBackendManager.set_attention_backend("TRITON")
    q, k, v = _qkv()
    out = flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.37), causal=True)
    kk, vv = k.repeat_interleave(2, 2).double(), v.repeat_interleave(2, 2).double()
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * 0.37
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
