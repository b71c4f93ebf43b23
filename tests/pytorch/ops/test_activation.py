import pytest
import torch
from ref.activation_ref import glu_ref
from test_utils import assert_close
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.ops.activation import geglu, geglu_with_probs, swiglu, swiglu_with_probs
from primus_turbo.triton.activation.activation_kernel import glu_bwd_kernel, glu_fwd_kernel, launch_config

OPS = {
    ("silu", False): swiglu,
    ("gelu", False): geglu,
    ("silu", True): swiglu_with_probs,
    ("gelu", True): geglu_with_probs,
}


def _check(act, with_probs, shape, dtype, device):
    x = torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)
    probs = (
        torch.rand(shape[:-1], dtype=torch.float32, device=device, requires_grad=True) if with_probs else None
    )
    fn = OPS[(act, with_probs)]
    out = fn(x, probs) if with_probs else fn(x)
    ref = glu_ref(x.detach(), probs.detach() if with_probs else None, act)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref, dtype)
    dy = torch.randn_like(out)
    out.backward(dy)
    xr = x.detach().double().requires_grad_(True)
    pr = probs.detach().double().requires_grad_(True) if with_probs else None
    glu_ref(xr, pr, act).backward(dy.double())
    assert_close(x.grad, xr.grad, dtype)
    if with_probs:
        assert probs.grad.dtype == probs.dtype
        assert_close(probs.grad, pr.grad, probs.dtype)


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("shape", [(33, 96), (2, 5, 40)])
def test_glu_fp32(act, with_probs, shape, device):
    _check(act, with_probs, shape, torch.float32, device)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("shape", [(4096, 2 * 2048), (8192, 2 * 1408), (17, 2 * 7168)])
def test_glu_bf16_gpu(act, with_probs, shape, device):
    _check(act, with_probs, shape, torch.bfloat16, device)


def test_glu_empty(device):
    x = torch.randn(0, 64, device=device, requires_grad=True)
    p = torch.rand(0, device=device, requires_grad=True)
    y = swiglu_with_probs(x, p)
    assert y.shape == (0, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape and p.grad.shape == p.shape
    x = torch.randn(5, 0, device=device, requires_grad=True)  # no features: [5, 0] out, no reshape error
    y = swiglu(x)
    assert y.shape == (5, 0)
    y.sum().backward()
    assert x.grad.shape == (5, 0)


def test_glu_non_contiguous(device):
    base = torch.randn(16, 128, device=device)
    x = base[:, ::2]  # [16, 64] non-contiguous
    assert_close(swiglu(x), glu_ref(x, None, "silu"), torch.float32)


def test_glu_bad_input(device):
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="one value per row"):
        swiglu_with_probs(torch.randn(4, 8, device=device), torch.rand(5, device=device))
    with pytest.raises(TypeError, match="dtype"):
        geglu(torch.ones(4, 8, dtype=torch.int32, device=device))


def _compile_all():
    for act in (0, 1):
        for has_probs in (False, True):
            for hidden in (2048, 1408, 14336, 48):
                block_r, block_h, warps = launch_config(hidden)
                common = {"ACT": act, "HAS_PROBS": has_probs, "BLOCK_R": block_r, "BLOCK_H": block_h}
                for kernel, sig in ((glu_fwd_kernel, FWD_SIG), (glu_bwd_kernel, BWD_SIG)):
                    compile_for_sm90(kernel, sig, common, num_warps=warps)


FWD_SIG = {
    "x_ptr": "*bf16",
    "probs_ptr": "*fp32",
    "out_ptr": "*bf16",
    "N": "i32",
    "H": "i32",
    "stride_x": "i32",
    "stride_out": "i32",
    "ACT": "constexpr",
    "HAS_PROBS": "constexpr",
    "BLOCK_R": "constexpr",
    "BLOCK_H": "constexpr",
}
BWD_SIG = {
    "grad_out_ptr": "*bf16",
    "x_ptr": "*bf16",
    "probs_ptr": "*fp32",
    "grad_x_ptr": "*bf16",
    "grad_probs_ptr": "*fp32",
    "N": "i32",
    "H": "i32",
    "stride_g": "i32",
    "stride_x": "i32",
    "stride_gx": "i32",
    "ACT": "constexpr",
    "HAS_PROBS": "constexpr",
    "BLOCK_R": "constexpr",
    "BLOCK_H": "constexpr",
}


def test_glu_kernels_compile_sm90():
    # In a fresh process without TRITON_INTERPRET: a second compile_for_sm90 call in an
    # interpreter-mode process fails inside Triton's code generator (ir.value has no dtype).
    run_compile_check("test_activation")


if __name__ == "__main__":
    _compile_all()
