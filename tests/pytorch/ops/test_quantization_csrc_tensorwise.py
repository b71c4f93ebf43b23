"""TENSORWISE FP8 quantization through the CUDA C++ kernels (backend "turbo", the CUDA default when the
extension is built), plain and with the transposed copy: bit for bit the torch reference's scale and FP8
values, inf/NaN rules, the unaligned scalar paths, partial tiles, and the dispatch (auto takes them; a pin
on a machine without the extension is an error)."""

from __future__ import annotations

import pytest
import torch

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.kernels.quantization import quantization_impl as impl
from primus_turbo.pytorch.ops.quantization import quantize_fp8, quantize_fp8_with_transpose

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
needs_extension = pytest.mark.skipif(not HAS_CPP_EXTENSION, reason="the CUDA extension is not built")


def _plain(x, dtype, pow2, backend):
    return impl.quantize_fp8_impl(x, dtype, "tensorwise", None, 0, 0, pow2, backend)


def _with_t(x, dtype, pow2, backend):
    return impl.quantize_fp8_with_transpose_impl(x, dtype, "tensorwise", 0, 0, pow2, backend)


def _bits(q):
    return q.view(torch.uint8)


def _assert_same(x, out_dtype, pow2):
    q, s = _plain(x, out_dtype, pow2, "turbo")
    q_ref, s_ref = _plain(x, out_dtype, pow2, "torch")
    assert q.shape == x.shape and q.dtype == out_dtype and s.shape == ()
    assert torch.equal(s, s_ref), (s.item(), s_ref.item())
    assert torch.equal(_bits(q), _bits(q_ref)), (_bits(q) != _bits(q_ref)).float().mean()
    if x.dim() != 2:
        return
    q, s, qt, st = _with_t(x, out_dtype, pow2, "turbo")
    rows, cols = x.shape
    assert qt.shape == (cols, rows) and qt.dtype == out_dtype and st.shape == ()
    assert torch.equal(s, s_ref) and torch.equal(st, s_ref)
    assert torch.equal(_bits(q), _bits(q_ref)), (_bits(q) != _bits(q_ref)).float().mean()
    assert torch.equal(_bits(qt), _bits(q_ref.t().contiguous())), "qt is not q's transpose"


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    # (8192, 4096), (24576, 2048): the vector paths and the 128 x 128 transpose tiles; (4097, 1000),
    # (130, 520): rows % 16 != 0 and partial tiles; (1040, 1032): partial 128-tiles; (3, 7), (7, 3000),
    # (1, 1): the scalar paths; (2, 3, 40): a 3-D tensor (plain quantization only)
    "shape",
    [(8192, 4096), (24576, 2048), (4097, 1000), (130, 520), (1040, 1032), (3, 7), (7, 3000), (1, 1)]
    + [(2, 3, 40)],
)
def test_turbo_matches_the_torch_reference_bit_for_bit(shape, in_dtype, out_dtype, pow2):
    # a wide dynamic range, so the one scale leaves small values near the FP8 subnormals
    x = torch.randn(shape, device="cuda") * torch.logspace(-3, 3, shape[-1], device="cuda")
    _assert_same(x.to(in_dtype), out_dtype, pow2)


@pytest.mark.gpu
@needs_extension
def test_turbo_unaligned_inf_nan_and_zero_tensor():
    base = torch.randn(96 * 256 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(96, 256)  # a 2-byte offset: the scalar paths
    assert x.data_ptr() % 16 != 0
    _assert_same(x, E4M3, False)
    y = torch.randn(64, 48, device="cuda")
    y[0, 3], y[1, 5], y[2, 7] = float("inf"), float("-inf"), float("nan")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for out_dtype in (E4M3, E5M2):
            _assert_same(y.to(dtype), out_dtype, False)
    q, s = _plain(y, E5M2, False, "turbo")
    assert torch.isnan(q.float()).sum() == 1 and torch.isfinite(s)
    zeros = torch.zeros(32, 64, device="cuda", dtype=torch.bfloat16)  # amax 0: scale 1
    q, s, qt, st = _with_t(zeros, E4M3, False, "turbo")
    assert s.item() == 1.0 and st.item() == 1.0 and not _bits(q).any() and not _bits(qt).any()
    q, s = _plain(torch.empty(0, 64, device="cuda"), E4M3, False, "turbo")
    assert q.shape == (0, 64)


@pytest.mark.gpu
@needs_extension
def test_auto_dispatch_takes_the_cuda_kernels(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton tensorwise kernel ran; auto should take the CUDA C++ one")

    monkeypatch.setattr(impl, "_tensorwise_triton", no_triton)
    x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    q_ref, s_ref = _plain(x, E4M3, False, "torch")
    q, s = quantize_fp8(x, E4M3, G.TENSORWISE)
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))
    q, s, qt, st = quantize_fp8_with_transpose(x, E4M3, G.TENSORWISE)
    assert torch.equal(st, s_ref) and torch.equal(_bits(qt), _bits(q_ref.t().contiguous()))


@pytest.mark.parametrize("quantize", [_plain, _with_t], ids=["plain", "transpose"])
def test_pinned_turbo_without_the_extension_or_off_cuda_is_an_error(quantize):
    x = torch.randn(4, 32)
    with pytest.raises((RuntimeError, ValueError), match="turbo|TURBO|TENSORWISE"):
        quantize(x, E4M3, False, "turbo")
