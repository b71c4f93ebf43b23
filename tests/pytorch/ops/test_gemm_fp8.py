"""gemm_fp8: forward, dgrad and wgrad SNR vs fp64 for every granularity x format x layout x backend."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from ref.gemm_fp8_ref import gemm_ref
from test_utils import assert_snr, fp8_snr_gate
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.float8_tensor import Float8Tensor
from primus_turbo.pytorch.core.fp8_autocast import DelayedScalingState
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingStrategy
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import GemmFP8Dispatcher
from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

HAS_CUDA = torch.cuda.is_available()
LAYOUTS = {"NN": (False, False), "NT": (False, True), "TN": (True, False)}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(m, n, k, layout, device, dtype=torch.bfloat16):
    ta, tb = LAYOUTS[layout]
    a = torch.randn((k, m) if ta else (m, k), device=device, dtype=dtype).requires_grad_()
    b = torch.randn((n, k) if tb else (k, n), device=device, dtype=dtype).requires_grad_()
    return a, b, ta, tb


def _check(a, b, ta, tb, cfg, out_dtype=None, msg="", delayed_state=None):
    out = gemm_fp8(a, b, ta, tb, out_dtype=out_dtype, config=cfg, delayed_state=delayed_state)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref, ref_ga, ref_gb = gemm_ref(a, b, ta, tb, grad)
    gate = fp8_snr_gate(cfg.format)
    assert out.shape == ref.shape and a.grad.shape == a.shape and b.grad.shape == b.shape
    assert_snr(out, ref, gate, f"{msg} out")
    assert_snr(a.grad, ref_ga, gate, f"{msg} dgrad")
    assert_snr(b.grad, ref_gb, gate, f"{msg} wgrad")


def _cfg(gran, fmt, strategy=ScalingStrategy.CURRENT):
    return Float8QuantConfig(format=fmt, granularity=gran, strategy=strategy)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", list(Format), ids=lambda f: f.name)
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_gemm_fp8_snr(gran, fmt, layout, backend, device):
    # M, N, K not multiples of the 128 block: partial blocks on every axis
    a, b, ta, tb = _inputs(136, 144, 160, layout, device)
    GlobalBackendManager.set_gemm_backend(backend, precision="fp8")
    _check(a, b, ta, tb, _cfg(gran, fmt), msg=f"{gran.name}/{fmt.name}/{layout}/{backend}")
    assert GemmFP8Dispatcher.last_backend is BackendType[backend]


def test_env_pin_and_default(monkeypatch, device):
    a, b, ta, tb = _inputs(32, 48, 64, "NT", device)
    gemm_fp8(a, b, ta, tb)
    default = BackendType.CUBLAS if HAS_CUDA else BackendType.TORCH
    assert GemmFP8Dispatcher.last_backend is default
    # rowwise defaults to TRITON on CUDA (ahead of cuBLAS at every bench_gemm_fp8 shape, H200)
    gemm_fp8(a, b, ta, tb, config=_cfg(G.ROWWISE, Format.E4M3))
    assert GemmFP8Dispatcher.last_backend is (BackendType.TRITON if HAS_CUDA else BackendType.TORCH)
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "bf16:TORCH,fp8:TRITON")
    gemm_fp8(a, b, ta, tb)
    assert GemmFP8Dispatcher.last_backend is BackendType.TRITON
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:CUBLAS")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUBLAS"):
            gemm_fp8(a, b, ta, tb)


@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_prequantized_weight_matches_and_trains(gran):
    cfg = _cfg(gran, Format.HYBRID)
    x = torch.randn(40, 96, requires_grad=True)
    w = torch.randn(64, 96, requires_grad=True)
    block = (128, 128) if gran is G.BLOCKWISE else None
    w8 = Float8Tensor.from_tensor(w, E4M3, gran, block)
    out8 = gemm_fp8(x, w8, trans_b=True, config=cfg)
    out = gemm_fp8(x, w, trans_b=True, config=cfg)
    torch.testing.assert_close(out8, out, rtol=0, atol=0)  # the same FP8 operands
    out8.sum().backward()
    assert w.grad is not None and x.grad is not None
    assert_snr(w.grad, torch.ones(40, 64).t() @ x.detach(), 20.0, "wgrad via Float8Tensor.source")


def test_rowwise_scales_are_along_k():
    """A per-row outlier must only coarsen its own row: ROWWISE beats TENSORWISE on that input."""
    x = torch.randn(64, 128)
    x[3] *= 1e5  # others land in E4M3 subnormals under one tensor scale
    w = torch.randn(32, 128)
    ref = x.double() @ w.double().t()
    err = {}
    for gran in (G.TENSORWISE, G.ROWWISE):
        out = gemm_fp8(x, w, trans_b=True, config=_cfg(gran, Format.E4M3))
        err[gran] = (out.double() - ref)[torch.arange(64) != 3].abs().max().item()
    assert err[G.ROWWISE] < err[G.TENSORWISE] / 4


def test_zero_size_m():
    a = torch.randn(0, 64, requires_grad=True)
    b = torch.randn(32, 64, requires_grad=True)
    for gran in G:
        out = gemm_fp8(a, b, trans_b=True, config=_cfg(gran, Format.E4M3))
        assert out.shape == (0, 32)
        out.sum().backward()
        assert b.grad.shape == b.shape and torch.all(b.grad == 0)
        b.grad = None


def test_delayed_scaling_uses_history(device):
    cfg = _cfg(G.TENSORWISE, Format.HYBRID, ScalingStrategy.DELAYED)
    state = DelayedScalingState(cfg, device=device)
    a, b, ta, tb = _inputs(48, 64, 96, "NT", device, torch.float32)
    for step in range(3):
        a.grad = b.grad = None
        _check(a, b, ta, tb, cfg, msg=f"delayed step {step}", delayed_state=state)
    amax_a = a.detach().abs().max()
    assert state.a.initialized and torch.allclose(state.a.history[:3], amax_a.expand(3))
    assert state.grad.history[0] > 0
    # a 4x larger input is cast with the stale (history) scale: it saturates, so SNR drops
    big = (a.detach() * 4).requires_grad_()
    out = gemm_fp8(big, b, ta, tb, config=cfg, delayed_state=state)
    ref = big.detach().double() @ b.detach().double().t()
    assert (out.double() - ref).abs().max() > 1.0
    assert state.a.history[0] == (big.detach().abs().max())


def test_delayed_scaling_rounds_history_scales_to_powers_of_two(device):
    """power_of_two_scales holds for every step of DELAYED scaling: the scales taken from the amax history
    (from the second step on) were not rounded."""
    import math

    from primus_turbo.pytorch.ops.gemm_fp8 import _quantize_physical

    delayed = _cfg(G.TENSORWISE, Format.E4M3, ScalingStrategy.DELAYED)
    cfg = dataclasses.replace(delayed, power_of_two_scales=True)
    state = DelayedScalingState(cfg, device=device)
    x = torch.randn(32, 64, device=device) * 3
    for step in range(3):
        (q, s), _ = _quantize_physical(x, torch.float8_e4m3fn, cfg, None, False, state.a)
        assert math.log2(float(s)).is_integer(), (step, float(s))
    assert float(state.a.scale(torch.float8_e4m3fn)) != float(state.a.scale(torch.float8_e4m3fn, True))


def test_bad_inputs():
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    with pytest.raises(TypeError, match="config"):
        gemm_fp8(x, w, trans_b=True, config="E4M3")
    with pytest.raises(ValueError, match="reduction"):
        gemm_fp8(x, w, trans_b=False)
    with pytest.raises(ValueError, match="2-D"):
        gemm_fp8(x.reshape(2, 8, 64), w, trans_b=True)
    with pytest.raises(TypeError, match="a:"):
        gemm_fp8(x.to(torch.int32), w, trans_b=True)
    with pytest.raises(TypeError, match="out_dtype"):
        gemm_fp8(x, w, trans_b=True, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="delayed_state"):
        gemm_fp8(x, w, trans_b=True, config=_cfg(G.TENSORWISE, Format.E4M3, ScalingStrategy.DELAYED))
    with pytest.raises(ValueError, match="DELAYED"):
        Float8QuantConfig(granularity=G.ROWWISE, strategy=ScalingStrategy.DELAYED)
    w8 = Float8Tensor.from_tensor(w, E4M3, G.ROWWISE)
    with pytest.raises(ValueError, match="ROWWISE"):
        gemm_fp8(x, w8, trans_b=True, config=_cfg(G.TENSORWISE, Format.E4M3))
    w8_e5 = Float8Tensor.from_tensor(w, E5M2, G.TENSORWISE)
    with pytest.raises(ValueError, match="dtype"):
        gemm_fp8(x, w8_e5, trans_b=True, config=_cfg(G.TENSORWISE, Format.HYBRID))
    w8_blk = Float8Tensor.from_tensor(w, E4M3, G.BLOCKWISE, (64, 64))
    with pytest.raises(ValueError, match="block_size"):
        gemm_fp8(x, w8_blk, trans_b=True, config=_cfg(G.BLOCKWISE, Format.E4M3))
    # pre-quantized input whose scale has the wrong shape
    q = w8.data
    with pytest.raises(ValueError, match="scale_inv"):
        Float8Tensor(q, torch.ones(q.shape[0] + 1, 1), G.ROWWISE)
    with pytest.raises(ValueError, match="scale_inv"):
        Float8Tensor(q, torch.ones(2, 2), G.BLOCKWISE, (128, 128))
    with pytest.raises(TypeError, match="data"):
        Float8Tensor(w, torch.ones(()), G.TENSORWISE)
    # a weight without its transposed copy cannot give dgrad
    w8_no_t = Float8Tensor.from_tensor(w.requires_grad_(), E4M3, G.TENSORWISE, with_transpose=False)
    with pytest.raises(ValueError, match="transposed copy"):
        gemm_fp8(x.requires_grad_(), w8_no_t, trans_b=True)


# --------------------------------------------------------------------------------------------
# GPU: training shapes, every backend that can run them
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["CUBLAS", "TRITON"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.name)
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
@pytest.mark.parametrize("mnk", [(4096, 4096, 4096), (8192, 2048, 7168), (4000, 1000, 3000)])
def test_gemm_fp8_gpu(gran, fmt, layout, backend, mnk):
    a, b, ta, tb = _inputs(*mnk, layout, "cuda")
    cfg = _cfg(gran, fmt)
    GlobalBackendManager.set_gemm_backend(backend, precision="fp8")
    try:
        _check(a, b, ta, tb, cfg, msg=f"{gran.name}/{fmt.name}/{layout}/{backend}/{mnk}")
    except ValueError as e:  # cuBLAS declines some combos (E5M2 blockwise, odd sizes): that's by design
        if backend == "CUBLAS" and "cannot handle" in str(e):
            pytest.skip(str(e)[:120])
        raise


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_triton_tma_and_pointer_agree(mode, device):
    """The three load paths of the Triton kernels (host and device TMA descriptors run in the 3.7 interpreter
    on CPU)."""
    from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

    m, n, k = (1024, 768, 1024) if HAS_CUDA else (136, 144, 256)
    a = torch.randn(m, k, device=device).to(E4M3)
    b = torch.randn(n, k, device=device).to(E4M3)
    kb, nb = k // 128, -(-n // 128)
    shapes = {0: ((), ()), 1: ((m, 1), (n, 1)), 2: ((m, kb), (nb, kb)), 3: ((m, kb), (n, kb))}[mode]
    a_s = torch.rand(shapes[0], device=device) + 0.5
    b_s = torch.rand(shapes[1], device=device) + 0.5
    c_tma = gemm_fp8_triton(a, a_s, b, b_s, mode, 128, torch.float32, variant="tma")
    c_dev = gemm_fp8_triton(a, a_s, b, b_s, mode, 128, torch.float32, variant="tma_device")
    c_ptr = gemm_fp8_triton(a, a_s, b, b_s, mode, 128, torch.float32, variant="pointer")
    torch.testing.assert_close(c_tma, c_ptr, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(c_dev, c_ptr, rtol=1e-5, atol=1e-3)


# --------------------------------------------------------------------------------------------
# sm_90 compilation, in a process without TRITON_INTERPRET (see test_quantization.py)
# --------------------------------------------------------------------------------------------
def _compile_gemm_kernels():
    from primus_turbo.triton.gemm import gemm_fp8_kernel as gk

    e4, e5 = ("fp8e4nv", "fp8e4nv"), ("fp8e5", "fp8e4nv")  # (a, b) element types
    c0, c1 = gk.CONFIGS[0], gk.CONFIGS[1]
    # every scale mode on the main (TMA) path, the big tile, the pointer path, E5M2 x E4M3 mixes
    cases = [(mode, c0, e4, 1) for mode in range(4)] + [(0, c1, e4, 1), (2, c0, e4, 0), (3, c0, e5, 1)]
    cases += [(0, c0, e4[::-1], 1)]
    if os.environ.get("PRIMUS_TURBO_COMPILE_ALL"):  # every config x mode x path (slow: ~3 min)
        cases += [(m, c, e4, t) for m in range(4) for c in gk.CONFIGS for t in (0, 1)]
    for mode, cfg, (da, db), tma in cases:
        kw = cfg.kwargs
        if mode >= 2 and kw["BLOCK_K"] != 128:
            continue
        if tma:
            sig = {
                "a_ptr": f"tensordesc<{da}[{kw['BLOCK_M']},{kw['BLOCK_K']}]>",
                "b_ptr": f"tensordesc<{db}[{kw['BLOCK_N']},{kw['BLOCK_K']}]>",
            }
        else:
            sig = {"a_ptr": f"*{da}", "b_ptr": f"*{db}"}
        sig |= {"c_ptr": "*bf16", "a_s_ptr": "*fp32", "b_s_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32"}
        sig |= dict.fromkeys(["stride_am", "stride_bn", "stride_cm"], "i32")
        sig |= dict.fromkeys(["stride_asm", "stride_ask", "stride_bsn", "stride_bsk"], "i32")
        cex = {"SCALE_MODE": mode, "SCALE_BLOCK": 128, "USE_TMA": bool(tma), "NUM_SMS": 132, **kw}
        compiled = compile_for_sm90(
            gk.gemm_fp8_persistent_kernel,
            sig | dict.fromkeys(cex, "constexpr"),
            cex,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        assert "wgmma" in compiled.asm["ptx"], f"mode {mode} {kw} {da}x{db} tma={tma}: no wgmma"
        print(f"mode {mode} {kw} {da}x{db} tma={tma}: {compiled.metadata.shared} B shared", flush=True)
    # the device-descriptor kernel: pointers in, tensormaps made in the kernel (rowwise and blockwise)
    for mode in (1, 2):
        cfg = gk.DEVICE_CONFIGS[0]
        sig = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16"}
        sig |= {"a_s_ptr": "*fp32", "b_s_ptr": "*fp32"}
        sig |= dict.fromkeys(["M", "N", "K", "stride_am", "stride_bn", "stride_cm"], "i32")
        sig |= dict.fromkeys(["stride_asm", "stride_ask", "stride_bsn", "stride_bsk"], "i32")
        cex = {"SCALE_MODE": mode, "SCALE_BLOCK": 128, "NUM_SMS": 132, **cfg.kwargs}
        compiled = compile_for_sm90(
            gk.gemm_fp8_tma_device_persistent_kernel,
            sig | dict.fromkeys(cex, "constexpr"),
            cex,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        ptx = compiled.asm["ptx"]
        assert "wgmma" in ptx and "tensormap" in ptx, f"device descriptors, mode {mode}: no wgmma/tensormap"
        print(f"device descriptors, mode {mode}: {compiled.metadata.shared} B shared", flush=True)


def test_kernels_compile_for_sm90():
    run_compile_check(__file__, "--compile-sm90")


if __name__ == "__main__":
    import sys

    if "--compile-sm90" in sys.argv:
        _compile_gemm_kernels()
