"""FP8 quantization: every granularity x format x backend against the fp64 loop reference."""

from __future__ import annotations

import pytest
import torch
from ref.quantization_ref import FP8_MAX, ref_quantize_groups
from test_utils import SNR_E4M3_DB, SNR_E5M2_DB, compute_snr
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.kernels.quantization import quantization_impl as impl
from primus_turbo.pytorch.ops.quantization import (
    dequantize_fp8,
    normalize_spec,
    quantize_fp8,
    quantize_fp8_with_transpose,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BACKENDS = ["torch", "triton"]

# (granularity, block_size, axis, reference group (gr, gc) for a 2-D input)
SPECS = [
    (G.TENSORWISE, None, None, (0, 0)),
    (G.ROWWISE, None, -1, (1, 0)),
    (G.ROWWISE, None, 0, (0, 1)),
    (G.BLOCKWISE, 32, -1, (1, 32)),
    (G.BLOCKWISE, 32, 0, (32, 1)),
    (G.BLOCKWISE, (32, 32), None, (32, 32)),
]


def _quantize(x, dtype, spec, backend, pow2=False):
    g, bs, axis, _ = spec
    gn, ax, br, bc = normalize_spec(x.dim(), g, bs, axis)
    return impl.quantize_fp8_impl(x, dtype, gn, ax, br, bc, pow2, backend)


def _check_against_ref(x, q, s, dtype, group, pow2=False):
    x, q, s = x.cpu(), q.cpu(), s.cpu()
    ref_q, ref_s = ref_quantize_groups(x.float(), *group, dtype, pow2)
    gr, gc = group
    rows, cols = x.shape
    grid = s.double().reshape(ref_s.shape) if s.dim() else s.double().reshape(1, 1)
    torch.testing.assert_close(grid, ref_s, rtol=1e-6, atol=0)
    full = grid.repeat_interleave(gr or rows, 0).repeat_interleave(gc or cols, 1)[:rows, :cols]
    deq = q.double() * full
    # fp32 vs fp64 products may round differently at a tie: allow a handful of 1-ulp mismatches.
    mismatch = (q.double() != ref_q).float().mean().item()
    assert mismatch < 0.01, f"{mismatch:.2%} elements differ from the reference"
    assert compute_snr(x.double(), deq) >= (SNR_E4M3_DB if dtype == E4M3 else SNR_E5M2_DB)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0].name}-{s[1]}-{s[2]}")
def test_quantize_matches_reference(backend, dtype, spec, device):
    x = torch.randn(80, 72, dtype=torch.bfloat16, device=device) * 3  # odd sizes: partial blocks on both axes
    q, s = _quantize(x, dtype, spec, backend)
    assert q.dtype == dtype and q.shape == x.shape and s.dtype == torch.float32
    _check_against_ref(x, q, s, dtype, spec[3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0].name}-{s[1]}-{s[2]}")
def test_quantize_with_transpose(backend, spec, device):
    g, bs, axis, _ = spec
    if axis == 0:
        pytest.skip("with_transpose has no axis")
    x = torch.randn(64, 48, dtype=torch.float32, device=device)
    gn, _, br, bc = normalize_spec(2, g, bs, None)
    q, s, qt, st = impl.quantize_fp8_with_transpose_impl(x, E4M3, gn, br, bc, False, backend)
    assert q.shape == (64, 48) and qt.shape == (48, 64) and qt.is_contiguous()
    group = spec[3]
    _check_against_ref(x, q, s, E4M3, group)
    group_t = group[::-1] if isinstance(bs, tuple) or g is not G.BLOCKWISE else (1, bs)
    group_t = (1, 0) if g is G.ROWWISE else group_t
    _check_against_ref(x.t().contiguous(), qt, st, E4M3, group_t)


def test_rowwise_transpose_many_partials(device):
    """More row blocks than one reduction step of partial_to_scale_kernel (loop over partials)."""
    x = torch.randn(2100, 24, device=device)
    x[1500, 5] = 80.0  # column 5's amax comes from a late row block
    got = impl.quantize_fp8_with_transpose_impl(x, E4M3, "rowwise", 0, 0, False, "triton")
    want = impl.quantize_fp8_with_transpose_impl(x, E4M3, "rowwise", 0, 0, False, "torch")
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if g.dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
        else:
            assert (g.float() != w.float()).float().mean() < 1e-3


def test_rowwise_two_pass_path(device):
    """Rows longer than the register tile take the two-pass (amax, cast) loop."""
    x = torch.randn(24, 200, device=device)
    q, s = impl._rowwise_triton(x, E4M3, False, max_row_tile=64)
    _check_against_ref(x, q, s, E4M3, (1, 0))


def test_column_scales_many_chunks(device):
    """> 32 row chunks: the column-scale pass grows its chunk instead of its register tile."""
    x = torch.randn(8300, 8, device=device)
    x[8299, 3] = 50.0
    got = impl.quantize_fp8_impl(x, E4M3, "rowwise", 0, 0, 0, False, "triton")
    want = impl.quantize_fp8_impl(x, E4M3, "rowwise", 0, 0, 0, False, "torch")
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    assert (got[0].float() != want[0].float()).float().mean() < 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_power_of_two_scales(backend, device):
    x = torch.randn(32, 64, device=device) * 7
    q, s = impl.quantize_fp8_impl(x, E4M3, "rowwise", -1, 0, 0, True, backend)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5), "scale_inv must be a power of two"
    _check_against_ref(x, q, s, E4M3, (1, 0), pow2=True)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_scale_is_correctly_rounded_division(dtype):
    # fp8_max / amax rounded once (IEEE), as the Triton kernels compute it with div_rn: the
    # reciprocal-then-multiply of `float / tensor` is off by one ulp for many amaxes, which moved
    # ~0.6% of the fp8 values between the TRITON and TORCH backends on a GPU.
    amax = torch.rand(4096, dtype=torch.float64).add_(1e-3).mul_(10).float()
    scale = impl.scale_from_amax(amax, dtype, False)
    exact = (FP8_MAX[dtype] / amax.double()).float()
    assert torch.equal(scale, exact)
    torch.testing.assert_close(1.0 / scale, (1.0 / scale.double()).float(), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensorwise_backends_bit_identical(backend, device):
    # odd sizes (partial blocks of every kernel); q and scale_inv must equal the torch reference's
    x = torch.randn(193, 250, device=device, dtype=torch.bfloat16) * 3
    q, s = _quantize(x, E4M3, SPECS[0], backend)
    qr, sr = _quantize(x, E4M3, SPECS[0], "torch")
    assert torch.equal(s, sr)
    assert torch.equal(q.float(), qr.float())
    q, s, qt, st = impl.quantize_fp8_with_transpose_impl(x, E4M3, "tensorwise", 0, 0, False, backend)
    assert torch.equal(qt.float(), qr.float().t()) and torch.equal(st, sr)


@pytest.mark.parametrize("with_t", [True, False])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_static_scale_triton_matches_torch(dtype, with_t, device):
    # delayed scaling's cast: given scale, q (and q^T) bit-identical, amax of the whole tensor
    x = (torch.randn(130, 200, device=device) * 2).clamp(-8, 8)  # unclamped, 1 run in ~20 had |x| > 9.5
    x[77, 150] = -9.5  # the amax sits in a partial tile
    scale = torch.tensor(FP8_MAX[dtype] / 12.0, device=device)
    q, s, qt, amax = impl.quantize_fp8_tensorwise_static_impl(x, scale, dtype, with_t, "triton")
    qr, sr, qtr, amaxr = impl.quantize_fp8_tensorwise_static_impl(x, scale, dtype, with_t, "torch")
    assert torch.equal(q.float(), qr.float()) and torch.equal(s, sr)
    assert amax.item() == 9.5 and amaxr.item() == 9.5
    if with_t:
        assert torch.equal(qt.float(), qtr.float())


def test_public_api_shapes_and_dequantize_roundtrip():
    x = torch.randn(4, 40, 96)
    for g, bs, axis, shape in [
        (G.TENSORWISE, None, None, ()),
        (G.ROWWISE, None, -1, (4, 40, 1)),
        (G.BLOCKWISE, 64, None, (4, 40, 2)),
        (G.BLOCKWISE, (32, 64), None, (4, 2, 2)),
    ]:
        q, s = quantize_fp8(x, E4M3, g, block_size=bs, axis=axis)
        assert tuple(s.shape) == shape, (g, bs, s.shape)
        deq = dequantize_fp8(q, s, g, block_size=bs, axis=axis, out_dtype=torch.float32)
        # E4M3 has 3 mantissa bits: round-to-nearest error <= 2^-4 relative (plus the subnormal floor)
        err = (deq - x).abs()
        bound = x.abs() * 2**-4 + s.max() * 2**-9
        assert torch.all(err <= bound), f"{g}: max err {err.max():.4g}"


def test_zero_and_constant_inputs():
    z = torch.zeros(16, 32)
    q, s = quantize_fp8(z, E4M3, G.ROWWISE)
    assert torch.all(s == 1.0) and torch.all(q.float() == 0)
    e = torch.empty(0, 32)
    q, s = quantize_fp8(e, E4M3, G.BLOCKWISE, block_size=32)
    assert q.shape == (0, 32) and s.shape == (0, 1)
    q, s = quantize_fp8(e, E4M3, G.TENSORWISE)
    assert q.shape == (0, 32) and s.item() == 1.0


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_inf_nan_behaviour(dtype):
    """Torch path (CPU): amax over finite values, inf saturates, NaN stays NaN (GPU test: Triton; not in the
    interpreter, whose fp32 -> E4M3 cast turns NaN into 384 and 500 into 256: that tests the interpreter)."""
    _assert_inf_nan(torch.device("cpu"), dtype, "torch")


def _assert_inf_nan(device, dtype, backend):
    x = torch.randn(4, 64, device=device)
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("-inf"), float("nan")
    finite_amax = torch.where(torch.isfinite(x), x.abs(), 0).amax(dim=1)
    q, s = impl.quantize_fp8_impl(x, dtype, "rowwise", -1, 0, 0, False, backend)
    torch.testing.assert_close(s.squeeze(1), finite_amax / FP8_MAX[dtype], rtol=1e-6, atol=0)
    qf = q.float()
    assert qf[0, 3] == FP8_MAX[dtype] and qf[1, 5] == -FP8_MAX[dtype] and torch.isnan(qf[2, 7])
    assert torch.isfinite(qf[3]).all() and torch.isnan(qf).sum() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_inf_nan_behaviour_triton_gpu(dtype):
    _assert_inf_nan(torch.device("cuda"), dtype, "triton")


@pytest.mark.gpu
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s[0].name}-{s[1]}-{s[2]}")
@pytest.mark.parametrize("shape", [(8192, 4096), (4097, 1000)])
def test_triton_matches_torch_gpu(spec, shape):
    g, bs, axis, _ = spec
    bs = 128 if isinstance(bs, int) else ((128, 128) if bs else None)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    gn, ax, br, bc = normalize_spec(2, g, bs, axis)
    qt, st = impl.quantize_fp8_impl(x, E4M3, gn, ax, br, bc, False, "triton")
    qr, sr = impl.quantize_fp8_impl(x, E4M3, gn, ax, br, bc, False, "torch")
    torch.testing.assert_close(st, sr, rtol=1e-6, atol=0)
    assert (qt.float() != qr.float()).float().mean() < 1e-3


def test_bad_inputs():
    x = torch.randn(8, 64)
    with pytest.raises(TypeError, match="out_dtype"):
        quantize_fp8(x, torch.bfloat16, G.TENSORWISE)
    with pytest.raises(TypeError, match="x"):
        quantize_fp8(x.to(torch.int32), E4M3, G.TENSORWISE)
    with pytest.raises(TypeError, match="granularity"):
        quantize_fp8(x, E4M3, "PER_CHANNEL")
    with pytest.raises(ValueError, match="block_size"):
        quantize_fp8(x, E4M3, G.BLOCKWISE, block_size=48)
    with pytest.raises(ValueError, match="block_size"):
        quantize_fp8(x, E4M3, G.TENSORWISE, block_size=128)
    with pytest.raises(ValueError, match="axis"):
        quantize_fp8(torch.randn(2, 8, 64), E4M3, G.ROWWISE, axis=0)
    with pytest.raises(ValueError, match="axis"):
        quantize_fp8(x, E4M3, G.TENSORWISE, axis=0)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_with_transpose(torch.randn(64), E4M3, G.ROWWISE)
    q, s = quantize_fp8(x, E4M3, G.BLOCKWISE, block_size=32)
    with pytest.raises(ValueError, match="scale_inv"):
        dequantize_fp8(q, s[:, :1], G.BLOCKWISE, block_size=32)
    with pytest.raises(TypeError, match="q"):
        dequantize_fp8(x, s, G.BLOCKWISE, block_size=32)


def _compile_quant_kernels():
    from primus_turbo.triton.quantization import quantization_kernel as qk

    common = {"FP8_MAX": 448.0, "POW2": False, "OUT_DTYPE": qk.fp8_tl_dtype(E4M3)}
    compile_for_sm90(
        qk.amax_partial_kernel,
        {"x_ptr": "*bf16", "partial_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
        {"BLOCK": 4096},
        num_warps=8,
    )
    for static in (False, True):
        sig = {k: "*fp32" for k in ("partial_ptr", "scale_ptr", "scale_inv_ptr", "amax_out_ptr")}
        sig |= {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "num_partials": "i32", "n": "i32"}
        cex = {"STATIC_SCALE": static, "PARTIALS_P2": 512, "BLOCK": 4096, **common}
        compile_for_sm90(qk.tensorwise_cast_kernel, sig | dict.fromkeys(cex, "constexpr"), cex, num_warps=8)
        sig_t = sig | {"qt_ptr": "*fp8e4nv", "R": "i32", "C": "i32"}
        sig_t.pop("n")
        cex = {"STATIC_SCALE": static, "PARTIALS_P2": 512, "BLOCK_R": 64, "BLOCK_C": 64, **common}
        compile_for_sm90(
            qk.tensorwise_cast_transpose_kernel, sig_t | dict.fromkeys(cex, "constexpr"), cex, num_warps=8
        )
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_inv_ptr": "*fp32", "R": "i32", "C": "i32"}
    for single, bc in ((False, 2048), (True, 8192)):
        cex = {"BLOCK_R": 1 if single else 2, "BLOCK_C": bc, "SINGLE_PASS": single, **common}
        compile_for_sm90(qk.rowwise_quant_kernel, sig | dict.fromkeys(cex, "constexpr"), cex, num_warps=8)
    cex = {"CHUNK_R": 256, "BLOCK_R": 32, "BLOCK_C": 128}
    sig = {"x_ptr": "*bf16", "partial_ptr": "*fp32", "R": "i32", "C": "i32"}
    compile_for_sm90(qk.col_amax_partial_kernel, sig | dict.fromkeys(cex, "constexpr"), cex)
    for transpose in (False, True):
        cex = {"TRANSPOSE": transpose, "CHUNKS_P2": 32, "BLOCK_R": 64, "BLOCK_C": 128, **common}
        sig = {
            "x_ptr": "*bf16",
            "partial_ptr": "*fp32",
            "num_chunks": "i32",
            "out_ptr": "*fp8e4nv",
            "scale_inv_ptr": "*fp32",
            "R": "i32",
            "C": "i32",
        }
        compile_for_sm90(qk.col_cast_kernel, sig | dict.fromkeys(cex, "constexpr"), cex)
    cex = {"BLOCK_R": 64, "BLOCK_C": 128}
    sig = {"x_ptr": "*bf16", "row_part_ptr": "*fp32", "col_part_ptr": "*fp32", "R": "i32", "C": "i32"}
    compile_for_sm90(qk.rowcol_amax_partial_kernel, sig | dict.fromkeys(cex, "constexpr"), cex)
    cex = {"FP8_MAX": 448.0, "POW2": False, "PARTS_P2": 32, "BLOCK": 256}
    sig = {
        "part_ptr": "*fp32",
        "scale_ptr": "*fp32",
        "scale_inv_ptr": "*fp32",
        "n": "i32",
        "num_parts": "i32",
    }
    compile_for_sm90(qk.partial_to_scale_kernel, sig | dict.fromkeys(cex, "constexpr"), cex)
    cex = {"FP8_MAX": 448.0, "OUT_DTYPE": qk.fp8_tl_dtype(E4M3), "BLOCK_R": 64, "BLOCK_C": 128}
    sig = {
        "x_ptr": "*bf16",
        "q_ptr": "*fp8e4nv",
        "qt_ptr": "*fp8e4nv",
        "row_scale_ptr": "*fp32",
        "col_scale_ptr": "*fp32",
        "R": "i32",
        "C": "i32",
    }
    compile_for_sm90(qk.rowcol_cast_kernel, sig | dict.fromkeys(cex, "constexpr"), cex, num_warps=8)
    for mode, with_t, br, bc in [
        (0, False, 32, 128),
        (1, False, 128, 64),
        (2, False, 128, 128),
        (0, True, 128, 128),
        (2, True, 128, 128),
    ]:
        cex = {"MODE": mode, "WITH_T": with_t, "BLOCK_R": br, "BLOCK_C": bc, **common}
        sig = {
            "x_ptr": "*bf16",
            "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32",
            "qt_ptr": "*fp8e4nv",
            "st_ptr": "*fp32",
            "R": "i32",
            "C": "i32",
        }
        sig |= dict.fromkeys(
            [
                "stride_xb",
                "stride_qb",
                "stride_sb",
                "stride_sr",
                "stride_sc",
                "stride_stb",
                "stride_str",
                "stride_stc",
            ],
            "i32",
        )
        compile_for_sm90(
            qk.blockwise_quant_kernel,
            sig | dict.fromkeys(cex, "constexpr"),
            cex,
            num_warps=8 if br * bc >= 8192 else 4,
        )


def test_kernels_compile_for_sm90():
    run_compile_check(__file__, "--compile-sm90")


if __name__ == "__main__":
    import sys

    if "--compile-sm90" in sys.argv:
        _compile_quant_kernels()
        print("quantization kernels compile for sm_90")
