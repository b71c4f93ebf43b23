"""``turbo.ops.gemm``, ``turbo.ops.gemm_fp8`` and the Linear modules under ``torch.autocast``: they follow
it as ``torch.mm`` and ``nn.Linear`` do. gemm: inputs cast to the autocast dtype, which every backend
computes and returns; fp32 leaves get fp32 gradients through the cast (it used to depend on the backend:
CUBLAS's torch.mm autocast the forward to bf16 and ran the backward in fp32; TRITON and TORCH stayed in
fp32). gemm_fp8, Float8Linear and Linear(fp8_config=...): the output in the autocast dtype (it was the
input's), the operands quantized from their own precision."""

import pytest
import torch
from test_utils import assert_close

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import GlobalBackendManager


def _backends():
    return ["TORCH", "TRITON", pytest.param("CUBLAS", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _reset_backends():
    yield
    GlobalBackendManager.reset()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_under_autocast_matches_torch_mm(trans_b, backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    a = torch.randn(48, 64, device=device, requires_grad=True)
    b = torch.randn(*((40, 64) if trans_b else (64, 40)), device=device, requires_grad=True)
    grad = torch.randn(48, 40, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out = turbo.ops.gemm(a, b, trans_b=trans_b)
        ref = torch.mm(a, b.T if trans_b else b)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out, ref, torch.bfloat16)
    da, db = torch.autograd.grad(out, (a, b), grad)
    ref_da, ref_db = torch.autograd.grad(ref, (a, b), grad)
    assert da.dtype == db.dtype == torch.float32  # through the differentiable cast, as torch's
    assert_close(da, ref_da, torch.bfloat16)
    assert_close(db, ref_db, torch.bfloat16)


def test_gemm_under_autocast_leaves_fp64_and_out_dtype_alone(device):
    a64, b64 = (
        torch.randn(16, 32, device=device, dtype=torch.float64),
        torch.randn(32, 8, device=device).double(),
    )
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        assert turbo.ops.gemm(a64, b64).dtype == torch.float64  # autocast does not cast fp64
        a, b = torch.randn(16, 32, device=device), torch.randn(32, 8, device=device)
        out = turbo.ops.gemm(a, b, out_dtype=torch.float32)  # bf16 inputs, the fp32 accumulator unrounded
    assert out.dtype == torch.float32
    ab = (a.bfloat16().double() @ b.bfloat16().double()).float()
    torch.testing.assert_close(out, ab, rtol=1e-5, atol=1e-4)


def test_gemm_main_grad_under_autocast_needs_b_in_the_autocast_dtype(device):
    b = torch.nn.Parameter(torch.randn(8, 32, device=device))
    b.main_grad = torch.zeros(8, 32, device=device)
    a = torch.randn(16, 32, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="accumulate_into_main_grad under torch.autocast needs b"):
            turbo.ops.gemm(a, b, trans_b=True, accumulate_into_main_grad=True)
        b16 = torch.nn.Parameter(b.detach().bfloat16())
        b16.main_grad = torch.zeros(8, 32, device=device)
        out = turbo.ops.gemm(a, b16, trans_b=True, accumulate_into_main_grad=True)  # a is cast, b is not
    out.backward(torch.ones_like(out))
    assert_close(b16.main_grad, torch.ones(16, 8, device=device).T @ a.bfloat16().float(), torch.bfloat16)


def test_linear_under_autocast_returns_what_nn_linear_returns(device):
    torch.manual_seed(0)
    ours = turbo.modules.Linear(32, 24, device=device)
    ref = torch.nn.Linear(32, 24, device=device)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 5, 32, device=device)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out, expected = ours(x), ref(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert_close(out, expected, torch.bfloat16)
    out.float().sum().backward()
    expected.float().sum().backward()
    assert ours.weight.grad.dtype == torch.float32
    assert_close(ours.weight.grad, ref.weight.grad, torch.bfloat16)
    assert_close(ours.bias.grad, ref.bias.grad, torch.bfloat16)


def test_gemm_fp8_and_float8_linear_under_autocast_return_the_autocast_dtype(device):
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

    dev = torch.device(device).type
    cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
    x = torch.randn(32, 64, device=device, requires_grad=True)
    w = torch.randn(48, 64, device=device, requires_grad=True)
    outside = turbo.ops.gemm_fp8(x, w, trans_b=True, config=cfg)
    with torch.autocast(dev, dtype=torch.bfloat16):
        out = turbo.ops.gemm_fp8(x, w, trans_b=True, config=cfg)
        pinned = turbo.ops.gemm_fp8(x, w, trans_b=True, out_dtype=torch.float32, config=cfg)
    assert outside.dtype == pinned.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert_close(out, outside.bfloat16(), torch.bfloat16)  # the same FP8 operands, rounded at the end
    dx, dw = torch.autograd.grad(out.float().square().sum(), (x, w))
    assert dx.dtype == dw.dtype == torch.float32 and dx.abs().sum() > 0 and dw.abs().sum() > 0
    layers = [
        turbo.modules.Float8Linear(64, 24, config=cfg, device=device),
        turbo.modules.Linear(64, 24, device=device, fp8_config=cfg),
    ]
    for layer in layers:
        ref = torch.nn.Linear(64, 24, device=device)
        ref.load_state_dict(layer.state_dict(), strict=False)
        with torch.autocast(dev, dtype=torch.bfloat16):
            got, want = layer(x), ref(x)
        assert got.dtype == want.dtype == torch.bfloat16, type(layer).__name__
        got.float().sum().backward()
        assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
