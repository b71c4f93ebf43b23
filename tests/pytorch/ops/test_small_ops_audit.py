"""Audit of the small ops (gated activations, RMSNorm, RoPE, MLA keys / values) against float64 references:
edge inputs the per-op files do not cover (router probs in every accepted row layout and a transposed one
that must be refused, |x| ~ 100 where exp overflows, all-zero and 1e4 rows, RoPE under
torch.inference_mode, the backward as the inverse rotation) and bad arguments that must raise naming the
argument instead of failing inside a kernel or running on with a wrong value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_utils import assert_close

from primus_turbo.pytorch.ops.activation import geglu_with_probs, swiglu, swiglu_with_probs
from primus_turbo.pytorch.ops.mla import mla_key_value
from primus_turbo.pytorch.ops.normalization import rmsnorm, rmsnorm_residual
from primus_turbo.pytorch.ops.rope import apply_rotary_emb_complex, apply_rotary_pos_emb


def _glu_ref(x, probs, act):
    """Megatron-Core's bias_swiglu_impl convention: the gate is the first half; silu or exact-erf gelu."""
    gate, up = x.double().chunk(2, dim=-1)
    y = (F.silu(gate) if act == "silu" else F.gelu(gate)) * up
    return y if probs is None else y * probs.double().reshape(*y.shape[:-1], 1)


def _freqs(seq, dim):
    """Megatron's RotaryEmbedding layout: [S, 1, 1, D] = cat(angles, angles)."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rope_ref(t, freqs):
    """fp64 rotate-half RoPE (fp32 t: the fp32 rounding of cos / sin is below the fp32 tolerance)."""
    x = t.double()
    cos, sin = torch.cos(freqs.double()), torch.sin(freqs.double())
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# -- gated activations ----------------------------------------------------------------------------------


@pytest.mark.parametrize("probs_shape", ["lead", "lead_1", "flat", "flat_1"])
def test_glu_probs_in_every_row_layout_match_fp64(probs_shape, device):
    batch, seq, hidden = 2, 3, 5
    x = torch.randn(batch, seq, 2 * hidden, device=device, requires_grad=True)
    rows = batch * seq
    layouts = {"lead": (batch, seq), "lead_1": (batch, seq, 1), "flat": (rows,), "flat_1": (rows, 1)}
    probs = torch.rand(layouts[probs_shape], device=device, requires_grad=True)
    out = geglu_with_probs(x, probs)
    dy = torch.randn_like(out)
    out.backward(dy)
    xr, pr = x.detach().double().requires_grad_(True), probs.detach().double().requires_grad_(True)
    ref = _glu_ref(xr, pr, "gelu")
    ref.backward(dy.double())
    assert_close(out, ref, torch.float32)
    assert_close(x.grad, xr.grad, torch.float32)
    assert probs.grad.shape == probs.shape
    assert_close(probs.grad, pr.grad, torch.float32)


def test_glu_probs_of_the_right_size_in_another_layout_are_refused(device):
    # x [B, S, 2H] with probs [S, B]: same element count, but row (b, s) would get probs[b * S + s] of the
    # transposed layout. Before the fix this ran and scaled the wrong rows.
    x = torch.randn(2, 3, 8, device=device)
    with pytest.raises(ValueError, match=r"probs must hold one value per row.*got probs shape \(3, 2\)"):
        swiglu_with_probs(x, torch.rand(3, 2, device=device))
    with pytest.raises(ValueError, match="probs"):
        swiglu_with_probs(x, torch.rand(2, 3, 1, 1, device=device))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_glu_large_inputs_stay_finite_and_exact(dtype, device):
    # exp(-x) overflows fp32 below x ~ -88: silu must go to 0, not NaN, forward and backward
    row = [-100.0, -90.0, -80.0, 80.0, 90.0, 100.0, 0.5, -3.0]
    x = torch.tensor([row + [2.0] * 8] * 3, dtype=dtype, device=device, requires_grad=True)
    probs = torch.rand(3, 1, device=device, requires_grad=True)
    out = swiglu_with_probs(x, probs)
    dy = torch.randn_like(out)
    out.backward(dy)
    xr, pr = x.detach().double().requires_grad_(True), probs.detach().double().requires_grad_(True)
    ref = _glu_ref(xr, pr, "silu")
    ref.backward(dy.double())
    assert_close(out, ref, dtype)
    assert_close(x.grad, xr.grad, dtype)
    assert_close(probs.grad, pr.grad, dtype)


@pytest.mark.parametrize("hidden", [1, 3, 1000, 4097])
def test_glu_odd_hidden_bf16(hidden, device):
    x = torch.randn(2, 2 * hidden, device=device).bfloat16().requires_grad_(True)
    out = swiglu(x)
    out.backward(torch.ones_like(out))
    xr = x.detach().double().requires_grad_(True)
    ref = _glu_ref(xr, None, "silu")
    ref.sum().backward()
    assert_close(out, ref, torch.bfloat16)
    assert_close(x.grad, xr.grad, torch.bfloat16)


# -- RMSNorm ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["TRITON", "TORCH"])
def test_rmsnorm_zero_and_huge_rows_bf16(backend, device):
    x = torch.zeros(3, 48, dtype=torch.bfloat16, device=device)
    x[1] = 1e4
    x[2, 5] = -1e4
    x.requires_grad_(True)
    weight = torch.randn(48, device=device).bfloat16().requires_grad_(True)
    out = rmsnorm(x, weight, eps=1e-6, zero_centered_gamma=True, backend=backend)
    dy = torch.randn_like(out)
    out.backward(dy)
    xr, wr = x.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    ref = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * (wr + 1.0)
    ref.backward(dy.double())
    assert_close(out, ref, torch.bfloat16)
    assert_close(x.grad, xr.grad, torch.bfloat16)
    assert_close(weight.grad.float() / 100, wr.grad / 100, torch.bfloat16)  # sums of 3 rows of ~1e2


@pytest.mark.parametrize("backend", ["TRITON", "TORCH"])
def test_rmsnorm_residual_gradient_reaches_both_inputs(backend, device):
    x = torch.randn(2, 3, 33, device=device, requires_grad=True)
    residual = torch.randn(2, 3, 33, device=device, requires_grad=True)
    weight = torch.randn(33, device=device, requires_grad=True)
    out, total = rmsnorm_residual(x, residual, weight, eps=1e-5, backend=backend)
    dy, dtotal = torch.randn_like(out), torch.randn_like(total)
    ((out * dy).sum() + (total * dtotal).sum()).backward()
    xr, rr, wr = (t.detach().double().requires_grad_(True) for t in (x, residual, weight))
    s = xr + rr
    ref = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * wr
    ((ref * dy.double()).sum() + (s * dtotal.double()).sum()).backward()
    assert_close(total, s, torch.float32)
    assert_close(out, ref, torch.float32)
    for got, want in ((x.grad, xr.grad), (residual.grad, rr.grad), (weight.grad, wr.grad)):
        assert_close(got, want, torch.float32)
    assert x.grad.data_ptr() != residual.grad.data_ptr()  # two gradients, not one aliased buffer


# -- RoPE and MLA ----------------------------------------------------------------------------------------


def test_rope_under_inference_mode_is_not_cached_stale(device):
    # Inference tensors have no version counter: before the fix the cos / sin cache key read
    # freqs._version and raised "Inference tensors do not track version counter".
    with torch.inference_mode():
        freqs = _freqs(4, 8).to(device)
        t = torch.randn(4, 2, 3, 8, device=device)
        assert_close(apply_rotary_pos_emb(t, freqs), _rope_ref(t, freqs), torch.float32)
        freqs.mul_(3.0)  # an in-place write no version counter records: the next call must see it
        assert_close(apply_rotary_pos_emb(t, freqs), _rope_ref(t, freqs), torch.float32)


@pytest.mark.parametrize("interleaved_input", [False, True])
def test_rope_backward_is_the_inverse_rotation(interleaved_input, device):
    t = torch.randn(5, 2, 3, 3 + 16, device=device, requires_grad=True)
    out = apply_rotary_pos_emb(t, _freqs(5, 16).to(device), interleaved_input=interleaved_input, nope_dim=3)
    out.backward(out.detach())  # R^T (R x) = x for a rotation
    assert_close(t.grad, t.detach(), torch.float32)


def test_rope_freqs_must_be_real_angles(device):
    t = torch.randn(4, 1, 2, 8, device=device)
    freqs_cis = torch.polar(torch.ones(4, 8), torch.randn(4, 8)).to(device)
    # before: complex freqs ran with a UserWarning, dropping the imaginary part of cos / sin
    with pytest.raises(ValueError, match="freqs must be real angles.*complex64"):
        apply_rotary_pos_emb(t, freqs_cis)
    with pytest.raises(ValueError, match="freqs must be real angles.*int64"):
        apply_rotary_pos_emb(t, torch.ones(4, 8, dtype=torch.long, device=device))


def test_rope_complex_rope_dim_must_be_an_int(device):
    x = torch.randn(1, 4, 2, 8, device=device)
    freqs_cis = torch.polar(torch.ones(4, 2), torch.randn(4, 2)).to(device)
    # before: a TypeError from inside the Triton launcher
    with pytest.raises(ValueError, match="rope_dim must be an int or None, got 4.0"):
        apply_rotary_emb_complex(x, freqs_cis, rope_dim=4.0)


def test_mla_key_value_bad_nope_dim_and_empty_rope(device):
    kv = torch.randn(1, 2, 3, 8, device=device)
    k_pe = torch.randn(1, 2, 1, 4, device=device)
    # before: 4.0 failed in torch.empty, True ran as nope_dim=1, R = 0 crashed in the kernel
    with pytest.raises(ValueError, match="nope_dim=4.0 must be an int"):
        mla_key_value(kv, k_pe, 4.0)
    with pytest.raises(ValueError, match="nope_dim=True must be an int"):
        mla_key_value(kv, k_pe, True)
    with pytest.raises(ValueError, match="R >= 1"):
        mla_key_value(kv, k_pe[..., :0], 4)
