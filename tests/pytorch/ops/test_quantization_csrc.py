"""ROWWISE FP8 quantization through the CUDA C++ kernel (backend "turbo", the CUDA default when the
extension is built): bit for bit the torch reference's scales and FP8 values, inf/NaN rules, the
unaligned scalar path, and the dispatch (auto takes it; a pin on a machine without it is an error)."""

from __future__ import annotations

import pytest
import torch
from ref.quantization_ref import FP8_MAX

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.kernels.quantization import quantization_impl as impl
from primus_turbo.pytorch.ops.quantization import quantize_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
needs_extension = pytest.mark.skipif(not HAS_CPP_EXTENSION, reason="the CUDA extension is not built")


def _rowwise(x, dtype, pow2, backend):
    return impl.quantize_fp8_impl(x, dtype, "rowwise", -1, 0, 0, pow2, backend)


def _bits(q):
    return q.view(torch.uint8)


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape", [(8192, 4096), (4097, 1000), (3, 7), (2, 16392), (1, 1), (24576, 2048), (5, 8192), (7, 3000)]
)
def test_turbo_matches_the_torch_reference_bit_for_bit(shape, in_dtype, out_dtype, pow2):
    # rows of different magnitudes (scales differ per row), some tiny values (FP8 subnormals)
    x = torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[0], device="cuda")[:, None]
    x = x.to(in_dtype)
    q, s = _rowwise(x, out_dtype, pow2, "turbo")
    q_ref, s_ref = _rowwise(x, out_dtype, pow2, "torch")
    assert q.shape == x.shape and q.dtype == out_dtype and s.shape == (shape[0], 1)
    assert torch.equal(s, s_ref), (s - s_ref).abs().max()
    assert torch.equal(_bits(q), _bits(q_ref)), (_bits(q) != _bits(q_ref)).float().mean()
    q_tri, s_tri = _rowwise(x, out_dtype, pow2, "triton")
    assert torch.equal(s, s_tri)


@pytest.mark.gpu
@needs_extension
def test_unaligned_input_takes_the_scalar_path_and_agrees():
    rows, cols = 257, 4096
    base = torch.randn(rows * cols + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(rows, cols)  # 2-byte offset: no 16-byte vectors
    assert x.data_ptr() % 16 != 0
    q, s = _rowwise(x, E4M3, False, "turbo")
    q_ref, s_ref = _rowwise(x, E4M3, False, "torch")
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_turbo_inf_nan_and_zero_rows(out_dtype):
    x = torch.randn(5, 64, device="cuda")
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("-inf"), float("nan")
    x[4] = 0.0
    finite_amax = torch.where(torch.isfinite(x), x.abs(), 0).amax(dim=1)
    q, s = _rowwise(x, out_dtype, False, "turbo")
    want = torch.where(finite_amax > 0, finite_amax / FP8_MAX[out_dtype], 1.0)
    torch.testing.assert_close(s.squeeze(1), want, rtol=1e-6, atol=0)
    qf = q.float()
    assert qf[0, 3] == FP8_MAX[out_dtype] and qf[1, 5] == -FP8_MAX[out_dtype] and torch.isnan(qf[2, 7])
    assert torch.isnan(qf).sum() == 1 and torch.all(qf[4] == 0) and s[4].item() == 1.0


@pytest.mark.gpu
@needs_extension
def test_auto_dispatch_uses_the_cuda_kernel(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton rowwise kernel ran; auto should take the CUDA C++ one")

    monkeypatch.setattr(impl, "_rowwise_triton", no_triton)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8(x, E4M3, G.ROWWISE)
    q_ref, s_ref = _rowwise(x, E4M3, False, "torch")
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))
    empty = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8(empty, E4M3, G.ROWWISE)
    assert q.shape == (0, 256) and s.shape == (0, 1)


def test_pinned_turbo_without_the_extension_or_off_cuda_is_an_error():
    x = torch.randn(4, 32)
    with pytest.raises((RuntimeError, ValueError), match="turbo|TURBO"):
        _rowwise(x, E4M3, False, "turbo")
