"""Attention audit: refusals of a pinned backend say which argument and what is accepted; causal ring
attention refuses seqlen_q != seqlen_k (its zigzag plan is wrong there); softmax_scale is checked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.kernels.attention import attention_impl
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_usp_func


def _qkv(d=16, dv=16, dtype=torch.float32, device="cpu"):
    q = torch.randn(1, 8, 2, d, dtype=dtype, device=device)
    k = torch.randn(1, 8, 1, d, dtype=dtype, device=device)
    v = torch.randn(1, 8, 1, dv, dtype=dtype, device=device)
    return q, k, v


def _triton_qkv(d=16, dv=16):
    """Inputs pinned TRITON takes apart from the argument under test: CPU fp32 under the interpreter (CI),
    CUDA bf16 on a GPU machine (there TRITON refuses CPU tensors and fp32 first, hiding that argument)."""
    if torch.cuda.is_available():
        return _qkv(d, dv, torch.bfloat16, "cuda")
    return _qkv(d, dv)


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
    q, k, v = _triton_qkv(*dims) if backend == "TRITON" else _qkv(*dims)
    with pytest.raises(ValueError, match=match) as err:
        flash_attn_func(q, k, v, **kwargs)
    assert backend in str(err.value) and "set_attention_backend" in str(err.value)


def test_env_pinned_triton_refusal_names_the_argument(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"PRIMUS_TURBO_ATTENTION_BACKEND\) refuses dropout_p=0\.2"):
        flash_attn_func(*_triton_qkv(), dropout_p=0.2)


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
    q, k, v = _triton_qkv()
    out = flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.37), causal=True)
    kk, vv = k.repeat_interleave(2, 2).double(), v.repeat_interleave(2, 2).double()
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * 0.37
    s = s.masked_fill(torch.ones(8, 8, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vv)
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def _huge_kw(seq: int, heads: int = 8, dim: int = 128, varlen: bool = False):
    """Attention inputs whose one sequence spans seq * heads * dim elements, as stride-0 views (no memory)."""
    t = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16).expand(1, seq, heads, dim)
    cu = torch.tensor([0, seq], dtype=torch.int32) if varlen else None
    t = t[0] if varlen else t
    return dict(q=t, k=t, v=t, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq, max_seqlen_k=seq,
                sink=None, softmax_scale=0.1, window_left=-1, window_right=0, dropout_p=0.0,
                deterministic=False, return_lse=False)  # fmt: skip


@pytest.mark.parametrize("varlen", [False, True])
def test_triton_refuses_sequences_past_int32_offsets(monkeypatch, varlen):
    """The kernels offset rows inside a sequence in int32 (only its base is int64): a sequence of 2^31+
    elements (2^21 tokens x 8 heads x 128 here) would wrap. TRITON refuses it by name; unpinned, the
    dispatcher takes another backend (audit, session 35)."""
    monkeypatch.setattr(attention_impl, "triton_interpret_enabled", lambda: False)
    monkeypatch.setattr(attention_impl, "triton_can_run_on", lambda *tensors: True)
    huge, fine = _huge_kw(2**21, varlen=varlen), _huge_kw(2**21 - 64, varlen=varlen)
    assert "int32" in attention_impl.TritonAttentionBackend.refusal(**huge)
    assert attention_impl.TritonAttentionBackend.refusal(**fine) is None
    GlobalBackendManager.set_attention_backend("TRITON")
    with pytest.raises(ValueError, match=r"TRITON .*refuses a sequence spanning \d+ elements"):
        attention_impl.AttentionDispatcher.resolve(**huge)
    GlobalBackendManager.set_attention_backend(None)
    assert attention_impl.AttentionDispatcher.resolve(**huge).name != "TRITON"
