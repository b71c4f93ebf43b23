"""turbo.modules.Linear vs torch.nn.Linear: parameters, init, state dicts, fwd/bwd, leading dims."""

import pytest
import torch
from ref.gemm_ref import gemm_ref
from test_utils import assert_close

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.gemm.gemm_impl import GemmDispatcher


def test_linear_matches_torch_init_and_state_dict(device):
    torch.manual_seed(0)
    ref = torch.nn.Linear(48, 40, device=device)
    torch.manual_seed(0)
    mod = turbo.modules.Linear(48, 40, device=device)
    assert [n for n, _ in mod.named_parameters()] == ["weight", "bias"]
    torch.testing.assert_close(mod.weight, ref.weight, rtol=0, atol=0)  # same init, same RNG draws
    torch.testing.assert_close(mod.bias, ref.bias, rtol=0, atol=0)
    other = torch.nn.Linear(48, 40, device=device)
    mod.load_state_dict(other.state_dict())
    ref.load_state_dict(mod.state_dict())
    torch.testing.assert_close(ref.weight, other.weight, rtol=0, atol=0)
    no_bias = turbo.modules.Linear(8, 4, bias=False, dtype=torch.bfloat16, device=device)
    assert no_bias.bias is None and no_bias.weight.dtype == torch.bfloat16
    assert "in_features=8, out_features=4, bias=False" in repr(no_bias)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 48), (33, 48)])
def test_linear_fwd_bwd(shape, dtype, backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    mod = turbo.modules.Linear(48, 40, device=device, dtype=dtype)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    out = mod(x)
    assert GemmDispatcher.last_backend == BackendType[backend]
    assert out.shape == (*shape[:-1], 40) and out.dtype == dtype

    x64 = x.detach().double().requires_grad_()
    w64 = mod.weight.detach().double().requires_grad_()
    b64 = mod.bias.detach().double().requires_grad_()
    ref = torch.nn.functional.linear(x64, w64, b64)
    assert_close(out, ref, dtype, msg="out")
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    assert_close(x.grad, x64.grad, dtype, msg="dx")
    assert_close(mod.weight.grad, w64.grad, dtype, msg="dw")
    assert_close(mod.bias.grad, b64.grad, dtype, msg="db")


def test_linear_gradient_accumulation_fusion(device):
    mod = turbo.modules.Linear(32, 16, bias=False, device=device, gradient_accumulation_fusion=True)
    mod.weight.main_grad = torch.zeros_like(mod.weight, dtype=torch.float32)
    x = torch.randn(4, 6, 32, device=device)
    g = torch.randn(4, 6, 16, device=device)
    mod(x).backward(g)
    expected = gemm_ref(g.reshape(-1, 16), x.reshape(-1, 32), trans_a=True)
    torch.testing.assert_close(mod.weight.main_grad.double(), expected, rtol=1e-4, atol=1e-4)
    assert mod.weight.grad is None


def test_linear_bad_input(device):
    mod = turbo.modules.Linear(16, 8, device=device)
    with pytest.raises(ValueError, match=r"last dim must be in_features=16, got shape \(3, 15\)"):
        mod(torch.randn(3, 15, device=device))


def test_linear_empty_batch(device):
    mod = turbo.modules.Linear(16, 8, device=device)
    x = torch.randn(0, 3, 16, device=device, requires_grad=True)
    out = mod(x)
    assert out.shape == (0, 3, 8)
    out.sum().backward()
    assert x.grad.shape == x.shape and torch.count_nonzero(mod.weight.grad) == 0


def test_linear_torch_compile(device):
    mod = turbo.modules.Linear(32, 24, device=device)
    x = torch.randn(3, 7, 32, device=device)
    compiled = torch.compile(mod, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), mod(x))


def test_linear_with_no_input_features_matches_nn_linear():
    """in_features = 0 (torch.nn.Linear takes it: the output is the bias); a reshape to (-1, 0) failed."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "Initializing zero-element tensors is a no-op"
        mod, ref = turbo.modules.Linear(0, 5), torch.nn.Linear(0, 5)
    ref.load_state_dict(mod.state_dict())
    x = torch.randn(2, 3, 0)
    assert torch.equal(mod(x), ref(x))
