"""turbo.ops.apply_rotary_pos_emb against Megatron-Core's eager _apply_rotary_pos_emb_bshd in float64 and a
float64 rotate-half reference with cos / sin rounded to the input dtype as Megatron rounds them (forward and
the input gradient; MLA's interleaved input and the plain rotate-half layout; mscale), a strided
view as input (MLA's split of q), the eager twin vs the kernel, bad input, the sm_90 compile. GPU: the
deepseek MLA shape in bf16."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.kernels.rope.rope_impl import rope_eager
from primus_turbo.pytorch.ops.rope import apply_rotary_pos_emb, clear_rope_cache


def _freqs(seq, dim, device, base=10000.0):
    """Megatron's RotaryEmbedding layout: [S, 1, 1, D] = cat(angles, angles)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _megatron_reference(t, freqs, interleaved_input, mscale):
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")
    x = t.detach().double().requires_grad_(True)
    out = rope_utils._apply_rotary_pos_emb_bshd(
        x, freqs.double(), rotary_interleaved=False, multi_latent_attention=interleaved_input, mscale=mscale
    )
    return x, out


def _rounded_reference(t, freqs, interleaved_input, mscale):
    """float64 rotate-half RoPE with cos / sin rounded to t's dtype first, as Megatron's eager RoPE rounds
    them in a bf16 run (the fp64 Megatron call above cannot round them)."""
    x = t.detach().double().requires_grad_(True)
    xs = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1) if interleaved_input else x
    cos = (torch.cos(freqs.double()) * mscale).to(t.dtype).double()
    sin = (torch.sin(freqs.double()) * mscale).to(t.dtype).double()
    x1, x2 = xs.chunk(2, dim=-1)
    return x, xs * cos + torch.cat([-x2, x1], dim=-1) * sin


@pytest.mark.parametrize("interleaved_input", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 2, 3, 64), (5, 1, 17, 16), (3, 2, 1, 2)])
@pytest.mark.parametrize("mscale", [1.0, 0.7])
def test_matches_megatron_in_float64(interleaved_input, dtype, shape, mscale, device):
    seq, _, _, dim = shape
    t = torch.randn(shape, device=device).to(dtype).requires_grad_(True)
    freqs = _freqs(seq, dim, device)
    out = apply_rotary_pos_emb(t, freqs, interleaved_input=interleaved_input, mscale=mscale)
    assert out.shape == t.shape and out.dtype == dtype and out.is_contiguous()
    grad = torch.randn_like(out)
    out.backward(grad)
    references = [_rounded_reference(t, freqs, interleaved_input, mscale)]
    if dtype == torch.float32:  # Megatron's own function in fp64 (fp32 rounding of cos / sin: negligible)
        references.append(_megatron_reference(t, freqs, interleaved_input, mscale))
    for x, ref in references:
        ref.backward(grad.double())
        assert_close(out, ref.to(dtype), dtype)
        assert_close(t.grad, x.grad.to(dtype), dtype)


def test_strided_view_input_like_mla_q_split(device):
    """q_pos_emb is the last 64 of q [S, B, H, 192]: a view with unit stride along D only."""
    q = torch.randn(6, 2, 4, 192, device=device, requires_grad=True)
    q_pos = q[..., 128:]
    assert not q_pos.is_contiguous()
    freqs = _freqs(6, 64, device)
    out = apply_rotary_pos_emb(q_pos, freqs, interleaved_input=True)
    out.backward(torch.ones_like(out))
    x, ref = _megatron_reference(q_pos, freqs, True, 1.0)
    ref.backward(torch.ones_like(ref))
    assert_close(out, ref.float(), torch.float32)
    assert torch.count_nonzero(q.grad[..., :128]) == 0
    assert_close(q.grad[..., 128:], x.grad.float(), torch.float32)


@pytest.mark.parametrize("nope", [32, 48, 1])
@pytest.mark.parametrize("interleaved_input", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nope_prefix_passes_through_and_the_rest_rotates(nope, interleaved_input, dtype, device):
    """MLA's query: [q_nope, rope(q_pe)] from q [S, B, H, nope + 64] in one op (a strided view of a wider
    tensor, as Megatron's q.view of the up-projection), against a cat of the prefix and Megatron's fp64 RoPE
    of the tail; the gradient of the prefix passes through, the tail's is RoPE's backward."""
    wide = torch.randn(5, 2, 3, nope + 64 + 8, device=device).to(dtype)
    q = wide[..., : nope + 64].detach().requires_grad_(True)  # unit stride along D only
    freqs = _freqs(5, 64, device)
    out = apply_rotary_pos_emb(q, freqs, interleaved_input=interleaved_input, mscale=0.9, nope_dim=nope)
    assert out.shape == q.shape and out.is_contiguous()
    grad = torch.randn_like(out)
    out.backward(grad)
    x, ref_tail = _rounded_reference(q[..., nope:], freqs, interleaved_input, 0.9)
    ref_tail.backward(grad[..., nope:].double())
    assert torch.equal(out[..., :nope], q[..., :nope].detach())
    assert_close(out[..., nope:], ref_tail.to(dtype), dtype)
    assert torch.equal(q.grad[..., :nope], grad[..., :nope])
    assert_close(q.grad[..., nope:], x.grad.to(dtype), dtype)


@pytest.mark.parametrize("nope", [0, 24])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("interleaved_input", [True, False])
def test_eager_twin_matches_the_kernel(backward, interleaved_input, nope, device):
    from primus_turbo.pytorch.kernels.rope import rope_impl
    from primus_turbo.pytorch.ops.rope import _cos_sin

    x = torch.randn(4, 3, 5, nope + 32, device=device).bfloat16()
    cos, sin = _cos_sin(_freqs(4, 32, device), torch.bfloat16, 0.9)
    got = rope_impl._run(x, cos, sin, interleaved_input, backward, nope)
    want = rope_eager(x, cos, sin, interleaved_input, backward, nope)
    assert_close(got, want, torch.bfloat16)


def test_cos_sin_are_cached_per_angle_tensor_and_recomputed_after_an_in_place_write(device):
    from primus_turbo.pytorch.ops.rope import _cos_sin

    freqs = _freqs(5, 8, device)
    first = _cos_sin(freqs, torch.float32, 1.0)
    assert _cos_sin(freqs, torch.float32, 1.0)[0] is first[0]  # cached
    assert _cos_sin(freqs, torch.float32, 0.5)[0] is not first[0]  # another mscale
    freqs.mul_(2.0)  # Megatron never does this; a stale cache would still be wrong
    again = _cos_sin(freqs, torch.float32, 1.0)
    assert_close(again[0], torch.cos(freqs.reshape(5, 8)), torch.float32)
    t = torch.randn(5, 1, 2, 8, device=device)
    x, ref = _rounded_reference(t, freqs, False, 1.0)
    assert_close(apply_rotary_pos_emb(t, freqs), ref.float(), torch.float32)
    # new storage through .data (no version bump): the pointer is in the key
    freqs.data = _freqs(5, 8, device) * 3.0
    assert_close(_cos_sin(freqs, torch.float32, 1.0)[0], torch.cos(freqs.reshape(5, 8)), torch.float32)
    # a write through .data changes neither the version nor the pointer: clear_rope_cache()
    freqs.data.copy_(_freqs(5, 8, device) * 5.0)
    clear_rope_cache()
    assert_close(_cos_sin(freqs, torch.float32, 1.0)[0], torch.cos(freqs.reshape(5, 8)), torch.float32)


BAD = [
    (lambda: apply_rotary_pos_emb(torch.randn(3, 4, 8), torch.zeros(3, 8)), "4-D"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 8), torch.zeros(3, 1, 1, 4)), "partial rotary"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 12), torch.zeros(3, 12)), "power of two"),
    (lambda: apply_rotary_pos_emb(torch.zeros(3, 1, 2, 8, dtype=torch.long), torch.zeros(3, 8)), "float"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 8), torch.zeros(3, 8), nope_dim=8), "nope_dim=8 "),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 8), torch.zeros(3, 8), nope_dim=-1), "nope_dim=-1"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 12), torch.zeros(3, 8), nope_dim=2.0), "nope_dim=2.0"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 12), torch.zeros(3, 8), nope_dim=2), "D=10"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 4), torch.zeros(3, 2, 2)), r"\[S, D\] with S=3, D=4"),
    (lambda: apply_rotary_pos_emb(torch.randn(3, 1, 2, 8), torch.zeros(3, 4), nope_dim=True), "nope_dim=Tr"),
]


@pytest.mark.parametrize("bad, match", BAD)
def test_bad_input_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


@pytest.mark.gpu
def test_gpu_deepseek_mla_shape():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    t = torch.randn(4096, 1, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = _freqs(4096, 64, "cuda")
    out = apply_rotary_pos_emb(t, freqs, interleaved_input=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    x, ref = _rounded_reference(t, freqs, True, 1.0)
    ref.backward(grad.double())
    assert_close(out, ref.bfloat16(), torch.bfloat16)
    assert_close(t.grad, x.grad.bfloat16(), torch.bfloat16)


def _compile_all() -> None:
    from primus_turbo.triton.rope import rope_kernel as rk

    for dtype in ("bf16", "fp32"):
        sig = {
            "x_ptr": f"*{dtype}", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": f"*{dtype}", "B": "i32",
            "H": "i32", "stride_xs": "i64", "stride_xb": "i64", "stride_xh": "i64", "stride_os": "i64",
            "stride_ob": "i64", "stride_oh": "i64", "HALF": "constexpr",
            "BLOCK_H": "constexpr", "INTERLEAVED_INPUT": "constexpr", "BACKWARD": "constexpr",
            "NOPE": "constexpr", "NOPE_P2": "constexpr",
        }  # fmt: skip
        for interleaved in (True, False):
            for backward in (True, False):
                for nope in (0, 128):  # 128: MLA's query (qk_head_dim 128 + the 64 rotated)
                    consts = {"HALF": 32, "BLOCK_H": 16, "INTERLEAVED_INPUT": interleaved,
                              "BACKWARD": backward, "NOPE": nope, "NOPE_P2": max(nope, 1)}  # fmt: skip
                    compile_for_sm90(rk.rope_kernel, sig, consts, num_warps=4)


def test_rope_kernel_compiles_sm90():
    run_compile_check("test_rope")


if __name__ == "__main__":
    _compile_all()


def test_apply_rotary_pos_emb_compiles_fullgraph(device):
    """torch.compile(fullgraph=True) traces the op (the cos / sin cache is skipped while tracing: its key
    broke the trace before), forward and backward equal to eager."""
    freqs = _freqs(6, 8, device)
    t = torch.randn(6, 2, 3, 8, device=device, requires_grad=True)
    compiled = torch.compile(apply_rotary_pos_emb, fullgraph=True, backend="aot_eager")
    out = compiled(t, freqs)
    want = apply_rotary_pos_emb(t, freqs)
    assert_close(out, want, torch.float32)
    dout = torch.randn_like(out)
    (got_grad,) = torch.autograd.grad(out, t, dout)
    (want_grad,) = torch.autograd.grad(want, t, dout)
    assert_close(got_grad, want_grad, torch.float32)
