"""mla_key_value: MLA's keys and values from the wkv_b output and the shared rotary key, one kernel each way,
against TorchTitan's split + cat(k_nope, k_pe.expand) and its autograd (the gradients of kv and k_pe)."""

import pytest
import torch
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.kernels.attention.mla_kv_impl import mla_kv_bwd, mla_kv_bwd_eager
from primus_turbo.pytorch.ops.mla import mla_key_value


def _stock(kv, k_pe, nope):
    k_nope, v = torch.split(kv, [nope, kv.shape[-1] - nope], dim=-1)
    return torch.cat([k_nope, k_pe.expand(-1, -1, kv.shape[2], -1)], dim=-1), v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "b,s,h,nope,vd,rope", [(2, 16, 4, 32, 32, 16), (1, 9, 3, 24, 40, 8), (2, 5, 16, 16, 8, 4)]
)
def test_matches_split_and_cat_forward_and_backward(b, s, h, nope, vd, rope, dtype, device):
    kv = torch.randn(b, s, h, nope + vd, device=device, dtype=dtype, requires_grad=True)
    k_pe = torch.randn(b, s, 1, rope, device=device, dtype=dtype, requires_grad=True)
    k, v = mla_key_value(kv, k_pe, nope)
    k_ref, v_ref = _stock(kv, k_pe, nope)
    assert k.is_contiguous() and v.is_contiguous()
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref), "pure data movement: exact"
    gk, gv = torch.randn_like(k), torch.randn_like(v)
    got = torch.autograd.grad((k, v), (kv, k_pe), (gk, gv))
    # reference k_pe gradient in fp64 (the expand's sum over heads; one rounding to dtype)
    want_kv = torch.cat([gk[..., :nope], gv], dim=-1)
    want_pe = gk[..., nope:].double().sum(2, keepdim=True)
    assert torch.equal(got[0], want_kv)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[1].double(), want_pe, rtol=tol, atol=tol)
    assert got[1].abs().sum() > 0


def test_strided_gradients_and_an_unused_value(device):
    """Gradients arriving as transposed views (attention works in [B, H, S, D]); v unused -> zero dv."""
    b, s, h, nope, vd, rope = 2, 8, 4, 16, 16, 8
    kv = torch.randn(b, s, h, nope + vd, device=device, requires_grad=True)
    k_pe = torch.randn(b, s, 1, rope, device=device, requires_grad=True)
    k, v = mla_key_value(kv, k_pe, nope)
    gk = torch.randn(b, h, s, nope + rope, device=device).transpose(1, 2)  # non-contiguous
    (gkv, gpe) = torch.autograd.grad(k, (kv, k_pe), gk)
    assert torch.equal(gkv[..., :nope], gk[..., :nope]) and (gkv[..., nope:] == 0).all()
    torch.testing.assert_close(gpe, gk[..., nope:].sum(2, keepdim=True), rtol=1e-5, atol=1e-5)


def test_eager_twin_matches_the_kernel(device):
    dk = torch.randn(2, 6, 4, 24, device=device, dtype=torch.bfloat16)
    dv = torch.randn(2, 6, 4, 16, device=device, dtype=torch.bfloat16)
    for a, b in zip(mla_kv_bwd(dk, dv, 16), mla_kv_bwd_eager(dk, dv, 16)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_bad_input_names_the_argument(device):
    kv = torch.randn(2, 8, 4, 48, device=device)
    with pytest.raises(ValueError, match="nope_dim=48"):
        mla_key_value(kv, torch.randn(2, 8, 1, 8, device=device), 48)
    with pytest.raises(ValueError, match=r"k_pe must be \[B, S, 1, R\]"):
        mla_key_value(kv, torch.randn(2, 8, 4, 8, device=device), 32)
    with pytest.raises(ValueError, match="kv must be a 4-D"):
        mla_key_value(kv[0], torch.randn(2, 8, 1, 8, device=device), 32)
    with pytest.raises(ValueError, match="must match kv"):
        mla_key_value(kv, torch.randn(2, 8, 1, 8, device=device, dtype=torch.bfloat16), 32)


@pytest.mark.gpu
def test_deepseek_v2_lite_shape_on_gpu(device):
    """[2, 4096, 16, 128 + 128] and k_pe [2, 4096, 1, 64], bf16."""
    if device.type != "cuda":
        pytest.skip("needs a CUDA device")
    kv = torch.randn(2, 4096, 16, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    k_pe = torch.randn(2, 4096, 1, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = mla_key_value(kv, k_pe, 128)
    k_ref, v_ref = _stock(kv, k_pe, 128)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    gk = torch.randn_like(k)
    got = torch.autograd.grad(k, (kv, k_pe), gk)
    want = torch.autograd.grad(k_ref, (kv, k_pe), gk)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=1e-2)


def _compile_all() -> None:
    from primus_turbo.triton.attention import mla_kv_kernel as mk

    for dtype in ("bf16", "fp32"):
        consts = {"NOPE": 128, "VD": 128, "R": 64, "BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_R": 64}
        fwd = {"kv_ptr": f"*{dtype}", "pe_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
               "S": "i32", "H": "i32", "stride_kvb": "i64", "stride_kvs": "i64", "stride_kvh": "i64",
               "stride_peb": "i64", "stride_pes": "i64",
               **{k: "constexpr" for k in [*consts, "BLOCK_H"]}}  # fmt: skip
        compile_for_sm90(mk.mla_kv_fwd_kernel, fwd, {**consts, "BLOCK_H": 8}, num_warps=4)
        bwd = {"dk_ptr": f"*{dtype}", "dv_ptr": f"*{dtype}", "dkv_ptr": f"*{dtype}", "dpe_ptr": f"*{dtype}",
               "S": "i32", "H": "i32", "stride_dkb": "i64", "stride_dks": "i64", "stride_dkh": "i64",
               "stride_dvb": "i64", "stride_dvs": "i64", "stride_dvh": "i64",
               **{k: "constexpr" for k in [*consts, "BLOCK_H"]}}  # fmt: skip
        compile_for_sm90(mk.mla_kv_bwd_kernel, bwd, {**consts, "BLOCK_H": 16}, num_warps=4)


def test_mla_kv_kernels_compile_sm90():
    run_compile_check("test_mla_key_value")


if __name__ == "__main__":
    _compile_all()
