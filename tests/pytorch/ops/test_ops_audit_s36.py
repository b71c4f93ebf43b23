"""Session 36 audit of gemm / grouped_gemm / rmsnorm / activations / mla_key_value: each test failed before
its fix. Fresh random inputs against fp64 references (tolerances from test_utils)."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import GroupedGemmDispatcher


def _grouped_ref(a, b, lens, trans_b):
    """fp64 out[rows_g] = a[rows_g] @ op(b[g]); rows past the groups: zeros."""
    a64, b64 = a.double(), b.double()
    out = torch.zeros(a.shape[0], b.shape[1] if trans_b else b.shape[2], dtype=torch.float64, device=a.device)
    start = 0
    for g, n in enumerate(lens.tolist()):
        out[start : start + n] = a64[start : start + n] @ (b64[g].t() if trans_b else b64[g])
        start += n
    return out


def _check_fp64(out, grad, a, b, lens, trans_b):
    """out and the gradients grad gave a and b against the fp64 grouped reference."""
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = _grouped_ref(a64, b64, lens, trans_b)
    ref.backward(grad.double())
    assert_close(out, ref, torch.float32, "out")
    assert_close(a.grad, a64.grad, torch.float32, "dgrad")
    assert_close(b.grad, b64.grad, torch.float32, "wgrad")


@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_one_group_keeps_fp32_under_autocast(trans_b, device):
    """G == 1 (the dense fast path) under torch.autocast: a's dtype out, as G > 1 and the docstring say.
    Before: the dense matmul ran under autocast (bf16 out from fp32 inputs) and the backward raised
    'expected m1 and m2 to have the same dtype' (bf16 grad_out @ fp32 b)."""
    M, K, N, used = 17, 33, 9, 13
    a = torch.randn(M, K, device=device, requires_grad=True)
    b = torch.randn((1, N, K) if trans_b else (1, K, N), device=device, requires_grad=True)
    lens = torch.tensor([used], device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=trans_b)
    assert out.dtype == torch.float32
    grad = torch.randn_like(out)
    out.backward(grad)
    _check_fp64(out, grad, a, b, lens, trans_b)


def test_grouped_gemm_one_group_honours_a_pinned_backend(device):
    """G == 1 with a pinned grouped_gemm backend runs that backend (forward and dgrad), and a pinned backend
    that cannot serve the inputs raises at the forward. Before: the dense path ignored the pin (CUTLASS on
    fp32 inputs returned a result, then only the wgrad raised, naming x / y)."""
    a = torch.randn(11, 15, device=device, requires_grad=True)
    b = torch.randn(1, 7, 15, device=device, requires_grad=True)
    lens = torch.tensor([11], device=device)
    GlobalBackendManager.set_grouped_gemm_backend("CUTLASS")  # bf16 only
    with pytest.raises(ValueError, match="backend CUTLASS .*cannot handle"):
        turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    GroupedGemmDispatcher.last_backend = None
    out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
    assert GroupedGemmDispatcher.last_backend is BackendType.TRITON
    grad = torch.randn_like(out)
    GroupedGemmDispatcher.last_backend = None
    out.backward(grad)
    assert GroupedGemmDispatcher.last_backend is BackendType.TRITON  # the dgrad
    _check_fp64(out, grad, a, b, lens, True)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON", "CUTLASS"])
@pytest.mark.parametrize("reverse", [False, True])
def test_main_grad_into_separate_but_equally_spaced_buffers(backend, reverse, device):
    """main_grad_into with one main_grad allocation per weight that happen to sit equally spaced (the CUDA
    caching allocator packs same-size blocks; here: DLPack views of one buffer, each its own storage).
    Before: main_grad_block's strided view over them reached past the first one's storage: RuntimeError
    'setStorage: ... out of bounds for storage of size 512'."""
    GlobalBackendManager.set_grouped_wgrad_accumulate_backend(backend)
    G, N, K, M = 3, 8, 16, 11
    buf = torch.randn(G * N * K, device=device)
    weights = []
    for g in range(G):
        slot = G - 1 - g if reverse else g
        w = torch.nn.Parameter((torch.randn(N, K, device=device) / K**0.5).bfloat16())
        w.main_grad = torch.from_dlpack(buf[slot * N * K : (slot + 1) * N * K].__dlpack__()).view(N, K)
        assert w.main_grad.untyped_storage().nbytes() == N * K * 4  # its own storage
        weights.append(w)
    before = torch.stack([w.main_grad.double() for w in weights])
    lens = torch.tensor([4, 0, 7], device=device)
    a = torch.randn(M, K, device=device).bfloat16().requires_grad_()
    b = torch.stack([w.detach() for w in weights]).requires_grad_()
    out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True, main_grad_into=weights)
    grad = torch.randn_like(out)
    out.backward(grad)
    want, start = before.clone(), 0
    for g, n in enumerate(lens.tolist()):
        want[g] += grad[start : start + n].double().t() @ a.detach()[start : start + n].double()
        start += n
    for g, w in enumerate(weights):
        assert_close(w.main_grad, want[g], torch.bfloat16, f"main_grad[{g}]")
    assert torch.equal(weights[1].main_grad.double(), before[1])  # the empty expert: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_key_value_without_heads_gives_a_zero_k_pe_gradient(dtype, device):
    """H == 0: k and v are empty and k_pe's gradient (a sum over no head) is zeros. Before: the kernel wrote
    no element of it, so k_pe.grad held whatever the allocator returned (3e38, NaN seen)."""
    B, S, nope, vd, R = 2, 3, 4, 5, 6
    for _ in range(4):  # leave freed, non-zero memory behind for the gradient's allocation
        dirty = torch.full((B, S, 1, R), float("nan"), dtype=dtype, device=device)
        del dirty
        kv = torch.randn(B, S, 0, nope + vd, dtype=dtype, device=device, requires_grad=True)
        k_pe = torch.randn(B, S, 1, R, dtype=dtype, device=device, requires_grad=True)
        k, v = turbo.ops.mla_key_value(kv, k_pe, nope)
        assert k.shape == (B, S, 0, nope + R) and v.shape == (B, S, 0, vd)
        (k.sum() + v.sum()).backward()
        assert kv.grad.shape == kv.shape
        assert k_pe.grad.shape == k_pe.shape and torch.count_nonzero(k_pe.grad) == 0, k_pe.grad


def test_grouped_gemm_wgrad_into_takes_one_tensor(device):
    """wgrad_into=w (one weight, as gemm's wgrad_into) is taken as [w]. Before: tuple(w) split it into its G
    non-leaf slices and raised 'wgrad_into[0] must be a leaf tensor that requires grad' for a Parameter;
    wgrad_into=5 raised "'int' object is not iterable"; main_grad_into=w complained of slice 0's main_grad."""
    G, N, K, M = 2, 8, 16, 9
    w = torch.nn.Parameter(torch.randn(G, N, K, device=device) / K**0.5)
    a = torch.randn(M, K, device=device).bfloat16().requires_grad_()
    lens = torch.tensor([4, 5], device=device)
    out = turbo.ops.grouped_gemm(a, w.detach().bfloat16(), lens, trans_b=True, wgrad_into=w)
    grad = torch.randn_like(out)
    out.backward(grad)
    w64 = w.detach().double().requires_grad_()
    _grouped_ref(a.detach(), w64, lens, True).backward(grad.double())
    assert w.grad is not None and w.grad.dtype == torch.float32
    assert_close(w.grad, w64.grad, torch.bfloat16, "wgrad into w")
    b = w.detach().bfloat16()
    with pytest.raises(TypeError, match="wgrad_into must be a tensor or a list/tuple of tensors, got int"):
        turbo.ops.grouped_gemm(a, b, lens, trans_b=True, wgrad_into=5)
    with pytest.raises(TypeError, match="main_grad_into must be a list/tuple of the G weights, got Param"):
        turbo.ops.grouped_gemm(a, b, lens, trans_b=True, main_grad_into=w)


@pytest.mark.parametrize("op", ["rmsnorm", "rmsnorm_residual"])
def test_rmsnorm_zero_centered_gamma_must_be_a_bool(op, device):
    """zero_centered_gamma="false" (a config string) was truthy: the weight silently read as gamma - 1.
    Bools (and 0 / 1) still work and give the fp64 reference."""
    x = torch.randn(5, 33, device=device)
    w = torch.randn(33, device=device)
    args = (x, w) if op == "rmsnorm" else (x, torch.randn_like(x), w)
    fn = getattr(turbo.ops, op)
    with pytest.raises(TypeError, match="zero_centered_gamma must be a bool, got 'false'"):
        fn(*args, 1e-6, "false")
    with pytest.raises(TypeError, match="zero_centered_gamma must be a bool, got None"):
        fn(*args, 1e-6, None)
    s = x.double() if op == "rmsnorm" else x.double() + args[1].double()
    for flag, gamma in ((False, w.double()), (1, w.double() + 1)):
        out = fn(*args, 1e-6, flag)
        y = out if op == "rmsnorm" else out[0]
        want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
        assert_close(y, want, torch.float32, str(flag))
