"""turbo.modules.RMSNorm: state-dict compatibility with torch.nn.RMSNorm, outputs and gradients
against it, zero-centred gamma, the fused residual forward, mixed weight/activation dtypes."""

import pytest
import torch
from ref.rmsnorm_ref import rmsnorm_grads_ref, rmsnorm_ref
from test_utils import assert_close

import primus_turbo.pytorch as turbo


def _torch_norm(hidden, eps):
    norm = torch.nn.RMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1.0)
    return norm


@pytest.mark.parametrize("hidden", [7, 64])
def test_state_dict_round_trip_and_parity(hidden):
    ref = _torch_norm(hidden, 1e-5)
    norm = turbo.modules.RMSNorm(hidden, eps=1e-5)
    assert set(norm.state_dict()) == set(ref.state_dict()) == {"weight"}
    norm.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, hidden, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = norm(x), ref(x_ref)
    assert_close(y, y_ref, torch.float32, msg="y vs torch.nn.RMSNorm")
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    assert_close(x.grad, x_ref.grad, torch.float32, msg="dx vs torch.nn.RMSNorm")
    assert_close(norm.weight.grad, ref.weight.grad, torch.float32, msg="dweight vs torch.nn.RMSNorm")
    back = torch.nn.RMSNorm(hidden, eps=1e-5)
    back.load_state_dict(norm.state_dict())
    assert torch.equal(back.weight, ref.weight)


def test_zero_centered_gamma():
    norm = turbo.modules.RMSNorm(32, zero_centered_gamma=True)
    assert torch.equal(norm.weight, torch.zeros(32))
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
    x = torch.randn(4, 32)
    ref = torch.nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(norm.weight + 1.0)
    assert_close(norm(x), ref(x), torch.float32, msg="zero-centred vs weight + 1")
    assert "zero_centered_gamma=True" in repr(norm)


def test_residual_forward():
    norm = turbo.modules.RMSNorm(48)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x, res = torch.randn(6, 48, requires_grad=True), torch.randn(6, 48, requires_grad=True)
    y, s = norm(x, res)
    ref_y, ref_s = rmsnorm_ref(x, norm.weight, residual=res)
    assert_close(s, ref_s, torch.float32, msg="sum")
    assert_close(y, ref_y, torch.float32, msg="y")
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_dx, ref_dw = rmsnorm_grads_ref(x, norm.weight, dy, residual=res)
    assert_close(x.grad, ref_dx, torch.float32, msg="dx")
    assert_close(res.grad, ref_dx, torch.float32, msg="dresidual")
    assert_close(norm.weight.grad, ref_dw, torch.float32, msg="dweight")


def test_fp32_weight_bf16_activations():
    norm = turbo.modules.RMSNorm(64, dtype=torch.float32)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    assert norm.weight.grad.dtype == torch.float32
    ref_dx, ref_dw = rmsnorm_grads_ref(x, norm.weight.bfloat16(), dy)
    assert_close(x.grad, ref_dx, torch.bfloat16, msg="dx")
    assert_close(norm.weight.grad, ref_dw, torch.bfloat16, msg="dweight")


def test_device_dtype_and_bad_args():
    norm = turbo.modules.RMSNorm(16, device="meta", dtype=torch.bfloat16)
    assert norm.weight.device.type == "meta" and norm.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="hidden_size must be an int >= 0"):
        turbo.modules.RMSNorm(-1)
    with pytest.raises(ValueError, match="hidden_size must be an int >= 0"):
        turbo.modules.RMSNorm(16.0)
    with pytest.raises(ValueError, match="eps must be a number > 0"):
        turbo.modules.RMSNorm(16, eps=0.0)
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        turbo.modules.RMSNorm(16)(torch.randn(2, 8))


@pytest.mark.gpu
def test_module_on_gpu_bf16():
    norm = turbo.modules.RMSNorm(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_dx, ref_dw = rmsnorm_grads_ref(x, norm.weight, dy)
    assert_close(y, rmsnorm_ref(x, norm.weight)[0], torch.bfloat16, msg="y")
    assert_close(x.grad, ref_dx, torch.bfloat16, msg="dx")
    assert_close(norm.weight.grad, ref_dw, torch.bfloat16, msg="dweight")
