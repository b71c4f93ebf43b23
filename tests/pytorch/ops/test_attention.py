"""flash_attn_func / flash_attn_varlen_func against the fp64 reference, per backend.

CPU: TORCH at small shapes, TRITON in the interpreter at S <= 64 (tiles of 16, so every loop phase
runs). GPU (marked): bf16 at training shapes, SNR >= 40 dB for out, dq, dk, dv on every backend that
serves the shape; determinism.
"""

from __future__ import annotations

import pytest
import torch
from ref.attention_ref import attention_ref, attention_varlen_ref
from test_utils import SNR_ATTENTION_BF16_DB, assert_close, assert_snr

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.attention.attention_impl import AttentionDispatcher
from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_varlen_func

HAS_CUDA = torch.cuda.is_available()
# TRITON takes fp32 only in the interpreter; on a GPU the small-shape tests run in fp16
SMALL_DTYPE = torch.float16 if HAS_CUDA else torch.float32


def _inputs(b, sq, sk, hq, hk, d, dv, dtype, device, sink=False):
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, sk, hk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(b, sk, hk, dv, dtype=dtype, device=device, requires_grad=True)
    s = torch.randn(hq, dtype=torch.float32, device=device, requires_grad=True) if sink else None
    return q, k, v, s


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], dout)


def _check_against_ref(backend, b, sq, sk, hq, hk, d, dv, dtype, device, causal, window, sink, tol_dtype):
    GlobalBackendManager.set_attention_backend(backend)
    q, k, v, s = _inputs(b, sq, sk, hq, hk, d, dv, dtype, device, sink)
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, sink=s, return_lse=True)
    assert AttentionDispatcher.last_backend is BackendType[backend]
    dout = torch.randn_like(out)
    grads = _grads(out, (q, k, v, s), dout)
    ref_out, ref_lse = attention_ref(q, k, v, causal=causal, window_size=window, sink=s)
    ref_grads = _grads(ref_out, (q, k, v, s), dout.double())
    assert_close(out, ref_out, tol_dtype, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: empty rows must be +inf"
    assert_close(lse[finite], ref_lse[finite], torch.float32, "lse")
    for name, g, r in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads):
        # dsink sums over every row: compare it relative to its magnitude
        if name == "dsink":
            rel = 2e-3 if dtype == torch.float32 else 2e-2  # fp16 o/dO feed delta
            torch.testing.assert_close(
                g.double(), r.double(), rtol=rel, atol=rel * r.abs().max().item() + 1e-6
            )
        else:
            assert_close(g, r, tol_dtype, name)


# (b, sq, sk, hq, hk, d, dv, causal, window, sink)
CASES = {
    "mha": (2, 48, 48, 2, 2, 32, 32, False, (-1, -1), False),
    "causal_gqa": (1, 64, 64, 4, 2, 32, 32, True, (-1, -1), False),
    "mla_dims": (1, 40, 40, 2, 1, 48, 32, True, (-1, -1), False),  # d 48 = 32 + 16 slices, like 192
    "mla_192_128": (1, 20, 20, 1, 1, 192, 128, True, (-1, -1), False),
    "causal_sq_lt_sk": (2, 24, 56, 2, 1, 32, 32, True, (-1, -1), False),
    "causal_sq_gt_sk": (1, 56, 24, 2, 2, 32, 32, True, (-1, -1), False),
    "window": (1, 64, 64, 2, 1, 32, 32, False, (9, 4), False),
    "causal_window_sink": (1, 64, 48, 4, 1, 32, 16, True, (13, -1), True),
    "sink_mqa": (2, 33, 47, 3, 1, 16, 16, False, (-1, -1), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_backend_matches_ref(case):
    b, sq, sk, hq, hk, d, dv, causal, window, sink = CASES[case]
    _check_against_ref("TORCH", b, sq, sk, hq, hk, d, dv, torch.float32, "cpu", causal, window, sink,
                       torch.float32)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_ref(case, device):
    b, sq, sk, hq, hk, d, dv, causal, window, sink = CASES[case]
    dtype = SMALL_DTYPE
    _check_against_ref("TRITON", b, sq, sk, hq, hk, d, dv, dtype, device, causal, window, sink, dtype)


def test_triton_fp16_interpreter(device):
    """fp16 operands through the kernels' dtype casts (p.to(v.dtype), ds.to(q.dtype))."""
    _check_against_ref("TRITON", 1, 40, 40, 2, 1, 64, 64, torch.float16, device, True, (-1, -1), False,
                       torch.float16)  # fmt: skip


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_varlen_matches_ref(backend, device):
    GlobalBackendManager.set_attention_backend(backend)
    lens_q = [1, 37, 0, 20, 5]
    lens_k = [1, 37, 3, 29, 1]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32, device=device)
    hq, hk, d = 4, 2, 32
    dtype = torch.float16 if HAS_CUDA else torch.float32
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(lens_k), hk, d, dtype=dtype, device=device, requires_grad=True)
    sink = torch.randn(hq, device=device, requires_grad=True)
    for causal, window, s in ((True, (-1, -1), None), (False, (6, 2), sink)):
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                          window_size=window, sink=s, return_lse=True)  # fmt: skip
        assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
        dout = torch.randn_like(out)
        grads = _grads(out, (q, k, v, s), dout)
        ref_out, ref_lse = attention_varlen_ref(
            q, k, v, cu_q, cu_k, causal=causal, window_size=window, sink=s
        )
        ref_grads = _grads(ref_out, (q, k, v, s), dout.double())
        assert_close(out, ref_out, dtype, f"out causal={causal}")
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        assert_close(lse[finite], ref_lse[finite], torch.float32, "lse")
        for name, g, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
            assert_close(g, r, dtype, f"{name} causal={causal}")
        if s is not None:
            rel = 2e-3 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(grads[3].double(), ref_grads[3].double(), rtol=rel, atol=rel)


def test_empty_rows_output_zero(device):
    """Causal with Sq > Sk: the first Sq - Sk rows see no key: zero output, finite zero grads."""
    q, k, v, _ = _inputs(1, 40, 16, 2, 2, 32, 32, SMALL_DTYPE, device)
    for backend in ("TORCH", "TRITON"):
        GlobalBackendManager.set_attention_backend(backend)
        out = flash_attn_func(q, k, v, causal=True)
        assert torch.all(out[:, :24] == 0), backend
        dq = torch.autograd.grad(out.sum(), q)[0]
        assert torch.all(dq[:, :24] == 0) and torch.isfinite(dq).all(), backend


def test_zero_size_inputs(device):
    q, k, v, _ = _inputs(2, 0, 8, 2, 2, 16, 16, SMALL_DTYPE, device)
    for backend in ("TORCH", "TRITON"):
        GlobalBackendManager.set_attention_backend(backend)
        out = flash_attn_func(q, k, v)
        assert out.shape == (2, 0, 2, 16)
        dk = torch.autograd.grad(out.sum(), k, allow_unused=True)[0]
        assert dk is None or torch.all(dk == 0)


def test_dropout_torch_backend_is_consistent():
    """out is linear in v, so <dv, v> == <dout, out> only if backward reuses forward's dropout mask."""
    GlobalBackendManager.set_attention_backend("TORCH")
    q, k, v, _ = _inputs(2, 24, 24, 2, 2, 16, 16, torch.float32, "cpu")
    out = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert (out.double() - ref).abs().max() > 1e-3, "dropout changed nothing"
    dout = torch.randn_like(out)
    dv = torch.autograd.grad(out, v, dout)[0]
    torch.testing.assert_close((dv * v).sum(), (dout * out).sum(), rtol=1e-4, atol=1e-4)


def test_dropout_pinned_triton_raises():
    GlobalBackendManager.set_attention_backend("TRITON")
    q, k, v, _ = _inputs(1, 16, 16, 1, 1, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="TRITON"):
        flash_attn_func(q, k, v, dropout_p=0.1)


def test_env_var_selects_backend(monkeypatch, device):
    monkeypatch.setenv("PRIMUS_TURBO_ATTENTION_BACKEND", "triton")
    q, k, v, _ = _inputs(1, 16, 16, 1, 1, 16, 16, SMALL_DTYPE, device)
    flash_attn_func(q, k, v)
    assert AttentionDispatcher.last_backend is BackendType.TRITON
    monkeypatch.setenv("PRIMUS_TURBO_ATTENTION_BACKEND", "cudnn")
    q, k, v, _ = _inputs(1, 16, 16, 1, 1, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="CUDNN"):
        flash_attn_func(q, k, v)  # CPU tensors: cuDNN cannot serve them and must not fall back


def test_cpu_default_is_torch():
    q, k, v, _ = _inputs(1, 8, 8, 1, 1, 16, 16, torch.float32, "cpu")
    flash_attn_func(q, k, v)
    assert AttentionDispatcher.last_backend is BackendType.TORCH


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(q=(1, 8, 2, 16), k=(2, 8, 2, 16), v=(2, 8, 2, 16)), ValueError, "batch"),
        (dict(q=(1, 8, 3, 16), k=(1, 8, 2, 16), v=(1, 8, 2, 16)), ValueError, "divide"),
        (dict(q=(1, 8, 2, 16), k=(1, 8, 2, 32), v=(1, 8, 2, 16)), ValueError, "head dims"),
        (dict(q=(1, 8, 2, 16), k=(1, 8, 2, 16), v=(1, 9, 2, 16)), ValueError, "k and v"),
        (dict(q=(8, 2, 16), k=(8, 2, 16), v=(8, 2, 16)), ValueError, "B, S, H, D"),
    ],
)
def test_bad_shapes(kwargs, err, match):
    q, k, v = (torch.randn(kwargs[n]) for n in ("q", "k", "v"))
    with pytest.raises(err, match=match):
        flash_attn_func(q, k, v)


def test_bad_dtypes_and_args():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attn_func(q, q.half(), q)
    with pytest.raises(TypeError, match="dtype"):
        flash_attn_func(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="sink"):
        flash_attn_func(q, q, q, sink=torch.randn(3))
    with pytest.raises(ValueError, match="sink"):
        flash_attn_func(q, q, q, sink=torch.randn(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="dropout_p"):
        flash_attn_func(q, q, q, dropout_p=1.0)


def test_bad_cu_seqlens():
    q = torch.randn(10, 2, 16)
    good = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen_func(q, q, q, good.long(), good, 6, 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 7, 4, 10], dtype=torch.int32), good, 6, 6)
    with pytest.raises(ValueError, match="token count"):
        flash_attn_varlen_func(q, q, q, torch.tensor([0, 4, 9], dtype=torch.int32), good, 6, 6)
    with pytest.raises(ValueError, match="entries"):
        flash_attn_varlen_func(q, q, q, good, torch.tensor([0, 10], dtype=torch.int32), 6, 10)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attn_varlen_func(q, q, q, good, good, 4, 6)


def test_pinned_triton_rejects_head_dim_over_256():
    GlobalBackendManager.set_attention_backend("TRITON")
    q = torch.randn(1, 8, 1, 320)
    with pytest.raises(ValueError, match="cannot handle"):
        flash_attn_func(q, q, q)


def test_non_contiguous_inputs(device):
    """SBHD tensors transposed to BSHD views (what the Megatron adapter passes) work without copies."""
    GlobalBackendManager.set_attention_backend("TRITON")
    q, k, v = (torch.randn(24, 2, 2, 16, device=device, dtype=SMALL_DTYPE).transpose(0, 1) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert_close(out, ref, SMALL_DTYPE, "out")


# ---------------------------------------------------------------------------------------------
# GPU: bf16 at training shapes, SNR gates on every backend that serves the shape
# ---------------------------------------------------------------------------------------------
GPU_SHAPES = {
    "llama3_8b": (2, 2048, 2048, 32, 8, 128, 128),
    "mla_v2_lite": (2, 2048, 2048, 16, 16, 192, 128),
    "d64": (4, 1024, 1024, 16, 16, 64, 64),
    "d256": (1, 1024, 1024, 8, 8, 256, 256),
    "cross_len": (2, 512, 1536, 8, 8, 128, 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "CUDNN", "FLASH"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_bf16_snr(backend, causal, shape, device):
    b, sq, sk, hq, hk, d, dv = GPU_SHAPES[shape]
    q, k, v, _ = _inputs(b, sq, sk, hq, hk, d, dv, torch.bfloat16, device)
    kw = dict(q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=sq, max_seqlen_k=sk,
              sink=None, softmax_scale=d**-0.5, window_left=-1, window_right=0 if causal else -1,
              dropout_p=0.0, deterministic=False, return_lse=False)  # fmt: skip
    if not AttentionDispatcher.backends[BackendType[backend]].can_handle(**kw):
        pytest.skip(f"{backend} does not serve {shape} causal={causal}")
    GlobalBackendManager.set_attention_backend(backend)
    out = flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = _grads(out, (q, k, v), dout)
    with torch.no_grad():
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        ref = (
            torch.nn.functional.scaled_dot_product_attention(
                q32.transpose(1, 2),
                k32.transpose(1, 2),
                v32.transpose(1, 2),
                is_causal=causal and sq == sk,
                enable_gqa=hq != hk,
            ).transpose(1, 2)
            if (not causal or sq == sk)
            else attention_ref(q32, k32, v32, causal=True)[0]
        )
        ref_grads = _grads(ref, (q32, k32, v32), dout.to(ref.dtype))
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert_snr(g, r, SNR_ATTENTION_BF16_DB, f"{backend} {shape} causal={causal} {name}")


@pytest.mark.gpu
def test_gpu_window_sink_varlen_bf16(device):
    GlobalBackendManager.set_attention_backend("TRITON")
    lens = [1, 700, 1024, 3, 300]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    hq, hk, d = 16, 4, 128
    q = torch.randn(sum(lens), hq, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lens), hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(sum(lens), hk, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    sink = torch.randn(hq, device=device, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, window_size=(128, -1),
                                 sink=sink)  # fmt: skip
    dout = torch.randn_like(out)
    grads = _grads(out, (q, k, v, sink), dout)
    ref, _ = attention_varlen_ref(q, k, v, cu, cu, causal=True, window_size=(128, -1), sink=sink)
    ref_grads = _grads(ref, (q, k, v, sink), dout.double())
    for name, g, r in zip(("out", "dq", "dk", "dv", "dsink"), (out, *grads), (ref, *ref_grads)):
        assert_snr(g, r, SNR_ATTENTION_BF16_DB, name)


@pytest.mark.gpu
@pytest.mark.deterministic
@pytest.mark.parametrize("shape", ["llama3_8b", "mla_v2_lite"])
def test_gpu_deterministic_grads(shape, device):
    b, sq, sk, hq, hk, d, dv = GPU_SHAPES[shape]
    q, k, v, _ = _inputs(b, sq, sk, hq, hk, d, dv, torch.bfloat16, device)
    dout = torch.randn(b, sq, hq, dv, dtype=torch.bfloat16, device=device)
    runs = []
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=True, deterministic=True)
        assert AttentionDispatcher.last_backend is BackendType.TRITON
        runs.append(_grads(out, (q, k, v), dout))
    for a, b_ in zip(*runs):
        assert torch.equal(a, b_)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter-only check; on a GPU every TRITON test autotunes for real")
def test_triton_autotune_launch_path(monkeypatch):
    """The GPU launch path (triton.autotune over the config table, grid from META) in the interpreter;
    conftest makes every config time the same, so the first one runs."""
    from primus_turbo.pytorch.kernels.attention import attention_triton_impl as impl

    monkeypatch.setattr(impl, "_autotune_enabled", lambda: True)
    for table in (impl.FWD_CONFIGS, impl.DKDV_CONFIGS, impl.DQ_CONFIGS):
        monkeypatch.setitem(table, 64, [(32, 16, 4, 1), (16, 16, 4, 1)])
    impl._tuned_kernel.cache_clear()
    try:
        _check_against_ref("TRITON", 1, 40, 40, 2, 1, 32, 32, torch.float32, "cpu", True, (-1, -1), False,
                           torch.float32)  # fmt: skip
    finally:
        impl._tuned_kernel.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk,d_v", [(128, 128), (192, 128)])
def test_torch_compile_fullgraph_gpu(d_qk, d_v):
    """On a GPU the dispatcher consults SDPA's checkers (a pybind SDPAParams dynamo cannot build): the plan
    must come from a trace-time constant, so fullgraph tracing works (it failed inside TorchTitan)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch._dynamo.reset()  # a fresh trace per head-dim case (else a recompile makes the dims symbolic)
    q, k, v, _ = _inputs(2, 256, 256, 8, 2, d_qk, d_v, torch.bfloat16, "cuda")
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    out = compiled(q, k, v)
    dq = torch.autograd.grad(out.float().sum(), q)[0]
    qr, kr, vr = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, causal=True)
    assert_snr(out, ref, SNR_ATTENTION_BF16_DB, "compiled out")
    assert_snr(dq, torch.autograd.grad(ref.sum(), qr)[0], SNR_ATTENTION_BF16_DB, "compiled dq")


@pytest.mark.parametrize("dynamic", [True, None])
def test_sdpa_plan_is_a_trace_time_constant(dynamic):
    """The SDPA plan's inputs stay python constants under torch.compile, also when batch, sequence and
    head dims turn symbolic (dynamic=True, or automatic dynamic after a recompile): head counts/dims are
    specialized, batch/sequence judged at a representative length. The GPU path consults SDPA's checkers
    here; on CPU the checker's CUDA tensors fail and the plan is None, which is what this returns."""
    from primus_turbo.pytorch.kernels.attention import attention_impl as impl

    def plan_gate(q, k, v):
        layout = impl._plan_layout(q, k, v)
        plan = impl._sdpa_plan_for("can_use_cudnn_attention", layout, q.dtype, q.device.index, True, 0.0)
        return q * 2 if plan is None else q

    torch._dynamo.reset()
    compiled = torch.compile(plan_gate, fullgraph=True, backend="eager", dynamic=dynamic)
    impl._SDPA_PLANS.clear()
    for s, d in ((64, 16), (96, 16), (96, 24)):
        q, k, v = torch.randn(2, s, 4, d), torch.randn(2, s, 2, d), torch.randn(2, s, 2, 8)
        assert torch.equal(compiled(q, k, v), q * 2)
    # keys: ("compile", checker, layout, ...); layout[0] = q's (shape, strides)
    q_shapes = {key[2][0][0] for key in impl._SDPA_PLANS}
    assert q_shapes == {(1, 128, 4, 16), (1, 128, 4, 24)}, q_shapes


def test_torch_compile_fullgraph():
    """Dispatcher + autograd.Function + custom ops trace with fullgraph=True (aot_eager on CPU)."""
    q, k, v, _ = _inputs(1, 16, 16, 2, 2, 16, 16, torch.float32, "cpu")
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    out = compiled(q, k, v)
    dq = torch.autograd.grad(out.sum(), q)[0]
    ref, _ = attention_ref(q, k, v, causal=True)
    assert_close(out, ref, torch.float32, "out")
    assert_close(dq, torch.autograd.grad(ref.sum(), q)[0], torch.float32, "dq")
