"""flash_attn at the edges an audit found: sequences with no key on the TORCH backend, no sequence at all,
non-contiguous sink / cu_seqlens on TRITON, windows too large for int32, TurboAttention's sink after a
whole-model bf16 cast, uneven context-parallel shards."""

from __future__ import annotations

import pytest
import torch
from ref.attention_ref import attention_ref
from test_utils import assert_close

from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_varlen_func

DTYPE = torch.float16 if torch.cuda.is_available() else torch.float32  # TRITON takes fp32 only on CPU


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], dout)


@pytest.fixture(autouse=True)
def _reset_backend():
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_varlen_sequence_with_no_key_and_fixed_length_sk_0(backend, device):
    """A packed sequence with queries but no keys (a padding sequence): its rows are 0 with zero gradients,
    the other sequences match the reference. The TORCH backward failed to reshape the empty dk."""
    GlobalBackendManager.set_attention_backend(backend)
    lens_q, lens_k = [3, 2, 4], [5, 0, 6]
    cu_q = torch.tensor([0, 3, 5, 9], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 5, 5, 11], dtype=torch.int32, device=device)
    q = torch.randn(9, 2, 16, dtype=DTYPE, device=device, requires_grad=True)
    k = torch.randn(11, 1, 16, dtype=DTYPE, device=device, requires_grad=True)
    v = torch.randn(11, 1, 16, dtype=DTYPE, device=device, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    dout = torch.randn_like(out)
    dq, dk, dv = _grads(out, (q, k, v), dout)
    assert not out[3:5].any() and not dq[3:5].any()
    for qs, ks in ((slice(0, 3), slice(0, 5)), (slice(5, 9), slice(5, 11))):
        ref = attention_ref(q[qs][None], k[ks][None], v[ks][None])[0][0]
        rq, rk, rv = _grads(ref, (q, k, v), dout[qs].double())
        assert_close(out[qs], ref, DTYPE, "out")
        assert_close(dq[qs], rq[qs], DTYPE, "dq")
        assert_close(dk[ks], rk[ks], DTYPE, "dk")
        assert_close(dv[ks], rv[ks], DTYPE, "dv")
    qd = torch.randn(2, 4, 2, 16, dtype=DTYPE, device=device, requires_grad=True)
    kd = torch.randn(2, 0, 1, 16, dtype=DTYPE, device=device, requires_grad=True)
    vd = torch.randn(2, 0, 1, 16, dtype=DTYPE, device=device, requires_grad=True)
    out = flash_attn_func(qd, kd, vd)
    grads = _grads(out, (qd, kd, vd), torch.randn_like(out))
    assert torch.equal(out, torch.zeros_like(out)) and all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_varlen_with_no_sequence(backend, device):
    GlobalBackendManager.set_attention_backend(backend)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    q, k, v = (torch.randn(0, 2, 16, dtype=DTYPE, device=device, requires_grad=True) for _ in range(3))
    out, lse = flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
    grads = _grads(out, (q, k, v), torch.randn_like(out))
    assert all(g.shape == (0, 2, 16) for g in grads)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_non_contiguous_sink_and_cu_seqlens(backend, device):
    """A sink sliced out of a wider tensor and cu_seqlens with a stride: the same results as contiguous copies
    (TRITON read both as contiguous arrays: other heads' sinks, or memory past cu_seqlens)."""
    GlobalBackendManager.set_attention_backend(backend)
    torch.manual_seed(0)
    q = torch.randn(12, 4, 16, dtype=DTYPE, device=device)
    k = torch.randn(12, 2, 16, dtype=DTYPE, device=device)
    v = torch.randn(12, 2, 16, dtype=DTYPE, device=device)
    sink_store = torch.randn(4, 3, device=device)
    cu_store = torch.tensor([[0, 9], [5, 9], [12, 9]], dtype=torch.int32, device=device)
    sink, cu = sink_store[:, 1], cu_store[:, 0]
    assert not sink.is_contiguous() and not cu.is_contiguous()
    got, lse = flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, sink=sink, return_lse=True)
    want, want_lse = flash_attn_varlen_func(
        q, k, v, cu.contiguous(), cu.contiguous(), 7, 7, causal=True, sink=sink.contiguous(), return_lse=True
    )
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    qb, kb, vb = q[None, :5], k[None, :5], v[None, :5]
    want = flash_attn_func(qb, kb, vb, sink=sink.contiguous())
    assert torch.equal(flash_attn_func(qb, kb, vb, sink=sink), want)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_windows_past_every_key_are_unbounded(backend, device):
    """Windows at or past Sq + Sk (up to 2**63 - 1) equal the unbounded (-1) window, forward and backward;
    TRITON added them to int32 offsets: 2**31 - 1 gave a zero output, or zero dk / dv under causal."""
    GlobalBackendManager.set_attention_backend(backend)
    big = 2**31 - 1
    for causal, window, same in (
        (False, (big, big), (-1, -1)),
        (False, (-1, big), (-1, -1)),
        (True, (big, -1), (-1, -1)),
        (False, (2**63 - 1, 3), (-1, 3)),
        (False, (40, 40), (-1, -1)),  # Sq + Sk = 40
    ):
        q = torch.randn(1, 20, 2, 16, dtype=DTYPE, device=device, requires_grad=True)
        k = torch.randn(1, 20, 1, 16, dtype=DTYPE, device=device, requires_grad=True)
        v = torch.randn(1, 20, 1, 16, dtype=DTYPE, device=device, requires_grad=True)
        out = flash_attn_func(q, k, v, causal=causal, window_size=window)
        ref = flash_attn_func(q, k, v, causal=causal, window_size=same)
        dout = torch.randn_like(out)
        for g, r in zip(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
            assert torch.equal(g, r), (causal, window)
        assert torch.equal(out, ref) and out.abs().sum() > 0, (causal, window)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_minus_inf_sink_on_rows_that_see_no_key(backend, device):
    """A sink of -inf ("no sink" for that head) on causal rows that see no key (Sq > Sk, bottom-right
    aligned): those rows give 0 with lse = +inf (lse = the sink on a head with a finite one), and every
    gradient, dsink included, is finite and equals the run without a sink for that head. TRITON kept the
    sink's l = 1 there: lse -inf and a NaN dsink."""
    GlobalBackendManager.set_attention_backend(backend)
    q = torch.randn(1, 20, 2, 16, dtype=DTYPE, device=device, requires_grad=True)
    k = torch.randn(1, 4, 2, 16, dtype=DTYPE, device=device, requires_grad=True)
    v = torch.randn(1, 4, 2, 16, dtype=DTYPE, device=device, requires_grad=True)
    sink = torch.tensor([float("-inf"), 0.5], device=device, requires_grad=True)
    out, lse = flash_attn_func(q, k, v, causal=True, sink=sink, return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv, dsink = _grads(out, (q, k, v, sink), dout)
    assert (lse[0, 0, :16] == float("inf")).all()  # no key and a -inf sink: +inf
    assert torch.allclose(lse[0, 1, :16], torch.full_like(lse[0, 1, :16], 0.5))  # only the sink: lse = sink
    assert torch.isfinite(lse[0, :, 16:]).all()
    assert (out[0, :16] == 0).all() and torch.isfinite(dsink).all() and dsink[0] == 0
    plain = flash_attn_func(q, k, v, causal=True)
    assert_close(out[:, :, 0], plain[:, :, 0], DTYPE)
    ref_grads = _grads(plain[:, :, 0], (q, k, v), dout[:, :, 0])
    for got, want in zip((dq[:, :, 0], dk[:, :, 0], dv[:, :, 0]), (g[:, :, 0] for g in ref_grads)):
        assert_close(got, want, DTYPE)


def test_turbo_attention_sink_after_a_bf16_model_cast():
    """Megatron's Float16Module / model.bfloat16() casts the sink parameter too: the module still runs (the
    kernels take fp32 sinks) and the sink still learns."""
    from primus_turbo.pytorch.modules.attention import TurboAttention

    mod = TurboAttention(causal=True, layout="bshd", num_sink_heads=4).bfloat16()
    assert mod.sink.dtype == torch.bfloat16
    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    out = mod(q, k, v)
    out.float().square().sum().backward()
    assert mod.sink.grad.dtype == torch.bfloat16 and mod.sink.grad.abs().sum() > 0
    ref = flash_attn_func(q, k, v, causal=True, sink=mod.sink.detach().float())
    assert torch.equal(out.reshape(ref.shape), ref)


def test_split_sequence_for_cp_rejects_uneven_shards():
    from primus_turbo.pytorch.ops.attention.attention_cp import split_sequence_for_cp

    x = torch.randn(1, 10, 2, 8)
    with pytest.raises(ValueError, match=r"sequence length 10 must be a multiple of 4 \(2 x ring_size 2"):
        split_sequence_for_cp(x, 1, ring_size=2, ring_rank=0)
    assert split_sequence_for_cp(x, 1, ring_size=5, ring_rank=1, causal=False).shape[1] == 2


def test_triton_refuses_more_sequence_head_pairs_than_a_grid_axis_holds(device):
    """The kernels' grid y axis is (sequence x head): at most 65535 (CUDA's limit). Past it TRITON cannot
    handle the call (a pinned TRITON raises, auto picks another backend) instead of a failed launch."""
    from primus_turbo.pytorch.kernels.attention.attention_impl import TritonAttentionBackend

    q = torch.randn(4, 2, 16, dtype=DTYPE, device=device)
    kw = dict(q=q, k=q[:, :1], v=q[:, :1], dropout_p=0.0)
    fits = torch.zeros(32768 + 1, dtype=torch.int32, device=device)  # 32768 sequences x 2 heads = 65536
    assert TritonAttentionBackend.can_handle(**kw, cu_seqlens_q=fits[:32768])
    assert not TritonAttentionBackend.can_handle(**kw, cu_seqlens_q=fits)
