"""The cached-plan cuBLASLt FP8 GEMM (csrc op ``gemm_fp8_cublaslt``, the CUBLAS backend's path for
tensor-wise and row-wise scales): numerics against the fp32 dequantized reference and against
torch._scaled_mm, E4M3/E5M2 mixes, output dtypes, odd M, unaligned pointers, plan reuse with new data
and scales, CUDA graph replay, empty problems and bad input."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import (
    HAS_CUBLASLT_PLANS,
    GemmFP8Dispatcher,
    GemmFP8TorchBackend,
    gemm_fp8_impl,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not HAS_CUBLASLT_PLANS, reason="the extension was built without gemm_fp8_cublaslt"),
]


def _ops():
    return torch.ops.primus_turbo_cpp_extension


def _operand(rows, k, dtype, scale_mode, device="cuda"):
    x = torch.randn(rows, k, device=device) * 4
    q = x.clamp(-400, 400).to(dtype)
    s = (torch.rand(rows if scale_mode == 1 else 1, 1, device=device) + 0.5) / 64
    return q, s


def _reference(a, a_s, b, b_s, scale_mode):
    return GemmFP8TorchBackend.execute(a, a_s, b, b_s, scale_mode, 0, torch.float32)


def _check(out, ref, out_dtype):
    assert out.dtype == out_dtype and out.shape == ref.shape
    err = (out.float() - ref).norm() / ref.norm()
    # fp32 out: ~1e-4 measured on H100, the FP8 tensor cores' accumulator (cuBLAS promotes it to fp32
    # every few K blocks); bf16/fp16 out adds the output rounding
    tol = 1e-3 if out_dtype == torch.float32 else 8e-3
    assert err < tol, f"relative error {err:.3e} >= {tol}"


@pytest.mark.parametrize("scale_mode", [0, 1])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["e4m3", "e5m2a", "e5m2b"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mnk", [(1, 16, 16), (17, 48, 32), (1000, 2048, 1024), (4096, 576, 2048)])
def test_matches_fp32_reference(scale_mode, dtypes, out_dtype, mnk):
    torch.manual_seed(hash((scale_mode, mnk)) % 1000)
    m, n, k = mnk
    a, a_s = _operand(m, k, dtypes[0], scale_mode)
    b, b_s = _operand(n, k, dtypes[1], scale_mode)
    out, supported = _ops().gemm_fp8_cublaslt(a, a_s, b, b_s, scale_mode, out_dtype, False)
    if dtypes == (E4M3, E4M3) and out_dtype == torch.bfloat16:
        assert supported, "cuBLASLt declined the plain E4M3 -> bf16 problem"
    if not supported:
        pytest.skip(f"cuBLASLt has no algorithm for {dtypes} -> {out_dtype}, mode {scale_mode} here")
    _check(out, _reference(a, a_s, b, b_s, scale_mode), out_dtype)


@pytest.mark.parametrize("scale_mode", [0, 1])
def test_matches_torch_scaled_mm(scale_mode):
    a, a_s = _operand(512, 1024, E4M3, scale_mode)
    b, b_s = _operand(768, 1024, E4M3, scale_mode)
    out, supported = _ops().gemm_fp8_cublaslt(a, a_s, b, b_s, scale_mode, torch.bfloat16, False)
    assert supported
    sa, sb = (a_s.reshape(()), b_s.reshape(())) if scale_mode == 0 else (a_s, b_s.reshape(1, -1))
    ref = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert (out.float() - ref.float()).norm() <= 2e-3 * ref.float().norm()


def test_plan_is_built_once_and_reused_with_new_data_and_scales():
    m, n, k = 272, 400, 528  # a shape no other test uses
    before = _ops().gemm_fp8_cublaslt_plan_count()
    for seed in range(3):
        torch.manual_seed(seed)
        a, a_s = _operand(m, k, E4M3, 1)
        b, b_s = _operand(n, k, E4M3, 1)
        out, supported = _ops().gemm_fp8_cublaslt(a, a_s, b, b_s, 1, torch.bfloat16, False)
        assert supported
        _check(out, _reference(a, a_s, b, b_s, 1), torch.bfloat16)
    assert _ops().gemm_fp8_cublaslt_plan_count() == before + 1


def test_16_byte_aligned_views_get_their_own_plan_and_unaligned_ones_are_declined():
    m, n, k = 64, 64, 96
    base_a, a_s = _operand(m + 1, k, E4M3, 1)
    b, b_s = _operand(n, k, E4M3, 1)
    a16 = base_a[1:]  # 96-byte offset: 32-byte aligned, not 256
    a_s16 = a_s[1:]
    out, supported = _ops().gemm_fp8_cublaslt(a16, a_s16, b, b_s, 1, torch.bfloat16, False)
    assert supported
    _check(out, _reference(a16, a_s16, b, b_s, 1), torch.bfloat16)
    flat = torch.randn(m * k + 8, device="cuda").to(E4M3)
    a8 = flat[8:].view(m, k)  # 8-byte offset: below the FP8 kernels' 16-byte minimum
    ones = torch.ones(m, 1, device="cuda")
    out, supported = _ops().gemm_fp8_cublaslt(a8, ones, b, b_s, 1, torch.bfloat16, False)
    assert not supported and out.numel() == 0


def test_dispatcher_cublas_backend_runs_the_cached_plan_op():
    a, a_s = _operand(320, 512, E4M3, 1)
    b, b_s = _operand(256, 512, E4M3, 1)
    before = _ops().gemm_fp8_cublaslt_plan_count()
    GlobalBackendManager.set_gemm_backend("CUBLAS", precision="fp8")
    try:
        out = gemm_fp8_impl(a, a_s, b, b_s, 1, 0, torch.bfloat16)
        backend = GemmFP8Dispatcher.last_backend
    finally:
        GlobalBackendManager.reset()  # also clears last_backend
    assert backend is BackendType.CUBLAS
    assert _ops().gemm_fp8_cublaslt_plan_count() == before + 1
    _check(out, _reference(a, a_s, b, b_s, 1), torch.bfloat16)


def test_cuda_graph_replay_reads_the_new_inputs():
    a, a_s = _operand(256, 256, E4M3, 1)
    b, b_s = _operand(128, 256, E4M3, 1)
    _ops().gemm_fp8_cublaslt(a, a_s, b, b_s, 1, torch.bfloat16, False)  # plan built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = _ops().gemm_fp8_cublaslt(a, a_s, b, b_s, 1, torch.bfloat16, False)
    new_a, new_s = _operand(256, 256, E4M3, 1)
    a.copy_(new_a)
    a_s.copy_(new_s)
    graph.replay()
    torch.cuda.synchronize()
    _check(out, _reference(a, a_s, b, b_s, 1), torch.bfloat16)


def test_empty_problems():
    b, b_s = _operand(32, 64, E4M3, 1)
    out, supported = _ops().gemm_fp8_cublaslt(b[:0], b_s[:0], b, b_s, 1, torch.bfloat16, False)
    assert supported and out.shape == (0, 32)
    a0 = torch.empty(8, 0, device="cuda", dtype=E4M3)
    b0 = torch.empty(32, 0, device="cuda", dtype=E4M3)
    ones = torch.ones(8, device="cuda")
    out, supported = _ops().gemm_fp8_cublaslt(a0, ones, b0, b_s, 1, torch.bfloat16, False)
    assert supported and out.shape == (8, 32) and not out.any()


@pytest.mark.parametrize(
    "case, message",
    [
        ("k_mismatch", "K differs"),
        ("scale_count", "needs 64 a_scale and 32 b_scale values"),
        ("e5m2_both", "float8_e5m2 x float8_e5m2 has no cuBLAS kernel"),
        ("not_fp8", "must be float8_e4m3fn or float8_e5m2"),
        ("mode", r"scale_mode 2 is not supported; accepted: 0 \(tensor-wise\), 1 \(row-wise\)"),
        ("out_dtype", "out_dtype Int is not supported; accepted: bfloat16, float16, float32"),
    ],
)
def test_bad_input_names_the_argument(case, message):
    a, a_s = _operand(64, 64, E4M3, 1)
    b, b_s = _operand(32, 64, E4M3, 1)
    mode, out_dtype = 1, torch.bfloat16
    if case == "k_mismatch":
        b = b[:, :48].contiguous()
    elif case == "scale_count":
        a_s = a_s[:10]
    elif case == "e5m2_both":
        a, b = a.to(torch.float32).to(E5M2), b.to(torch.float32).to(E5M2)
    elif case == "not_fp8":
        a = a.to(torch.bfloat16)
    elif case == "mode":
        mode = 2
    else:
        out_dtype = torch.int32
    with pytest.raises(RuntimeError, match=message):
        _ops().gemm_fp8_cublaslt(a, a_s, b, b_s, mode, out_dtype, False)
