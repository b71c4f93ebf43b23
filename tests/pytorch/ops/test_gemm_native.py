"""ops.gemm's plain calls on cuBLAS: when forward, dgrad and wgrad all resolve to CUBLAS, the call is torch.mm
with torch's autograd (the same cuBLAS calls without the autograd.Function and three dispatches).

CPU: the decision (pins, environment, autotune records, reset) and the backward's record, with the CUBLAS
slot served by the TORCH backend. GPU: the native path's outputs and gradients, autotune's switch to it
after one backward, and the calls that must keep the Function (pinned TRITON, fp32 output); under autocast,
fp32 inputs are cast to bf16 first and the call is plain."""

import pytest
import torch
from ref.gemm_ref import gemm_grads_ref, gemm_ref
from test_utils import assert_close

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.gemm.gemm_impl import GemmDispatcher, GemmTorchBackend
from primus_turbo.pytorch.ops.gemm import GemmFunction

B = BackendType


def _ab(dtype=torch.bfloat16, device="cpu", trans_b=True):
    a = torch.randn(24, 40, dtype=dtype, device=device, requires_grad=True)
    b = torch.randn(*((16, 40) if trans_b else (40, 16)), dtype=dtype, device=device, requires_grad=True)
    return a, b


def test_pins_and_the_default_decide_without_a_key(monkeypatch):
    a, b = _ab()
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (True, None)  # no pin, no autotune
    GlobalBackendManager.set_gemm_backend("CUBLAS")
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (True, None)
    GlobalBackendManager.set_gemm_backend("TRITON")
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (False, None)
    GlobalBackendManager.reset()
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "bf16:TRITON")
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (False, None)
    a32, b32 = _ab(torch.float32)  # the pin is for bf16 only
    assert GemmDispatcher.plain_call_on_cublas(a32, b32, False, True) == (True, None)


def test_autotune_needs_a_record_of_all_three_on_cublas():
    a, b = _ab()
    GlobalBackendManager.set_auto_tune(True)
    on, key = GemmDispatcher.plain_call_on_cublas(a, b, False, True)
    assert not on and key == ("bf16",) + GemmDispatcher.make_key(
        a=a, b=b, trans_a=False, trans_b=True, out_dtype=torch.bfloat16
    )
    GemmDispatcher.record_all_cublas(key, B.CUBLAS, B.CUBLAS, B.TRITON)
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (False, key)
    GemmDispatcher.record_all_cublas(key, B.CUBLAS, B.CUBLAS, B.CUBLAS)
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (True, key)
    assert GemmDispatcher.plain_call_on_cublas(a[:8], b, False, True)[0] is False  # another shape
    GlobalBackendManager.reset()  # clears the records with the autotune cache
    GlobalBackendManager.set_auto_tune(True)
    assert GemmDispatcher.plain_call_on_cublas(a, b, False, True) == (False, key)


@pytest.mark.parametrize("contiguous_grad", [True, False])
def test_the_backward_records_the_three_backends(contiguous_grad, monkeypatch):
    """The CUBLAS slot runs the TORCH backend here: forward, dgrad and wgrad all report CUBLAS, so the key is
    recorded True; a pin to TORCH records False. A non-contiguous output gradient records nothing (the
    dgrad/wgrad keys assumed a contiguous one)."""
    monkeypatch.setitem(GemmDispatcher.backends, B.CUBLAS, GemmTorchBackend)
    for pin, expected in (("CUBLAS", True), ("TORCH", False)):
        GemmDispatcher.clear_cache()
        GlobalBackendManager.set_gemm_backend(pin)
        a, b = _ab(torch.float32)
        key = ("fp32", "test-key")
        out = GemmFunction.apply(a, b, False, True, torch.float32, False, key)
        grad = torch.randn(out.shape[1], out.shape[0]).T if not contiguous_grad else torch.randn_like(out)
        out.backward(grad)
        assert GemmDispatcher._all_cublas == ({key: expected} if contiguous_grad else {})
        ref_da, ref_db = gemm_grads_ref(a, b, grad, False, True)
        assert_close(a.grad, ref_da, torch.float32)
        assert_close(b.grad, ref_db, torch.float32)


LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


def _cuda_operands(trans_a, trans_b, dtype=torch.bfloat16):
    m, n, k = 192, 136, 264
    a = torch.randn((k, m) if trans_a else (m, k), dtype=dtype, device="cuda", requires_grad=True)
    b = torch.randn((n, k) if trans_b else (k, n), dtype=dtype, device="cuda", requires_grad=True)
    return a, b


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
def test_default_plain_call_is_torch_mm_with_the_reference_gradients(trans_a, trans_b):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    a, b = _cuda_operands(trans_a, trans_b)
    out = turbo.ops.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    assert type(out.grad_fn).__name__ == "MmBackward0" and GemmDispatcher.last_backend is B.CUBLAS
    assert_close(out, gemm_ref(a, b, trans_a, trans_b), torch.bfloat16)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_da, ref_db = gemm_grads_ref(a, b, grad, trans_a, trans_b)
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert_close(a.grad, ref_da, torch.bfloat16)
    assert_close(b.grad, ref_db, torch.bfloat16)


@pytest.mark.gpu
def test_autotune_switches_to_torch_mm_after_an_all_cublas_backward():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    GlobalBackendManager.set_auto_tune(True)
    a, b = _cuda_operands(False, True)
    out = turbo.ops.gemm(a, b, trans_b=True)
    assert type(out.grad_fn).__name__ == "GemmFunctionBackward"  # nothing recorded yet
    out.backward(torch.randn_like(out))
    on, key = GemmDispatcher.plain_call_on_cublas(a, b, False, True)
    assert key in GemmDispatcher._all_cublas
    again = turbo.ops.gemm(a, b, trans_b=True)
    assert (type(again.grad_fn).__name__ == "MmBackward0") == on
    assert_close(again, gemm_ref(a, b, False, True), torch.bfloat16)


@pytest.mark.gpu
def test_calls_that_keep_the_function():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    a, b = _cuda_operands(False, True)
    GlobalBackendManager.set_gemm_backend("TRITON")
    assert type(turbo.ops.gemm(a, b, trans_b=True).grad_fn).__name__ == "GemmFunctionBackward"
    GlobalBackendManager.reset()
    out32 = turbo.ops.gemm(a, b, trans_b=True, out_dtype=torch.float32)
    assert type(out32.grad_fn).__name__ == "GemmFunctionBackward" and out32.dtype == torch.float32
    a32, b32 = (t.detach().float().requires_grad_() for t in (a, b))
    with torch.autocast("cuda", dtype=torch.bfloat16):  # cast to bf16 first (as torch.mm's autocast): plain
        out = turbo.ops.gemm(a32, b32, trans_b=True)
    assert type(out.grad_fn).__name__ == "MmBackward0" and out.dtype == torch.bfloat16
