"""turbo.ops.grouped_gemm_fp8: SNR gates against the fp64 reference for fwd, dgrad and wgrad."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import grouped_gemm_grads_ref, grouped_gemm_ref, make_group_lens
from test_utils import assert_close, assert_snr, fp8_snr_gate

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import GroupedGemmFP8Dispatcher
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8

GRANULARITIES = list(ScalingGranularity)


def _run(backend, G, M, K, N, kind, trans_b, config, device, dtype=torch.bfloat16):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    lens = make_group_lens(M, G, kind, device)
    a = torch.randn(M, K, dtype=dtype, device=device, requires_grad=True)
    b = (
        torch.randn((G, N, K) if trans_b else (G, K, N), dtype=dtype, device=device) / K**0.5
    ).requires_grad_()
    grad_out = torch.randn(M, N, dtype=dtype, device=device)
    out = grouped_gemm_fp8(a, b, lens, trans_b=trans_b, config=config)
    out.backward(grad_out)
    return a, b, lens, grad_out, out


def _check(backend, G, M, K, N, kind, trans_b, config, device):
    a, b, lens, grad_out, out = _run(backend, G, M, K, N, kind, trans_b, config, device)
    ref = grouped_gemm_ref(a, b, lens, trans_b)
    ref_da, ref_db = grouped_gemm_grads_ref(a, b, lens, grad_out, trans_b)
    tag = f"{backend} {config.granularity.name} {config.format.name} {kind} trans_b={trans_b}"
    gate = fp8_snr_gate(config.format)
    assert out.dtype == a.dtype and b.grad.dtype == b.dtype
    assert_snr(out, ref, fp8_snr_gate(Format.E4M3) if config.format is Format.HYBRID else gate, f"out {tag}")
    assert_snr(a.grad, ref_da, gate, f"grad_a {tag}")
    live = lens > 0
    assert_snr(b.grad[live], ref_db[live], gate, f"grad_b {tag}")
    assert torch.count_nonzero(b.grad[~live]) == 0, f"{tag}: wgrad of an empty expert is not exactly zero"


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID])
def test_grouped_gemm_fp8_triton(granularity, fmt, device):
    kind = "empty" if fmt is Format.E4M3 else "skewed"
    _check(
        "TRITON", 4, 128, 256, 160, kind, True, Float8QuantConfig(format=fmt, granularity=granularity), device
    )


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_grouped_gemm_fp8_triton_b_not_transposed(granularity, device):
    _check("TRITON", 3, 96, 128, 136, "balanced", False, Float8QuantConfig(granularity=granularity), device)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_grouped_gemm_fp8_n_multiple_of_128(granularity, device):
    """N % 128 == 0: every granularity takes its dgrad weight from the forward's transposed copy."""
    _check("TRITON", 3, 96, 128, 256, "skewed", True, Float8QuantConfig(granularity=granularity), device)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_grouped_gemm_fp8_torch_reference(granularity, device):
    _check("TORCH", 3, 96, 128, 64, "skewed", True, Float8QuantConfig(granularity=granularity), device)


@pytest.mark.parametrize("granularity", [ScalingGranularity.TENSORWISE, ScalingGranularity.BLOCKWISE])
def test_triton_matches_torch_on_same_quantized_operands(granularity, device):
    """Same quantized inputs, two backends: only accumulation order may differ."""
    config = Float8QuantConfig(granularity=granularity)
    results = []
    for backend in ["TORCH", "TRITON"]:
        torch.manual_seed(7)
        a, b, _, _, out = _run(backend, 3, 64, 128, 128, "skewed", True, config, device)
        results.append((out.detach(), a.grad, b.grad))
        assert GroupedGemmFP8Dispatcher.last_backend is BackendType[backend]
    for name, x, y in zip(("out", "grad_a", "grad_b"), results[0], results[1], strict=True):
        assert_close(x, y, torch.bfloat16, msg=f"{granularity.name} {name}: TRITON vs TORCH")


def test_grouped_gemm_fp8_zero_tokens_and_out_dtype(device):
    G, K, N = 2, 64, 32
    a = torch.randn(0, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = torch.randn(G, N, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    out = grouped_gemm_fp8(a, b, torch.zeros(G, dtype=torch.int64, device=device), out_dtype=torch.float32)
    assert out.shape == (0, N) and out.dtype == torch.float32
    out.sum().backward()
    assert torch.count_nonzero(b.grad) == 0


def test_grouped_gemm_fp8_bad_inputs(device):
    a = torch.randn(8, 32, dtype=torch.bfloat16, device=device)
    b = torch.randn(2, 16, 32, dtype=torch.bfloat16, device=device)
    lens = torch.tensor([3, 5], device=device)
    with pytest.raises(TypeError, match="config must be a Float8QuantConfig"):
        grouped_gemm_fp8(a, b, lens, config="rowwise")
    with pytest.raises(ValueError, match="block_size=128"):
        grouped_gemm_fp8(
            a, b, lens, config=Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=64)
        )
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_gemm_fp8(a, b, lens, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="group_lens has 1 groups but b has G=2"):
        grouped_gemm_fp8(a, b, lens[:1])
    with pytest.raises(ValueError, match="reduction dims differ"):
        grouped_gemm_fp8(a, b, lens, trans_b=False)
    with pytest.raises(TypeError, match="share one dtype"):
        grouped_gemm_fp8(a.to(torch.float8_e4m3fn), b, lens)


# -- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("G,K,N", [(64, 2048, 1408), (32, 7168, 2048), (8, 4096, 14336)])
def test_grouped_gemm_fp8_gpu_training_shapes(granularity, G, K, N, device):
    _check("TRITON", G, 8192, K, N, "skewed", True, Float8QuantConfig(granularity=granularity), device)


@pytest.mark.gpu
@pytest.mark.parametrize("G,K,N", [(64, 2048, 1408), (32, 7168, 2048)])
@pytest.mark.parametrize("kind", ["balanced", "empty"])
@pytest.mark.parametrize("granularity", [ScalingGranularity.ROWWISE, ScalingGranularity.TENSORWISE])
def test_grouped_gemm_fp8_cutlass_forward(G, K, N, kind, granularity, device):
    """torch._scaled_grouped_mm serves the E4M3 forward: ROWWISE, and TENSORWISE as broadcast rowwise."""
    GlobalBackendManager.set_grouped_gemm_backend("CUTLASS")
    lens = make_group_lens(8192, G, kind, device)
    a = torch.randn(8192, K, dtype=torch.bfloat16, device=device)
    b = torch.randn(G, N, K, dtype=torch.bfloat16, device=device) / K**0.5
    out = grouped_gemm_fp8(a, b, lens, config=Float8QuantConfig(granularity=granularity))
    assert GroupedGemmFP8Dispatcher.last_backend is BackendType.CUTLASS
    assert_snr(out, grouped_gemm_ref(a, b, lens, True), 25.0, f"CUTLASS {granularity.name} {kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON", "default"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_grouped_gemm_fp8_cuda_graph_capture(backend, granularity, device):
    """default: ROWWISE runs fwd/dgrad on torch._scaled_grouped_mm, wgrad on Triton."""
    if backend == "TRITON":
        GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    config = Float8QuantConfig(granularity=granularity)
    G, M, K, N = 8, 1024, 512, 256
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = (torch.randn(G, N, K, dtype=torch.bfloat16, device=device) / K**0.5).requires_grad_()
    lens = make_group_lens(M, G, "balanced", device)
    grad_out = torch.randn(M, N, dtype=torch.bfloat16, device=device)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            a.grad = b.grad = None
            grouped_gemm_fp8(a, b, lens, config=config).backward(grad_out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    a.grad = b.grad = None
    with torch.cuda.graph(graph):
        out = grouped_gemm_fp8(a, b, lens, config=config)
        out.backward(grad_out)
    for kind in ["empty", "skewed"]:
        lens.copy_(make_group_lens(M, G, kind, device))
        graph.replay()
        torch.cuda.synchronize()
        ref = grouped_gemm_ref(a, b, lens, True)
        ref_da, ref_db = grouped_gemm_grads_ref(a, b, lens, grad_out, True)
        assert_snr(out, ref, 25.0, f"graph out {kind}")
        assert_snr(a.grad, ref_da, 25.0, f"graph grad_a {kind}")
        live = lens > 0
        assert_snr(b.grad[live], ref_db[live], 25.0, f"graph grad_b {kind}")
        assert torch.count_nonzero(b.grad[~live]) == 0
