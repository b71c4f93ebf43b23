"""turbo.ops.gemm: every layout x dtype x backend vs an fp64 reference, edge shapes, bad input,
main_grad accumulation, torch.compile, backend pinning, and sm_90 compilation of every kernel."""

import pytest
import torch
from ref.gemm_ref import gemm_grads_ref, gemm_ref
from test_utils import assert_close
from triton_compile_utils import compile_for_sm90, run_compile_check

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.gemm.gemm_impl import GemmDispatcher
from primus_turbo.triton.gemm import gemm_kernel as gk

HAS_CUDA = torch.cuda.is_available()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]


def _backends():
    return ["TORCH", "TRITON", pytest.param("CUBLAS", marks=pytest.mark.gpu)]


def _operands(m, n, k, trans_a, trans_b, dtype, device, requires_grad=True):
    a = torch.randn((k, m) if trans_a else (m, k), dtype=dtype, device=device)
    b = torch.randn((n, k) if trans_b else (k, n), dtype=dtype, device=device)
    return a.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


def _check_fwd_bwd(m, n, k, trans_a, trans_b, dtype, device, backend, ref_acc=torch.float64):
    GlobalBackendManager.set_gemm_backend(backend)
    a, b = _operands(m, n, k, trans_a, trans_b, dtype, device)
    out = turbo.ops.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    assert GemmDispatcher.last_backend == BackendType[backend]
    assert out.shape == (m, n) and out.dtype == dtype
    ref = gemm_ref(a, b, trans_a, trans_b) if ref_acc == torch.float64 else None
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref_da, ref_db = gemm_grads_ref(a, b, grad_out, trans_a, trans_b, acc=ref_acc)
    if ref is None:
        ref = (a.detach().to(ref_acc).T if trans_a else a.detach().to(ref_acc)) @ (
            b.detach().to(ref_acc).T if trans_b else b.detach().to(ref_acc)
        )
    tag = f"{backend} {dtype} trans_a={trans_a} trans_b={trans_b} {m}x{n}x{k}"
    assert_close(out, ref, dtype, msg=f"out {tag}")
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert_close(a.grad, ref_da, dtype, msg=f"da {tag}")
    assert_close(b.grad, ref_db, dtype, msg=f"db {tag}")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
def test_gemm_layouts(trans_a, trans_b, dtype, backend, device):
    _check_fwd_bwd(64, 96, 80, trans_a, trans_b, dtype, device, backend)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("m,n,k", [(1, 24, 40), (17, 40, 40), (33, 20, 17), (130, 72, 136)])
def test_gemm_odd_shapes(m, n, k, backend, device):
    _check_fwd_bwd(m, n, k, False, True, torch.bfloat16, device, backend)
    _check_fwd_bwd(m, n, k, True, False, torch.float32, device, backend)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("m,n,k", [(0, 16, 32), (16, 0, 32), (16, 24, 0), (0, 0, 0)])
def test_gemm_zero_size(m, n, k, backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    a, b = _operands(m, n, k, False, True, torch.bfloat16, device)
    out = turbo.ops.gemm(a, b, trans_b=True)
    assert out.shape == (m, n)
    assert torch.count_nonzero(out) == 0
    out.backward(torch.randn_like(out))
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert torch.count_nonzero(a.grad) == 0 and torch.count_nonzero(b.grad) == 0


@pytest.mark.parametrize("backend", _backends())
def test_gemm_non_contiguous(backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    base_a = torch.randn(48, 3 * 40, dtype=torch.bfloat16, device=device)
    base_b = torch.randn(2 * 40, 56, dtype=torch.bfloat16, device=device)
    a = base_a[:, ::3].requires_grad_()  # [48, 40] column stride 3: neither operand is TMA-able
    b = base_b[::2].requires_grad_()  # [40, 56] row stride 112
    assert not a.is_contiguous() and not b.is_contiguous()
    out = turbo.ops.gemm(a, b)
    assert_close(out, gemm_ref(a, b), torch.bfloat16, msg="out")
    grad_out = torch.randn(56, 48, dtype=torch.bfloat16, device=device).T  # non-contiguous grad
    out.backward(grad_out)
    ref_da, ref_db = gemm_grads_ref(a, b, grad_out)
    assert_close(a.grad, ref_da, torch.bfloat16, msg="da")
    assert_close(b.grad, ref_db, torch.bfloat16, msg="db")


@pytest.mark.parametrize("backend", _backends())
def test_gemm_out_dtype(backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    a, b = _operands(40, 64, 72, False, False, torch.bfloat16, device)
    out = turbo.ops.gemm(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    # the fp32 output keeps the accumulator unrounded
    torch.testing.assert_close(out.double(), gemm_ref(a, b), rtol=1e-5, atol=1e-4)
    out.backward(torch.randn_like(out))
    assert a.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.bfloat16


def test_gemm_bad_input(device):
    a = torch.randn(8, 16, device=device)
    b = torch.randn(16, 4, device=device)
    with pytest.raises(ValueError, match=r"a must be 2-D, got shape \(2, 8, 16\)"):
        turbo.ops.gemm(a.expand(2, 8, 16), b)
    with pytest.raises(ValueError, match=r"b must be 2-D, got shape \(16,\)"):
        turbo.ops.gemm(a, b[:, 0])
    inner = r"inner dimensions differ: op\(a\) is \[8, 16\].*op\(b\) is \[4, 16\]"
    with pytest.raises(ValueError, match=inner):
        turbo.ops.gemm(a, b.T.contiguous())
    with pytest.raises(ValueError, match="inner dimensions differ"):
        turbo.ops.gemm(a, b, trans_a=True)
    with pytest.raises(TypeError, match="same dtype, got a torch.float32 and b torch.bfloat16"):
        turbo.ops.gemm(a, b.bfloat16())
    with pytest.raises(TypeError, match=r"a.dtype torch.int32 is not supported; accepted: float16"):
        turbo.ops.gemm(a.int(), b.int())
    with pytest.raises(TypeError, match="out_dtype torch.int8 is not supported"):
        turbo.ops.gemm(a, b, out_dtype=torch.int8)
    with pytest.raises(TypeError, match="a must be a torch.Tensor, got list"):
        turbo.ops.gemm([[1.0]], b)
    with pytest.raises(TypeError, match="trans_b must be a bool, got int"):
        turbo.ops.gemm(a, b, trans_b=1)
    with pytest.raises(ValueError, match="same device, got a on meta"):
        turbo.ops.gemm(a.to("meta"), b)


@pytest.mark.parametrize("backend", _backends())
def test_gemm_main_grad_accumulation(backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    x = torch.randn(24, 40, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 40, dtype=torch.bfloat16, device=device))
    init = torch.randn(32, 40, dtype=torch.float32, device=device)
    w.main_grad = init.clone()
    w.grad_added_to_main_grad = False
    w.zero_out_wgrad = True
    grads = []
    for _ in range(2):  # two micro-batches accumulate
        out = turbo.ops.gemm(x, w, trans_b=True, accumulate_into_main_grad=True)
        g = torch.randn_like(out)
        grads.append(gemm_grads_ref(x, w, g, False, True)[1])
        out.backward(g)
    expected = init.double() + grads[0] + grads[1]
    torch.testing.assert_close(w.main_grad.double(), expected, rtol=1e-4, atol=1e-3)
    assert w.grad_added_to_main_grad is True
    assert GemmDispatcher.last_backend == BackendType[backend]
    assert w.grad is not None and torch.count_nonzero(w.grad) == 0  # zero_out_wgrad placeholder
    assert x.grad is not None

    # without the Megatron attribute the weight gets no .grad at all
    v = torch.nn.Parameter(torch.randn(32, 40, dtype=torch.bfloat16, device=device))
    v.main_grad = torch.zeros(32, 40, dtype=torch.float32, device=device)
    turbo.ops.gemm(x, v, trans_b=True, accumulate_into_main_grad=True).sum().backward()
    assert v.grad is None and torch.count_nonzero(v.main_grad) > 0

    u = torch.nn.Parameter(torch.randn(32, 40, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="needs b.main_grad"):
        turbo.ops.gemm(x, u, trans_b=True, accumulate_into_main_grad=True)


def test_gemm_torch_compile_fullgraph(device):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    def f(a, b):
        return turbo.ops.gemm(a, b, trans_b=True).float().square().sum()

    a, b = _operands(32, 48, 64, False, True, torch.float32, device)
    recorder = AotEagerAndRecordGraphs()
    loss = torch.compile(f, fullgraph=True, backend=recorder)(a, b)
    loss.backward()
    # the forward GEMM and both backward GEMMs are opaque primus_turbo::gemm nodes
    fw_code = "".join(g.code for g in recorder.fw_graphs)
    bw_code = "".join(g.code for g in recorder.bw_graphs)
    assert fw_code.count("primus_turbo.gemm") == 1 and bw_code.count("primus_turbo.gemm") == 2
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    f(a2, b2).backward()
    torch.testing.assert_close(loss, f(a2, b2).detach())
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_gemm_backend_selection(device, monkeypatch):
    a, b = _operands(16, 24, 32, False, False, torch.float32, device, requires_grad=False)
    turbo.ops.gemm(a, b)
    assert GemmDispatcher.last_backend == (BackendType.CUBLAS if HAS_CUDA else BackendType.TORCH)
    # TRITON pinned on fp64 (which TORCH/CUBLAS serve) must refuse, never fall back
    GlobalBackendManager.set_gemm_backend("TRITON")
    with pytest.raises(ValueError, match="backend TRITON .* cannot handle these inputs"):
        turbo.ops.gemm(a.double(), b.double())
    GlobalBackendManager.set_gemm_backend(None)
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp32:TRITON,other:TORCH")
    turbo.ops.gemm(a, b)
    assert GemmDispatcher.last_backend == BackendType.TRITON
    out = turbo.ops.gemm(a.double(), b.double())
    assert GemmDispatcher.last_backend == BackendType.TORCH and out.dtype == torch.float64
    if not HAS_CUDA:
        monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "CUBLAS")
        with pytest.raises(ValueError, match="backend CUBLAS .* cannot handle"):
            turbo.ops.gemm(a, b)


def test_gemm_autotune_caches_per_shape(device):
    GlobalBackendManager.set_auto_tune(True)
    a, b = _operands(16, 24, 32, False, False, torch.float32, device, requires_grad=False)
    out = turbo.ops.gemm(a, b)
    chosen = GemmDispatcher.last_backend
    assert chosen in GemmDispatcher.candidates(a=a, b=b, trans_a=False, trans_b=False, out_dtype=a.dtype)
    assert len(GemmDispatcher._cache) == 1
    turbo.ops.gemm(a, b)
    assert len(GemmDispatcher._cache) == 1 and GemmDispatcher.last_backend == chosen
    turbo.ops.gemm(a[:8], b)
    assert len(GemmDispatcher._cache) == 2
    assert_close(out, gemm_ref(a, b), torch.float32)


@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
def test_gemm_autotune_key_describes_the_logical_operands(trans_a, trans_b, device):
    """make_key reads a's and b's own strides (no transposed views): (M, N, K) and each logical operand's
    K-major flag as the views A[M, K] = op(a) and B[K, N] = op(b) give them, for a row-sliced a too."""
    a, b = _operands(24, 40, 56, trans_a, trans_b, torch.bfloat16, device, requires_grad=False)
    for a_ in (a, a[:, 8:] if trans_a else a[8:]):  # a strided view with a shifted base
        key = GemmDispatcher.make_key(a=a_, b=b, trans_a=trans_a, trans_b=trans_b, out_dtype=torch.float32)
        al, bl = (a_.T if trans_a else a_), (b.T if trans_b else b)
        aligned = a_.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        expected = (al.shape[0], bl.shape[1], al.shape[1], torch.bfloat16, torch.float32, a.device.type,
                    al.stride(1) == 1, bl.stride(0) == 1, aligned)  # fmt: skip
        assert key == expected
    assert key[0] == 16 and key[6] == (not trans_a) and key[7] == trans_b


@pytest.mark.parametrize("triton_ms,expected", [(0.99, "default"), (0.90, "TRITON")])
def test_gemm_autotune_margin_favours_default(triton_ms, expected, device, monkeypatch):
    a, b = _operands(16, 24, 32, False, False, torch.float32, device, requires_grad=False)
    kwargs = {"a": a, "b": b, "trans_a": False, "trans_b": False, "out_dtype": a.dtype}
    default = GemmDispatcher.default_backend(**kwargs)
    fake_ms = {default: 1.0, BackendType.TRITON: triton_ms}
    calls = iter(GemmDispatcher.candidates(**kwargs))

    def fake_time(fn, on_cuda):
        return fake_ms.get(next(calls), 5.0)

    monkeypatch.setattr(GemmDispatcher, "_time", staticmethod(fake_time))
    chosen = GemmDispatcher._autotune(**kwargs)
    assert chosen == (default if expected == "default" else BackendType.TRITON)


# Llama/DeepSeek training shapes, M = 8192 tokens, as nn.Linear runs them (x @ W.T).
TRAINING_NK = [(n, k) for n in (2048, 4096, 7168, 14336) for k in (2048, 4096, 7168, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["CUBLAS", "TRITON", "TORCH"])
@pytest.mark.parametrize("n,k", TRAINING_NK)
def test_gemm_training_shapes_gpu(n, k, backend, device):
    # fp32 reference on the GPU (TF32 off): an fp64 one at these sizes costs seconds per test
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_fwd_bwd(8192, n, k, False, True, torch.bfloat16, device, backend, ref_acc=torch.float32)
    if backend == "TRITON":  # all three GEMMs (fwd NT, dgrad NN, wgrad TN) take the TMA kernel
        x, w = _operands(8192, n, k, False, True, torch.bfloat16, device, requires_grad=False)
        dy = torch.empty(8192, n, dtype=torch.bfloat16, device=device)
        for lhs, rhs in ((x, w.T), (dy, w), (dy.T, x)):
            assert gk.tma_supported(lhs, rhs, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.deterministic
@pytest.mark.parametrize("backend", ["CUBLAS", "TRITON"])
def test_gemm_bitwise_deterministic(backend, device):
    GlobalBackendManager.set_gemm_backend(backend)
    a, b = _operands(8192, 4096, 4096, False, True, torch.bfloat16, device, requires_grad=False)
    first = turbo.ops.gemm(a, b, trans_b=True)
    for _ in range(3):
        assert torch.equal(turbo.ops.gemm(a, b, trans_b=True), first)


# --------------------------------------------------------------------------------------------
# Triton kernels: both variants, every config, in the interpreter (CPU) or on the GPU
# --------------------------------------------------------------------------------------------
def _logical(m, n, k, trans_a, trans_b, dtype, device):
    a, b = _operands(m, n, k, trans_a, trans_b, dtype, device, requires_grad=False)
    return (a.T if trans_a else a), (b.T if trans_b else b)


@pytest.mark.parametrize("variant", ["tma", "tma_device"])
@pytest.mark.parametrize("trans_a,trans_b", LAYOUTS)
def test_triton_tma_variant_layouts(trans_a, trans_b, variant, device):
    a, b = _logical(40, 48, 40, trans_a, trans_b, torch.float16, device)
    assert gk.tma_supported(a, b, torch.float16)
    out = gk.gemm_triton(a, b, torch.float16, variant=variant)
    assert_close(out, a.double() @ b.double(), torch.float16, msg=variant)


@pytest.mark.parametrize("variant", ["tma", "tma_device"])
@pytest.mark.parametrize("idx", range(len(gk.TMA_CONFIGS)))
def test_triton_tma_every_config(idx, variant, device):
    m, n, k = (304, 520, 136) if HAS_CUDA else (136, 264, 72)  # several tiles + M/N/K tails
    a, b = _logical(m, n, k, idx % 2 == 1, idx % 3 == 0, torch.bfloat16, device)
    configs = gk.TMA_CONFIGS if variant == "tma" else gk.TMA_DEVICE_CONFIGS
    out = gk.gemm_triton(a, b, torch.bfloat16, variant=variant, config=configs[idx])
    assert_close(out, a.double() @ b.double(), torch.bfloat16, msg=f"{variant} config {idx}")


def test_triton_default_variant_is_device_tma(device, monkeypatch):
    """Aligned 16-bit operands take the kernel that makes its descriptors on the device (no host
    descriptors per launch); an unknown variant name is refused."""
    calls = []
    monkeypatch.setattr(gk, "_launch_tma_device", lambda *args: calls.append("tma_device"))
    monkeypatch.setattr(gk, "_launch_tma", lambda *args: calls.append("tma"))
    a, b = _logical(32, 48, 64, False, True, torch.bfloat16, device)
    gk.gemm_triton(a, b, torch.bfloat16)
    assert calls == ["tma_device"]
    with pytest.raises(ValueError, match="variant must be None or one of"):
        gk.gemm_triton(a, b, torch.bfloat16, variant="wgmma")


def test_scratch_allocator_set_per_thread_and_user_allocator_kept():
    """Triton's allocator is a context variable: a new thread (autograd's CUDA backward thread) starts
    without one, so the device-TMA launcher sets a torch allocator there; one the user set is kept."""
    import threading

    import triton
    from triton.runtime import _allocation

    seen = {}

    def fresh_thread():
        seen["before"] = _allocation._allocator.get()
        gk.ensure_scratch_allocator()
        seen["after"] = _allocation._allocator.get()

    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join()
    assert isinstance(seen["before"], _allocation.NullAllocator)
    assert seen["after"] is gk._scratch

    def user_allocator(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8)

    def with_user_allocator():
        triton.set_allocator(user_allocator)
        gk.ensure_scratch_allocator()
        seen["user"] = _allocation._allocator.get()

    thread = threading.Thread(target=with_user_allocator)
    thread.start()
    thread.join()
    assert seen["user"] is user_allocator


@pytest.mark.parametrize("idx", range(len(gk.PTR_CONFIGS)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_pointer_every_config(idx, dtype, device):
    fake = {"a_ptr": torch.empty(0, dtype=dtype)}
    if HAS_CUDA and gk.PTR_CONFIGS[idx] not in gk.prune_ptr_configs(gk.PTR_CONFIGS, fake):
        pytest.skip("config pruned for this dtype on sm_90 (shared memory)")
    m, n, k = (300, 260, 70) if HAS_CUDA else (136, 140, 70)
    a, b = _logical(m, n, k, idx % 2 == 0, idx % 2 == 1, dtype, device)
    out = gk.gemm_triton(a, b, dtype, variant="pointer", config=gk.PTR_CONFIGS[idx])
    assert_close(out, a.double() @ b.double(), dtype, msg=f"config {idx}")


def test_triton_pointer_kernel_offsets_past_2_to_the_31(device):
    """Row offsets times strides past 2^31 elements (an operand that large, e.g. an LM head's logits): the
    pointer kernel's int32 products wrapped (a segfault in the interpreter, wrong memory on a GPU). Three rows
    of a [3, 16] view with row stride 2^30 + 1 over a lazily allocated buffer (only they are touched)."""
    stride = 2**30 + 1
    buf = torch.empty(2 * stride + 16, dtype=torch.bfloat16, device=device)
    a = buf.as_strided((3, 16), (stride, 1))  # misaligned: the pointer kernel, not TMA
    a.copy_(torch.randn(3, 16, device=device).bfloat16())
    b = torch.randn(16, 8, device=device).bfloat16()
    GlobalBackendManager.set_gemm_backend("TRITON")
    try:
        out = turbo.ops.gemm(a, b)
    finally:
        GlobalBackendManager.reset()
    assert_close(out, a.double() @ b.double(), torch.bfloat16)


def test_triton_tma_preconditions(device):
    # K=20 bf16: a row stride of 40 bytes is not 16-byte aligned -> pointer kernel; forcing TMA errors.
    a, b = _logical(16, 32, 20, False, False, torch.bfloat16, device)
    assert not gk.tma_supported(a, b, torch.bfloat16)
    for variant in ("tma", "tma_device"):
        with pytest.raises(ValueError, match="TMA kernel needs"):
            gk.gemm_triton(a, b, torch.bfloat16, variant=variant)
    assert_close(gk.gemm_triton(a, b, torch.bfloat16), a.double() @ b.double(), torch.bfloat16)
    a32, b32 = _logical(16, 32, 32, False, False, torch.float32, device)
    assert not gk.tma_supported(a32, b32, torch.float32)  # fp32 always takes the pointer kernel


# --------------------------------------------------------------------------------------------
# sm_90 compilation (catches GPU-only compile errors and shared-memory overflow on a CPU)
# --------------------------------------------------------------------------------------------
def _tma_signature(dtype, a_box, b_box, c_box):
    return {
        "a_desc": f"tensordesc<{dtype}[{a_box[0]},{a_box[1]}]>",
        "b_desc": f"tensordesc<{dtype}[{b_box[0]},{b_box[1]}]>",
        "c_desc": f"tensordesc<{dtype}[{c_box[0]},{c_box[1]}]>",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        **{name: "constexpr" for name in ("A_K_MAJOR", "B_K_MAJOR", "NUM_SMS", "BLOCK_M", "BLOCK_N")},
        **{name: "constexpr" for name in ("BLOCK_K", "GROUP_M", "EPILOGUE_SUBTILE")},
    }


def _compile_tma(config, dtype, a_k_major, b_k_major):
    kw = config.kwargs
    bm, bn, bk = kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"]
    a_box = [bm, bk] if a_k_major else [bk, bm]
    b_box = [bn, bk] if b_k_major else [bk, bn]
    c_box = [bm, bn // 2] if kw["EPILOGUE_SUBTILE"] else [bm, bn]
    constexprs = {"A_K_MAJOR": a_k_major, "B_K_MAJOR": b_k_major, "NUM_SMS": 132, **kw}
    return compile_for_sm90(
        gk.gemm_tma_persistent_kernel,
        _tma_signature(dtype, a_box, b_box, c_box),
        constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _compile_tma_device(config, dtype, a_k_major, b_k_major):
    signature = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}"}
    signature.update({n: "i32" for n in ("M", "N", "K", "stride_a", "stride_b", "stride_c")})
    signature.update({n: "constexpr" for n in ("A_K_MAJOR", "B_K_MAJOR", "NUM_SMS", "BLOCK_M", "BLOCK_N")})
    signature.update({n: "constexpr" for n in ("BLOCK_K", "GROUP_M", "EPILOGUE_SUBTILE")})
    constexprs = {"A_K_MAJOR": a_k_major, "B_K_MAJOR": b_k_major, "NUM_SMS": 132, **config.kwargs}
    return compile_for_sm90(
        gk.gemm_tma_device_persistent_kernel,
        signature,
        constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _compile_pointer(config, dtype):
    signature = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}"}
    signature.update({n: "i32" for n in ("M", "N", "K")})
    signature.update({n: "i64" for n in ("stride_am", "stride_ak", "stride_bk", "stride_bn")})
    signature.update({"stride_cm": "i64", "stride_cn": "i64"})
    signature.update({n: "constexpr" for n in ("NUM_SMS", "INPUT_PRECISION", "BLOCK_M", "BLOCK_N")})
    signature.update({"BLOCK_K": "constexpr", "GROUP_M": "constexpr"})
    constexprs = {"NUM_SMS": 132, "INPUT_PRECISION": "tf32", **config.kwargs}
    return compile_for_sm90(
        gk.gemm_persistent_kernel,
        signature,
        constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _compile_all():
    """Every TMA config (bf16, K-major), every layout (fp16), every unpruned pointer config."""
    for i, config in enumerate(gk.TMA_CONFIGS):
        compiled = _compile_tma(config, "bf16", True, True)
        assert "wgmma" in compiled.asm["ptx"], f"TMA config {i}: no wgmma (mma.sync fallback)"
        print(f"tma config {i}: {compiled.metadata.shared} B shared", flush=True)
    for a_k_major, b_k_major in [(True, False), (False, True), (False, False)]:
        compiled = _compile_tma(gk.TMA_CONFIGS[0], "fp16", a_k_major, b_k_major)
        assert "wgmma" in compiled.asm["ptx"], f"TMA layout {a_k_major, b_k_major}: no wgmma"
    for i, config in enumerate(gk.TMA_DEVICE_CONFIGS):
        compiled = _compile_tma_device(config, "bf16", i % 2 == 0, i % 3 != 0)
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and "tensormap" in ptx, f"device TMA config {i}: no wgmma or device descriptor"
        print(f"tma_device config {i}: {compiled.metadata.shared} B shared", flush=True)
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        fake = {"a_ptr": torch.empty(0, dtype=torch_dtype)}
        for i, config in enumerate(gk.prune_ptr_configs(gk.PTR_CONFIGS, fake)):
            compiled = _compile_pointer(config, dtype)
            print(f"pointer config {i} {dtype}: {compiled.metadata.shared} B shared", flush=True)


def test_gemm_kernels_compile_sm90():
    # A fresh process without TRITON_INTERPRET: Triton's code generator fails on a compile in an
    # interpreter-mode process (ir.value has no dtype).
    run_compile_check("test_gemm")


if __name__ == "__main__":
    _compile_all()
