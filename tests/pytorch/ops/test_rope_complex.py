"""apply_rotary_emb_complex: TorchTitan/DeepSeek's complex RoPE on the tail of [B, S, H, D] rows (MLA's q:
nope part copied, rope part rotated) in one kernel each way, against an fp64 reference and against
TorchTitan's own ``apply_rotary_emb`` + split + cat, forward and backward."""

import pytest
import torch
from test_utils import assert_close
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.kernels.rope.rope_impl import rope_complex_eager
from primus_turbo.pytorch.ops.rope import apply_rotary_emb_complex


def _freqs_cis(max_seq, rope_dim, device, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, device=device, dtype=torch.float32) / rope_dim))
    angles = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [max_seq, rope_dim / 2]


def _reference(x, freqs_cis, rope_dim):
    """fp64: the nope part as is, the rope part times freqs_cis as complex numbers."""
    b, s, h, d = x.shape
    nope = d - rope_dim
    pe = torch.view_as_complex(x[..., nope:].double().reshape(b, s, h, -1, 2).contiguous())
    rot = torch.view_as_real(pe * freqs_cis[:s].to(torch.complex128)[None, :, None, :]).flatten(3)
    return torch.cat([x[..., :nope].double(), rot], dim=-1)


def _titan(x, freqs_cis, rope_dim):
    """TorchTitan's MLA q path: split, apply_rotary_emb, cat."""
    from torchtitan.models.deepseek_v3.model.model import apply_rotary_emb

    nope, pe = torch.split(x, [x.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([nope, apply_rotary_emb(pe, freqs_cis)], dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape,rope_dim", [((2, 24, 4, 48), 16), ((1, 17, 3, 20), 20), ((2, 8, 5, 12), 4)])
def test_forward_and_backward_match_fp64(shape, rope_dim, dtype, device):
    freqs = _freqs_cis(shape[1] + 5, rope_dim, device)  # TorchTitan keeps freqs for max_seq_len >= S
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    out = apply_rotary_emb_complex(x, freqs, rope_dim)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    want = _reference(x.detach(), freqs, rope_dim)
    assert_close(out, want, dtype)
    nope = shape[-1] - rope_dim
    assert torch.equal(out[..., :nope], x.detach()[..., :nope]), "the nope part is copied exactly"
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    xd = x.detach().double().requires_grad_(True)
    (gref,) = torch.autograd.grad(_reference(xd, freqs, rope_dim), xd, g.double())
    assert_close(gx, gref, dtype)
    assert gx.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_torchtitan_split_rope_cat(dtype, device):
    pytest.importorskip("torchtitan")
    b, s, h, nope, rope = 2, 16, 4, 32, 16
    freqs = _freqs_cis(s, rope, device)
    x = torch.randn(b, s, h, nope + rope, device=device, dtype=dtype, requires_grad=True)
    out, want = apply_rotary_emb_complex(x, freqs, rope), _titan(x, freqs, rope)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    # one rounding of the same fp32 products: nearly every element is bitwise TorchTitan's
    assert (out == want).float().mean() > 0.99
    g = torch.randn_like(out)
    got, ref = torch.autograd.grad(out, x, g)[0], torch.autograd.grad(want, x, g)[0]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


def test_strided_input_rotated_whole(device):
    """k_pe as TorchTitan makes it: the rope columns of the wkv_a output, unsqueezed to one head."""
    b, s, lora, rope = 2, 12, 24, 8
    kv = torch.randn(b, s, lora + rope, device=device, dtype=torch.bfloat16, requires_grad=True)
    _, k_pe = torch.split(kv, [lora, rope], dim=-1)
    k_pe = k_pe.unsqueeze(2)
    assert not k_pe.is_contiguous()
    freqs = _freqs_cis(s, rope, device)
    out = apply_rotary_emb_complex(k_pe, freqs)
    assert_close(out, _reference(k_pe.detach(), freqs, rope), torch.bfloat16)
    (g,) = torch.autograd.grad(out, kv, torch.ones_like(out))
    assert torch.equal(g[..., :lora], torch.zeros_like(g[..., :lora])) and g[..., lora:].abs().sum() > 0


def test_eager_twin_matches_the_kernel(device):
    x = torch.randn(2, 10, 3, 24, device=device, dtype=torch.bfloat16)
    freqs = torch.view_as_real(_freqs_cis(10, 8, device))
    from primus_turbo.pytorch.kernels.rope.rope_impl import rope_complex

    for backward in (False, True):
        got, want = rope_complex(x, freqs, 8, backward), rope_complex_eager(x, freqs, 8, backward)
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_bad_input_names_the_argument(device):
    x = torch.randn(2, 8, 2, 12, device=device)
    freqs = _freqs_cis(8, 4, device)
    with pytest.raises(ValueError, match="x must be a 4-D"):
        apply_rotary_emb_complex(x[0], freqs, 4)
    with pytest.raises(ValueError, match="rope_dim=5"):
        apply_rotary_emb_complex(x, freqs, 5)
    with pytest.raises(ValueError, match="complex64"):
        apply_rotary_emb_complex(x, torch.view_as_real(freqs), 4)
    with pytest.raises(ValueError, match="cover S=8"):
        apply_rotary_emb_complex(x, freqs[:4], 4)
    with pytest.raises(ValueError, match="rope_dim / 2 = 3"):
        apply_rotary_emb_complex(x, freqs, 6)


@pytest.mark.gpu
def test_deepseek_v2_lite_q_shape_on_gpu(device):
    """MLA q at deepseek_moe_fp8 size: [2, 4096, 16, 192], rope 64, bf16."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    freqs = _freqs_cis(4096, 64, device)
    x = torch.randn(2, 4096, 16, 192, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = apply_rotary_emb_complex(x, freqs, 64)
    assert_close(out, _reference(x.detach(), freqs, 64), torch.bfloat16)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    want = torch.view_as_real(
        torch.view_as_complex(g[..., 128:].double().unflatten(-1, (-1, 2)).contiguous())
        * freqs.conj().to(torch.complex128)[None, :, None, :]
    ).flatten(3)
    assert_close(gx[..., 128:], want, torch.bfloat16)
    assert torch.equal(gx[..., :128], g[..., :128])


@pytest.mark.parametrize(
    "rows,row_block,want",
    [(2 * 4096 * 16, 128 + 64, 16), (2 * 4096, 1 + 64, 32), (3, 192, 4), (1, 8, 1), (10**6, 2, 64)],
)
def test_rows_per_program_is_a_power_of_two(rows, row_block, want):
    """tl.arange needs a power of two: MLA q (nope 128 + rope 64 per row) once launched 21 rows a program."""
    from primus_turbo.triton.rope.rope_complex_kernel import rows_per_program

    assert rows_per_program(rows, row_block) == want


def _compile_all() -> None:
    from primus_turbo.triton.rope import rope_complex_kernel as rk

    for dtype in ("bf16", "fp32"):
        sig = {
            "x_ptr": f"*{dtype}", "f_ptr": "*fp32", "out_ptr": f"*{dtype}",
            "T": "i32", "S": "i32", "H": "i32",
            "stride_xb": "i64", "stride_xs": "i64", "stride_xh": "i64", "stride_fs": "i64",
            "NOPE": "constexpr", "ROPE": "constexpr", "BLOCK_T": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_R": "constexpr", "BACKWARD": "constexpr",
        }  # fmt: skip
        for nope, rope, block_t, block_n in ((128, 64, 16, 128), (0, 64, 64, 1)):  # MLA q; k_pe
            for backward in (True, False):
                consts = {"NOPE": nope, "ROPE": rope, "BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_R": rope,
                          "BACKWARD": backward}  # fmt: skip
                compile_for_sm90(rk.rope_complex_kernel, sig, consts, num_warps=4)


def test_rope_complex_kernel_compiles_sm90():
    run_compile_check("test_rope_complex")


if __name__ == "__main__":
    _compile_all()
