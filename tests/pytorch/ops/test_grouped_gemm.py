"""turbo.ops.grouped_gemm: every backend against the fp64 reference, fwd + dgrad + wgrad."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import grouped_gemm_grads_ref, grouped_gemm_ref, make_group_lens
from test_utils import assert_close, assert_snr, fp8_snr_gate
from triton_compile_utils import compile_for_sm90, run_compile_check

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm import grouped_gemm_fp8_impl as f8
from primus_turbo.pytorch.kernels.grouped_gemm import grouped_gemm_impl as bf
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (
    GroupedGemmDispatcher,
    GroupedGemmVariableKDispatcher,
    cutlass_offsets,
)
from primus_turbo.triton.grouped_gemm import grouped_gemm_kernel as kmod

BACKENDS = ["TORCH", "TRITON", "CUTLASS"]


def _run(a, b, group_lens, trans_b, grad_out):
    a = a.clone().requires_grad_()
    b = b.clone().requires_grad_()
    out = turbo.ops.grouped_gemm(a, b, group_lens, trans_b=trans_b)
    out.backward(grad_out)
    return out, a.grad, b.grad


def _check(backend, dtype, G, M, K, N, kind, trans_b, device):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    group_lens = make_group_lens(M, G, kind, device)
    a = torch.randn(M, K, dtype=dtype, device=device)
    b = torch.randn((G, N, K) if trans_b else (G, K, N), dtype=dtype, device=device) / K**0.5
    grad_out = torch.randn(M, N, dtype=dtype, device=device)
    out, da, db = _run(a, b, group_lens, trans_b, grad_out)
    ref = grouped_gemm_ref(a, b, group_lens, trans_b)
    ref_da, ref_db = grouped_gemm_grads_ref(a, b, group_lens, grad_out, trans_b)
    tag = f"{backend} {dtype} G={G} M={M} K={K} N={N} {kind} trans_b={trans_b}"
    assert_close(out, ref, dtype, msg=f"out {tag}")
    assert_close(da, ref_da, dtype, msg=f"grad_a {tag}")
    # wgrad sums over each expert's rows: compare every expert relative to its own gradient's scale (a
    # global scale lets the big expert of a skewed routing hide a small expert's error ~10x over)
    for g in torch.nonzero(group_lens).flatten().tolist():
        scale = ref_db[g].abs().max().clamp_min(1e-6)
        rows = int(group_lens[g])
        assert_close(db[g] / scale, ref_db[g] / scale, dtype, msg=f"grad_b expert {g} ({rows} rows) {tag}")
    for g in torch.nonzero(group_lens == 0).flatten().tolist():
        assert torch.count_nonzero(db[g]) == 0, f"{tag}: wgrad of empty expert {g} is not exactly zero"
    return group_lens


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_fp32(backend, kind, trans_b, device):
    if backend == "CUTLASS":
        pytest.skip("torch._grouped_mm is bf16-only")
    _check(backend, torch.float32, 5, 150, 48, 40, kind, trans_b, device)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_grouped_gemm_bf16(backend, kind, device):
    _check(backend, torch.bfloat16, 4, 128, 64, 32, kind, True, device)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_grouped_gemm_unaligned_shapes(backend, device):
    """Groups, K and N that are not tile (or 8) multiples."""
    _check(backend, torch.float32, 3, 77, 70, 90, "skewed", False, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_gemm_single_group_is_dense(backend, device):
    _check(backend, torch.bfloat16, 1, 64, 32, 48, "balanced", False, device)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_grouped_gemm_zero_tokens(backend, device):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    G, K, N = 3, 16, 24
    a = torch.randn(0, K, device=device, requires_grad=True)
    b = torch.randn(G, K, N, device=device, requires_grad=True)
    out = turbo.ops.grouped_gemm(a, b, torch.zeros(G, dtype=torch.int64, device=device))
    assert out.shape == (0, N)
    out.sum().backward()
    assert a.grad.shape == (0, K)
    assert torch.count_nonzero(b.grad) == 0 and b.grad.shape == (G, K, N)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_grouped_gemm_zero_k(backend, device):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    G, M, N = 3, 20, 8
    a = torch.randn(M, 0, device=device, requires_grad=True)
    b = torch.randn(G, 0, N, device=device, requires_grad=True)
    out = turbo.ops.grouped_gemm(a, b, make_group_lens(M, G, "skewed", device))
    assert out.shape == (M, N) and torch.count_nonzero(out) == 0
    out.backward(torch.randn_like(out))
    assert a.grad.shape == (M, 0) and b.grad.shape == (G, 0, N)


@pytest.mark.parametrize("backend", ["TRITON", "CUTLASS"])
def test_grouped_gemm_rows_past_the_groups_are_zero_and_skipped(backend, device):
    """sum(group_lens) < M (a sync-free upper-bound buffer, e.g. after TURBO EP dispatch): the rows past the
    last group belong to no group. Every backend writes them as zeros (nothing uninitialised) and leaves
    them out of the weight gradient, whatever they hold."""
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    G, M, K, N = 3, 64, 32, 16
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = torch.randn(G, K, N, dtype=torch.bfloat16, device=device, requires_grad=True)
    lens = torch.tensor([10, 0, 20], device=device)
    out = turbo.ops.grouped_gemm(a, b, lens)
    assert torch.isfinite(out).all()
    assert torch.count_nonzero(out[30:]) == 0, backend
    ref = grouped_gemm_ref(a.detach()[:30], b.detach(), lens)
    assert_close(out[:30], ref, torch.bfloat16, msg=backend)
    grad = torch.randn_like(out)  # non-zero in the tail too: it must not reach b.grad
    out.backward(grad)
    af, bf, gf = a.detach().float(), b.detach().float(), grad.float()
    rows = [(0, 10), (10, 10), (10, 30)]  # group g: rows [start, end)
    db_ref = torch.stack([af[s:e].t() @ gf[s:e] for s, e in rows])
    da_ref = torch.cat([gf[s:e] @ bf[g].t() for g, (s, e) in enumerate(rows)])
    assert_close(b.grad, db_ref, torch.bfloat16, msg=f"{backend} wgrad")
    assert_close(a.grad[:30], da_ref, torch.bfloat16, msg=f"{backend} dgrad")
    assert torch.count_nonzero(a.grad[30:]) == 0, backend


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_one_group_with_rows_past_it(backend, trans_b, device):
    """G == 1 (one local expert, e.g. EP = number of experts) over an upper-bound buffer: the dense fast path
    must honour group_lens[0] < M like the grouped kernels: zero output and input-gradient rows past it, and
    a weight gradient without them, even when those rows hold NaN (an uninitialised receive buffer)."""
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    M, K, N, used = 48, 32, 16, 20
    a0 = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    a0[used:] = float("nan")
    a = a0.requires_grad_()
    shape = (1, N, K) if trans_b else (1, K, N)
    b = torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
    lens = torch.tensor([used], device=device)
    out = turbo.ops.grouped_gemm(a, b, lens, trans_b=trans_b)
    w = b.detach()[0].float().t() if trans_b else b.detach()[0].float()
    assert torch.count_nonzero(out[used:]) == 0 and torch.isfinite(out).all(), backend
    assert_close(out[:used], (a.detach()[:used].float() @ w).to(out.dtype), torch.bfloat16, msg=backend)
    grad = torch.randn_like(out)  # non-zero in the tail too: it must not reach b.grad
    out.backward(grad)
    af, gf = a.detach()[:used].float(), grad[:used].float()
    db_ref = (gf.t() @ af) if trans_b else (af.t() @ gf)
    assert torch.isfinite(b.grad).all(), backend
    assert_close(b.grad[0], db_ref, torch.bfloat16, msg=f"{backend} wgrad")
    assert_close(a.grad[:used], gf @ w.t(), torch.bfloat16, msg=f"{backend} dgrad")
    assert torch.count_nonzero(a.grad[used:]) == 0, backend


def test_dispatcher_defaults_and_env(device, monkeypatch):
    G, M, K, N = 2, 32, 16, 16
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    b = torch.randn(G, K, N, dtype=torch.bfloat16, device=device)
    lens = make_group_lens(M, G, "balanced", device)
    turbo.ops.grouped_gemm(a, b, lens)
    expected = BackendType.TORCH if device.type == "cpu" else BackendType.CUTLASS
    assert GroupedGemmDispatcher.last_backend is expected
    monkeypatch.setenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND", "triton")
    turbo.ops.grouped_gemm(a, b, lens)
    assert GroupedGemmDispatcher.last_backend is BackendType.TRITON
    GlobalBackendManager.set_grouped_gemm_backend("CUTLASS")
    with pytest.raises(ValueError, match="CUTLASS"):
        turbo.ops.grouped_gemm(a.float(), b.float(), lens)


def test_wgrad_dispatcher_uses_pinned_backend(device):
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    a = torch.randn(32, 16, device=device, requires_grad=True)
    b = torch.randn(2, 16, 8, device=device, requires_grad=True)
    turbo.ops.grouped_gemm(a, b, make_group_lens(32, 2, "skewed", device)).sum().backward()
    assert GroupedGemmVariableKDispatcher.last_backend is BackendType.TRITON


@pytest.mark.parametrize("mode", [1, 2], ids=["epilogue", "start"])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_variable_k_accumulates_into_strided_fp32_buffers(kind, mode, device):
    """accumulate=True: out[g] += x_g^T @ y_g with bf16 operands summed in fp32 into an fp32 buffer that is
    a strided view (one half of a [G, 2P, Q] gradient, as w1's half of a fused gate/up); empty groups and the
    other half are left exactly as they were."""
    G, M, P, Q = 4, 100, 24, 40
    lens = make_group_lens(M, G, kind, device)
    x = torch.randn(M, 2 * P, device=device).bfloat16()
    y = torch.randn(M, Q, device=device).bfloat16()
    buffer = torch.randn(G, 2 * P, Q, device=device)
    before = buffer.clone()
    kmod.launch_grouped_gemm_variable_k(x[:, :P], y, buffer[:, :P], lens, accumulate=mode)
    ends = lens.cumsum(0).tolist()
    for g, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        want = before[g, :P].double() + x[start:end, :P].double().t() @ y[start:end].double()
        assert_close(buffer[g, :P], want, torch.float32, msg=f"expert {g} ({end - start} rows)")
        if start == end:
            assert torch.equal(buffer[g, :P], before[g, :P]), f"empty expert {g} changed"
    assert torch.equal(buffer[:, P:], before[:, P:])
    assert kmod.launch_grouped_gemm_variable_k(x[:0], y[:0], buffer, lens * 0, accumulate=True) is buffer
    assert torch.equal(buffer[:, P:], before[:, P:])  # no tokens: nothing added, nothing zeroed


def test_bad_inputs(device, monkeypatch):
    G, M, K, N = 3, 12, 8, 8
    a = torch.randn(M, K, device=device)
    b = torch.randn(G, K, N, device=device)
    lens = torch.tensor([4, 4, 4], device=device)
    with pytest.raises(TypeError, match=r"1-D int64 \(or int32\) tensor, got dtype torch.float32"):
        turbo.ops.grouped_gemm(a, b, lens.float())
    with pytest.raises(TypeError, match="group_lens must be a 1-D int64"):
        turbo.ops.grouped_gemm(a, b, lens.view(1, 3))
    # int32 counts (token_permute's tokens_per_expert) are taken as they are: same result as int64
    assert torch.equal(turbo.ops.grouped_gemm(a, b, lens.int()), turbo.ops.grouped_gemm(a, b, lens))
    with pytest.raises(ValueError, match="group_lens has 2 groups but b has G=3"):
        turbo.ops.grouped_gemm(a, b, lens[:2])
    with pytest.raises(ValueError, match="one device"):
        turbo.ops.grouped_gemm(a, b, lens.to("meta"))
    with pytest.raises(ValueError, match="reduction dims differ"):
        turbo.ops.grouped_gemm(a[:, :4], b, lens)
    with pytest.raises(TypeError, match="share one dtype"):
        turbo.ops.grouped_gemm(a, b.double(), lens)
    with pytest.raises(ValueError, match="b must be 3-D"):
        turbo.ops.grouped_gemm(a, b[0], lens)
    with pytest.raises(ValueError, match="group_offs must be int64"):
        turbo.ops.grouped_gemm(a, b, lens, group_offs=lens)
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match="sums to 13 but a has only 12 rows"):
        turbo.ops.grouped_gemm(a, b, torch.tensor([4, 4, 5], device=device))
    turbo.ops.grouped_gemm(a, b, torch.tensor([4, 4, 3], device=device))  # fewer: the last row is zero
    with pytest.raises(ValueError, match="negative"):
        turbo.ops.grouped_gemm(a, b, torch.tensor([8, -4, 8], device=device))
    with pytest.raises(ValueError, match="exclusive cumsum"):
        turbo.ops.grouped_gemm(a, b, lens, group_offs=torch.tensor([0, 4, 9, 12], device=device))
    turbo.ops.grouped_gemm(a, b, lens, group_offs=torch.tensor([0, 4, 8, 12], device=device))


def test_custom_ops_opcheck(device):
    """Schema, fake (meta) kernels and torch.compile tracing of both custom ops."""
    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (
        grouped_gemm_impl,
        grouped_gemm_variable_k_impl,
    )

    lens = make_group_lens(24, 3, "skewed", device)
    a = torch.randn(24, 16, device=device)
    torch.library.opcheck(grouped_gemm_impl.custom_op, (a, torch.randn(3, 16, 8, device=device), lens, False))
    torch.library.opcheck(grouped_gemm_impl.custom_op, (a, torch.randn(3, 8, 16, device=device), lens, True))
    vark = grouped_gemm_variable_k_impl.custom_op
    torch.library.opcheck(vark, (a, torch.randn(24, 8, device=device), lens))
    # bf16 with precomputed torch._grouped_mm offsets (what the autograd Function passes)
    GlobalBackendManager.set_grouped_gemm_backend("CUTLASS")
    offs = cutlass_offsets(lens, 24)
    a16, b16 = a.bfloat16(), torch.randn(3, 8, 16, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(grouped_gemm_impl.custom_op, (a16, b16, lens, True, offs))
    y16 = torch.randn(24, 8, device=device, dtype=torch.bfloat16)
    torch.library.opcheck(grouped_gemm_variable_k_impl.custom_op, (a16, y16, lens, offs))
    assert_close(grouped_gemm_impl(a16, b16, lens, True, offs), grouped_gemm_ref(a16, b16, lens, True),
                 torch.bfloat16, msg="offs")  # fmt: skip


def test_eager_calls_skip_the_custom_op_layer(device):
    """Eager grouped_gemm runs the dispatcher directly (core.utils.eager_direct); the custom op is for
    torch.compile. A dispatch mode sees every op that reaches the torch dispatcher."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import grouped_gemm_impl

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    lens = make_group_lens(24, 3, "skewed", device)
    a = torch.randn(24, 16, device=device, requires_grad=True)
    b = torch.randn(3, 8, 16, device=device, requires_grad=True)
    with Record():
        turbo.ops.grouped_gemm(a, b, lens, trans_b=True).sum().backward()
    assert seen and not [op for op in seen if "primus_turbo" in op], seen
    with Record():
        grouped_gemm_impl.custom_op(a.detach(), b.detach(), lens, True)
    assert any("primus_turbo.grouped_gemm" in op for op in seen), seen

    class Sub(torch.Tensor):  # subclasses (DTensor, AsyncCollectiveTensor) keep the op: it unwraps them
        pass

    seen.clear()
    with Record():
        grouped_gemm_impl(a.detach().as_subclass(Sub), b.detach(), lens, True)
    assert any("primus_turbo.grouped_gemm" in op for op in seen), seen


@pytest.mark.parametrize("elem_bytes", [1, 2, 4])
def test_gpu_configs_fit_shared_memory(elem_bytes):
    """Every GPU tile config, pruned by operand bytes, fits sm_90 (fp32 once got a bf16 config: 256 KB)."""
    for n in (48, 4096):
        cfg = kmod._fwd_config(elem_bytes == 1, 0, n, on_gpu=True, elem_bytes=elem_bytes)
        need = (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * elem_bytes * cfg["num_stages"]
        assert need <= kmod.SMEM_BUDGET, cfg
    cfg = kmod._wgrad_config(elem_bytes == 1, on_gpu=True, elem_bytes=elem_bytes)
    need = (cfg["BLOCK_P"] + cfg["BLOCK_Q"]) * cfg["BLOCK_K"] * elem_bytes * cfg["num_stages"]
    assert need <= kmod.SMEM_BUDGET, cfg
    big = kmod.fit_smem(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4), 4)
    assert (128 + big["BLOCK_N"]) * 64 * 4 * big["num_stages"] <= kmod.SMEM_BUDGET


# -- sm_90 compilation (catches what the interpreter cannot: compile errors, smem overflow) ----
_FWD_SIG = {
    "a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "group_lens_ptr": "*i64",
    "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
    "G": "i32", "M": "i32", "N": "i32", "K": "i32",
    "stride_am": "i64", "stride_ak": "i32", "stride_bg": "i64", "stride_bk": "i32", "stride_bn": "i32",
    "stride_cm": "i64", "stride_cn": "i32", "stride_asm": "i32", "stride_ask": "i32",
    "stride_bsg": "i32", "stride_bsk": "i32", "stride_bsn": "i32",
    "NUM_PROGS": "constexpr", "BLOCK_G": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "SCALE_MODE": "constexpr", "UPCAST": "constexpr",
    "IEEE": "constexpr",
}  # fmt: skip
_WGRAD_SIG = {
    "x_ptr": "*bf16", "y_ptr": "*bf16", "c_ptr": "*bf16", "group_lens_ptr": "*i64",
    "x_scale_ptr": "*fp32", "y_scale_ptr": "*fp32", "G": "i32", "M": "i32", "P": "i32", "Q": "i32",
    "stride_xm": "i64", "stride_xp": "i32", "stride_ym": "i64", "stride_yq": "i32",
    "stride_cg": "i64", "stride_cp": "i32", "stride_cq": "i32",
    "NUM_PROGS": "constexpr", "BLOCK_G": "constexpr", "BLOCK_P": "constexpr", "BLOCK_Q": "constexpr",
    "BLOCK_K": "constexpr", "SCALE_MODE": "constexpr", "UPCAST": "constexpr", "IEEE": "constexpr",
    "ACCUMULATE": "constexpr",
}  # fmt: skip


def _with_dtype(sig, in_dtype, names):
    return {k: (in_dtype if k in names else v) for k, v in sig.items()}


FWD_CASES = [  # (a dtype, b dtype, scale mode, N); fp8e5 x fp8e4nv is the HYBRID dgrad
    ("bf16", "bf16", 0, 4096),
    ("bf16", "bf16", 0, 128),
    ("fp16", "fp16", 0, 4096),
    ("fp32", "fp32", 0, 4096),  # 4-byte operands: the config must be pruned for shared memory
    ("fp32", "fp32", 0, 48),
    ("fp8e4nv", "fp8e4nv", 1, 4096),
    ("fp8e4nv", "fp8e4nv", 2, 4096),
    ("fp8e4nv", "fp8e4nv", 3, 4096),
    ("fp8e5", "fp8e4nv", 2, 4096),
    ("fp8e5", "fp8e4nv", 3, 4096),
]
WGRAD_CASES = [  # (x dtype, y dtype, scale mode, C dtype, accumulate); HYBRID wgrad: E5M2 x E4M3
    ("bf16", "bf16", 0, "bf16", 0),
    ("bf16", "bf16", 0, "fp32", 1),  # the expert gradient added into fp32 .grad buffers
    ("bf16", "bf16", 0, "fp32", 2),
    ("bf16", "bf16", 0, "fp32", 0),
    ("fp16", "fp16", 0, "fp16", 0),
    ("fp32", "fp32", 0, "fp32", 0),
    ("fp8e4nv", "fp8e4nv", 1, "bf16", 0),
    ("fp8e4nv", "fp8e4nv", 2, "bf16", 0),
    ("fp8e5", "fp8e4nv", 1, "bf16", 0),
    ("fp8e5", "fp8e4nv", 2, "bf16", 0),
]


_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8e4nv": 1, "fp8e5": 1}


def _compile_all():
    """Every launch config the GPU uses, compiled for sm_90 (run in a process without the interpreter)."""
    for a_dtype, b_dtype, scale_mode, n in FWD_CASES:
        nbytes = max(_BYTES[a_dtype], _BYTES[b_dtype])
        cfg = kmod._fwd_config(nbytes == 1, scale_mode, n, on_gpu=True, elem_bytes=nbytes)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        consts = dict(NUM_PROGS=132, BLOCK_G=kmod._block_g(256), SCALE_MODE=scale_mode, UPCAST=False, **cfg)
        consts.update(GROUP_M=8, IEEE=a_dtype == "fp32")
        sig = _with_dtype(_with_dtype(_FWD_SIG, f"*{a_dtype}", ("a_ptr",)), f"*{b_dtype}", ("b_ptr",))
        compile_for_sm90(kmod.grouped_gemm_kernel, sig, consts, num_warps=warps, num_stages=stages)
    for x_dtype, y_dtype, scale_mode, c_dtype, accumulate in WGRAD_CASES:
        nbytes = max(_BYTES[x_dtype], _BYTES[y_dtype])
        cfg = kmod._wgrad_config(nbytes == 1, on_gpu=True, elem_bytes=nbytes)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        consts = dict(NUM_PROGS=132, BLOCK_G=kmod._block_g(64), SCALE_MODE=scale_mode, UPCAST=False, **cfg)
        consts.update(IEEE=x_dtype == "fp32", ACCUMULATE=accumulate)
        sig = _with_dtype(_with_dtype(_WGRAD_SIG, f"*{x_dtype}", ("x_ptr",)), f"*{y_dtype}", ("y_ptr",))
        sig = _with_dtype(sig, f"*{c_dtype}", ("c_ptr",))
        compile_for_sm90(kmod.grouped_gemm_variable_k_kernel, sig, consts, num_warps=warps, num_stages=stages)


def test_kernels_compile_for_sm90():
    run_compile_check("test_grouped_gemm")


# -- GPU: real shapes, CUDA-graph capture -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "CUTLASS"])
@pytest.mark.parametrize("G,K,N", [(64, 2048, 1408), (8, 4096, 14336), (32, 7168, 2048), (16, 1408, 2048)])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_grouped_gemm_gpu_training_shapes(backend, G, K, N, kind, device):
    _check(backend, torch.bfloat16, G, 8192, K, N, kind, True, device)


def _leaf_inputs(G, M, K, N, kind, device):
    """bf16 a [M, K] and b [G, N, K] (trans_b) requiring grad, group_lens of ``kind``, grad_out [M, N]."""
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = (torch.randn(G, N, K, dtype=torch.bfloat16, device=device) / K**0.5).requires_grad_()
    return a, b, make_group_lens(M, G, kind, device), torch.randn(M, N, dtype=torch.bfloat16, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "CUTLASS"])
def test_grouped_gemm_cuda_graph_capture(backend, device):
    """fwd+bwd captured once, replayed with different group_lens contents: no host sync anywhere."""
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    G, M, K, N = 8, 1024, 256, 512
    a, b, lens, grad_out = _leaf_inputs(G, M, K, N, "balanced", device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile, autotune) outside the capture
        for _ in range(2):
            a.grad = b.grad = None
            turbo.ops.grouped_gemm(a, b, lens, trans_b=True).backward(grad_out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    a.grad = b.grad = None
    with torch.cuda.graph(graph):
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
        out.backward(grad_out)
    for kind in ["skewed", "empty", "balanced"]:
        lens.copy_(make_group_lens(M, G, kind, device))
        graph.replay()
        torch.cuda.synchronize()
        ref = grouped_gemm_ref(a, b, lens, True)
        ref_da, ref_db = grouped_gemm_grads_ref(a, b, lens, grad_out, True)
        assert_close(out, ref, torch.bfloat16, msg=f"graph out {kind}")
        assert_close(a.grad, ref_da, torch.bfloat16, msg=f"graph grad_a {kind}")
        scale = ref_db.abs().max()
        assert_close(b.grad / scale, ref_db / scale, torch.bfloat16, msg=f"graph grad_b {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,trans_b,expected",
    [(512, True, "TRITON"), (512, False, "TRITON"), (1024, True, "CUTLASS"), (1024, False, "CUTLASS")],
)
def test_bf16_default_is_the_tma_kernel_except_wide_outputs(n, trans_b, expected, device):
    """Unpinned, no autotune: bf16 takes the TMA Triton kernel (K- or N-contiguous weight) unless the
    output is wide against the reduction (N >= 3.5 K: CUTLASS measured faster there)."""
    if not torch.cuda.get_device_capability(device) >= (9, 0):
        pytest.skip("TMA needs sm_90")
    G, M, K = 4, 512, 256
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    b = torch.randn((G, n, K) if trans_b else (G, K, n), dtype=torch.bfloat16, device=device) / K**0.5
    lens = make_group_lens(M, G, "skewed", device)
    out = turbo.ops.grouped_gemm(a, b, lens, trans_b=trans_b)
    assert GroupedGemmDispatcher.last_backend is BackendType[expected]
    assert_close(out, grouped_gemm_ref(a, b, lens, trans_b), torch.bfloat16, msg=f"default N={n} {trans_b}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_autotune_never_times_a_host_syncing_backend(fp8, device, monkeypatch):
    """With autotune on, the TORCH loops (they read group_lens on the host) are never timed on CUDA, so
    the op stays sync-free: the loop of cuBLAS calls won the bf16 forward and dgrad at skewed DeepSeek-V3
    and balanced Mixtral shapes (session 24 bench: "turbo auto (TORCH)") and made every call synchronize."""

    ran = []
    loops = (bf.GroupedGemmTorchBackend, bf.VariableKTorchBackend)
    loops += (f8.FP8TorchBackend, f8.FP8VariableKTorchBackend)
    for cls in loops:
        assert cls.syncs_host

        def spy(*args, _cls=cls, _orig=cls.execute, **kw):
            ran.append(_cls.__name__)
            return _orig(*args, **kw)

        monkeypatch.setattr(cls, "execute", staticmethod(spy))
    GlobalBackendManager.set_auto_tune(True)
    a, b, lens, grad_out = _leaf_inputs(8, 4096, 1024, 2048, "skewed", device)
    config = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)

    def step():
        a.grad = b.grad = None
        if fp8:
            out = turbo.ops.grouped_gemm_fp8(a, b, lens, trans_b=True, config=config)
        else:
            out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
        out.backward(grad_out)
        return out

    step()  # autotunes every dispatcher on the path (fwd, dgrad, wgrad)
    assert ran == [], f"autotune timed host-syncing backends on CUDA: {sorted(set(ran))}"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()  # cached choices: no host sync anywhere
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = grouped_gemm_ref(a.detach(), b.detach(), lens, True)
    if fp8:
        assert_snr(out, ref, fp8_snr_gate(config.format), msg="autotuned FP8 out")
    else:
        assert_close(out, ref, torch.bfloat16, msg="autotuned out")


@pytest.mark.gpu
@pytest.mark.deterministic
def test_grouped_gemm_triton_bitwise_deterministic(device):
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    G, M, K, N = 16, 4096, 1024, 512
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = torch.randn(G, N, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    lens = make_group_lens(M, G, "skewed", device)
    results = []
    for _ in range(2):
        a.grad = b.grad = None
        out = turbo.ops.grouped_gemm(a, b, lens, trans_b=True)
        out.backward(torch.ones_like(out))
        results.append((out.clone(), a.grad.clone(), b.grad.clone()))
    for x, y in zip(results[0], results[1], strict=True):
        assert torch.equal(x, y)


if __name__ == "__main__":
    _compile_all()
    print("sm_90 compile OK")
