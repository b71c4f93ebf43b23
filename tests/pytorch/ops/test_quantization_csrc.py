"""ROWWISE FP8 quantization through the CUDA C++ kernels (backend "turbo", the CUDA default when the
extension is built), plain and with the transposed column-scaled copy: bit for bit the torch
reference's scales and FP8 values, inf/NaN rules, the unaligned scalar paths, partial tiles, and the
dispatch (auto takes them; a pin on a machine without the extension is an error)."""

from __future__ import annotations

import pytest
import torch
from ref.quantization_ref import FP8_MAX

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.kernels.quantization import quantization_impl as impl
from primus_turbo.pytorch.ops.quantization import quantize_fp8, quantize_fp8_with_transpose

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
needs_extension = pytest.mark.skipif(not HAS_CPP_EXTENSION, reason="the CUDA extension is not built")


def _rowwise(x, dtype, pow2, backend):
    return impl.quantize_fp8_impl(x, dtype, "rowwise", -1, 0, 0, pow2, backend)


def _rowwise_t(x, dtype, pow2, backend):
    return impl.quantize_fp8_with_transpose_impl(x, dtype, "rowwise", 0, 0, pow2, backend)


def _assert_same_transpose(x, out_dtype, pow2):
    q, s, qt, st = _rowwise_t(x, out_dtype, pow2, "turbo")
    q_ref, s_ref, qt_ref, st_ref = _rowwise_t(x, out_dtype, pow2, "torch")
    rows, cols = x.shape
    assert q.shape == (rows, cols) and qt.shape == (cols, rows) and q.dtype == qt.dtype == out_dtype
    assert s.shape == (rows, 1) and st.shape == (cols, 1)
    assert torch.equal(s, s_ref), (s - s_ref).abs().max()
    assert torch.equal(st, st_ref), (st - st_ref).abs().max()
    assert torch.equal(_bits(q), _bits(q_ref)), (_bits(q) != _bits(q_ref)).float().mean()
    assert torch.equal(_bits(qt), _bits(qt_ref)), (_bits(qt) != _bits(qt_ref)).float().mean()


def _bits(q):
    return q.view(torch.uint8)


def _unaligned_bf16(rows, cols):
    """A [rows, cols] bf16 CUDA view at a 2-byte offset: the kernels' scalar (no 16-byte vector) path."""
    base = torch.randn(rows * cols + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(rows, cols)
    assert x.data_ptr() % 16 != 0
    return x


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
    x = _unaligned_bf16(rows, cols)
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


def _forbid_triton(monkeypatch, kernel: str) -> None:
    """Make the Triton twin ``impl.<kernel>`` fail if it runs: auto must take the CUDA C++ kernel."""

    def no_triton(*args, **kwargs):
        raise AssertionError(f"the Triton kernel {kernel} ran; auto should take the CUDA C++ one")

    monkeypatch.setattr(impl, kernel, no_triton)


@pytest.mark.gpu
@needs_extension
def test_auto_dispatch_uses_the_cuda_kernel(monkeypatch):
    _forbid_triton(monkeypatch, "_rowwise_triton")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8(x, E4M3, G.ROWWISE)
    q_ref, s_ref = _rowwise(x, E4M3, False, "torch")
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))
    empty = torch.empty(0, 256, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_fp8(empty, E4M3, G.ROWWISE)
    assert q.shape == (0, 256) and s.shape == (0, 1)


@pytest.mark.parametrize("quantize", [_rowwise, _rowwise_t], ids=["plain", "transpose"])
def test_pinned_turbo_without_the_extension_or_off_cuda_is_an_error(quantize):
    x = torch.randn(4, 32)
    with pytest.raises((RuntimeError, ValueError), match="turbo|TURBO"):
        quantize(x, E4M3, False, "turbo")


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("out_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    # (8192, 4096): the vector paths; (4097, 1000) and (130, 520): rows % 16 != 0 (byte stores of qt) and
    # partial tiles; (256, 136): 16-byte qt stores with a partial column tile; (3, 7), (7, 3000): the
    # scalar path (cols % 8 != 0); (24576, 2048): a DeepSeek-V2-Lite expert activation; (1040, 1032),
    # (48, 200), (16, 65536): 2-byte inputs on the 128 x 128 tile kernel with partial row and column tiles
    "shape",
    [(8192, 4096), (4097, 1000), (130, 520), (256, 136), (3, 7), (1, 1), (7, 3000), (24576, 2048)]
    + [(16, 65536), (1040, 1032), (48, 200)],
)
def test_turbo_transpose_matches_the_torch_reference_bit_for_bit(shape, in_dtype, out_dtype, pow2):
    # rows and columns of different magnitudes: row scales and column scales both differ
    rows, cols = shape
    x = torch.randn(shape, device="cuda") * torch.logspace(-3, 3, rows, device="cuda")[:, None]
    x = x * torch.logspace(-2, 2, cols, device="cuda")[None, :]
    _assert_same_transpose(x.to(in_dtype), out_dtype, pow2)


@pytest.mark.gpu
@needs_extension
@pytest.mark.parametrize("shape", [(180272, 2048), (270352, 4096)], ids=["rows256", "rows512"])
def test_turbo_transpose_tall_tensors(shape):
    """Grouped expert weights as [G*N, K]: the amax pass takes 256 / 512-row blocks on these (a partial
    last block here); bit for bit the reference."""
    rows, cols = shape
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x[rows - 3, 5] = 300.0  # a row and a column maximum inside the partial last block
    _assert_same_transpose(x, E4M3, False)


@pytest.mark.gpu
@needs_extension
def test_turbo_transpose_unaligned_input_and_inf_nan():
    rows, cols = 96, 256
    x = _unaligned_bf16(rows, cols)
    _assert_same_transpose(x, E4M3, False)
    y = torch.randn(64, 48, device="cuda")
    y[0, 3], y[1, 5], y[2, 7] = float("inf"), float("-inf"), float("nan")
    y[4] = 0.0  # a zero row: scale 1
    y[:, 9] = 0.0  # a zero column: scale 1
    _assert_same_transpose(y, E5M2, False)
    for dtype in (torch.bfloat16, torch.float16):  # the 128 x 128 tile kernel's paired conversions
        for out_dtype in (E4M3, E5M2):
            _assert_same_transpose(y.to(dtype), out_dtype, False)
    q, s, qt, st = _rowwise_t(y, E5M2, False, "turbo")
    assert s[4].item() == 1.0 and st[9].item() == 1.0
    assert torch.isnan(q.float()).sum() == 1 and torch.isnan(qt.float()).sum() == 1


@pytest.mark.gpu
@needs_extension
def test_auto_dispatch_takes_the_cuda_transpose_kernel(monkeypatch):
    _forbid_triton(monkeypatch, "_rowwise_with_transpose_triton")
    x = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    q, s, qt, st = quantize_fp8_with_transpose(x, E4M3, G.ROWWISE)
    q_ref, s_ref, qt_ref, st_ref = _rowwise_t(x, E4M3, False, "torch")
    assert torch.equal(_bits(qt), _bits(qt_ref)) and torch.equal(st.reshape(-1), st_ref.reshape(-1))
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s.reshape(-1), s_ref.reshape(-1))
