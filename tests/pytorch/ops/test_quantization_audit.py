"""FP8 quantization edge cases: non-finite and all-zero groups on every kernel path, scale layouts
against the torch.compile fake kernel, ranks the API rejects, and autograd detachment."""

from __future__ import annotations

import pytest
import torch
from ref.quantization_ref import FP8_MAX, ref_quantize_groups

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

# (granularity, block_size, axis, reference group (gr, gc) of a 2-D input; 0 = whole dim)
SPECS = [
    (G.TENSORWISE, None, None, (0, 0)),
    (G.ROWWISE, None, -1, (1, 0)),
    (G.ROWWISE, None, 0, (0, 1)),
    (G.BLOCKWISE, 16, -1, (1, 16)),
    (G.BLOCKWISE, 16, 0, (16, 1)),
    (G.BLOCKWISE, (16, 32), None, (16, 32)),
]


def _spec_id(spec) -> str:
    return f"{spec[0].name}-{spec[1]}-{spec[2]}"


def _with_special_values(rows: int, cols: int, device) -> torch.Tensor:
    """Random rows, plus: lone +inf/-inf/NaN, a row of only inf, a huge finite value, a zero row and
    a zero 16 x 32 tile (rows 16-31, cols 32-63: one whole group of every spec but TENSORWISE)."""
    x = torch.randn(rows, cols, device=device) * 3
    x[0, 3], x[1, 5], x[2, 7] = float("inf"), float("-inf"), float("nan")
    x[4] = float("inf")
    x[5, 9] = 1e30
    x[6] = 0.0
    x[16:32, 32:64] = 0.0
    return x


def _assert_matches_ref(x, q, s, dtype, group, check_nan: bool):
    ref_q, ref_s = ref_quantize_groups(x.cpu().float(), *group, dtype)
    q, s = q.cpu().double(), s.cpu().double()
    ref_s = ref_s.float().double()  # the reference's 1 / scale is fp64; the ops return it in fp32
    torch.testing.assert_close(s.reshape(ref_s.shape), ref_s, rtol=0, atol=0)
    nan = torch.isnan(ref_q)
    assert torch.equal(q[~nan], ref_q[~nan]), "finite/inf elements differ from the fp64 reference"
    if check_nan:  # the CPU interpreter's fp32 -> fp8 conversion does not produce NaN (GPU and torch do)
        assert torch.isnan(q[nan]).all(), "NaN must stay NaN"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_non_finite_and_zero_groups(backend, dtype, spec, device):
    """The documented inf/NaN rules hold on every kernel path: the amax skips non-finite values,
    +-inf saturate to +-fp8_max, NaN stays NaN; an all-zero group gets scale_inv 1 and exact zeros."""
    g, bs, axis, group = spec
    x = _with_special_values(40, 70, device)
    gn, ax, br, bc = normalize_spec(2, g, bs, axis)
    q, s = impl.quantize_fp8_impl(x, dtype, gn, ax, br, bc, False, backend)
    assert torch.isfinite(s).all() and (s > 0).all()
    _assert_matches_ref(x, q, s, dtype, group, check_nan=backend == "torch" or x.is_cuda)
    qf = q.float()
    assert qf[0, 3] == FP8_MAX[dtype] and qf[1, 5] == -FP8_MAX[dtype]
    deq = dequantize_fp8(q, s, g, block_size=bs, axis=axis, out_dtype=torch.float32)
    zeros = torch.zeros_like(deq[16:32, 32:64])
    assert torch.equal(deq[16:32, 32:64], zeros) and torch.equal(deq[6], torch.zeros_like(deq[6]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [s for s in SPECS if s[2] != 0], ids=_spec_id)  # no axis with transpose
def test_non_finite_with_transpose(backend, spec, device):
    """The fused transposed copy follows the same rules (its kernels reduce amaxes differently)."""
    g, bs, _, group = spec
    x = _with_special_values(40, 70, device)
    gn, _, br, bc = normalize_spec(2, g, bs, None)
    q, s, qt, st = impl.quantize_fp8_with_transpose_impl(x, E4M3, gn, br, bc, False, backend)
    check_nan = backend == "torch" or x.is_cuda
    _assert_matches_ref(x, q, s, E4M3, group, check_nan)
    tile_t = group[::-1] if isinstance(bs, tuple) else (1, bs)  # x.T's groups: 1 x bs again, or (bc, br)
    group_t = {G.TENSORWISE: (0, 0), G.ROWWISE: (1, 0)}.get(g, tile_t)
    _assert_matches_ref(x.t(), qt, st, E4M3, group_t, check_nan)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(24, 40), (2, 12, 40), (40,)], ids=["2d", "3d", "1d"])
@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_scale_layout_matches_fake_kernel(backend, shape, spec, device):
    """Under torch.compile the custom op's outputs must have the fake kernel's sizes AND strides
    (Inductor asserts them). The Triton 1 x bs path returned column-major scales for 3-D inputs
    too, where the fake (and the torch backend) are contiguous: `AssertionError: expected ... stride`
    under torch.compile, and `scale_inv.view(-1)` failed on GPU only."""
    g, bs, axis, _ = spec
    x = torch.randn(shape, device=device)
    try:
        gn, ax, br, bc = normalize_spec(x.dim(), g, bs, axis)
    except ValueError:
        pytest.skip("spec not defined for this rank")
    q, s = impl.quantize_fp8_impl(x, E4M3, gn, ax, br, bc, False, backend)
    fq, fs = impl._quantize_fp8_fake(x, E4M3, gn, ax, br, bc, False)
    assert (q.shape, q.stride()) == (fq.shape, fq.stride())
    assert (s.shape, s.stride()) == (fs.shape, fs.stride())


@pytest.mark.parametrize("granularity", [G.ROWWISE, G.BLOCKWISE])
def test_zero_dim_input_needs_tensorwise(granularity):
    """A 0-D tensor has no axis: ROWWISE/BLOCKWISE used to return a made-up (1,) scale_inv, and
    dequantize_fp8 then returned shape (1,) (ROWWISE) or raised IndexError (BLOCKWISE)."""
    x = torch.tensor(3.0)
    with pytest.raises(ValueError, match="x: .*at least 1 dim"):
        quantize_fp8(x, E4M3, granularity)
    with pytest.raises(ValueError, match="x: .*at least 1 dim"):
        dequantize_fp8(x.to(E4M3), torch.ones(1), granularity)
    q, s = quantize_fp8(x, E4M3, G.TENSORWISE)
    assert q.shape == () and dequantize_fp8(q, s, G.TENSORWISE, out_dtype=torch.float32).item() == 3.0


def test_outputs_never_require_grad():
    """The ops are not differentiable. The torch backend (CPU) used to return q and scale_inv attached
    to x's graph (requires_grad=True, gradients through the fp8 cast), Triton/CUDA detached ones."""
    x = torch.randn(8, 64, requires_grad=True)
    for g, bs in [(G.TENSORWISE, None), (G.ROWWISE, None), (G.BLOCKWISE, 32), (G.BLOCKWISE, (32, 32))]:
        outs = [
            *quantize_fp8(x, E4M3, g, block_size=bs),
            *quantize_fp8_with_transpose(x, E4M3, g, block_size=bs),
        ]
        assert not any(t.requires_grad for t in outs), g


@pytest.mark.parametrize("value", ["no", 2, None])
def test_power_of_two_scales_must_be_a_bool(value):
    x = torch.randn(4, 32)
    with pytest.raises(TypeError, match="power_of_two_scales"):
        quantize_fp8(x, torch.float8_e4m3fn, "rowwise", power_of_two_scales=value)
    with pytest.raises(TypeError, match="power_of_two_scales"):
        quantize_fp8_with_transpose(x, torch.float8_e4m3fn, "rowwise", power_of_two_scales=value)


@pytest.mark.gpu
@pytest.mark.parametrize("tiny", [1e-37, 1e-40])
def test_tiny_groups_keep_a_positive_scale_on_the_gpu(tiny):
    """Rows whose amax is so small that 1 / scale is an fp32 denormal: Triton's math flushes denormals to
    zero, which would give scale_inv 0 (and inf where a caller inverts it). The Triton path must agree with
    the torch path there (audit, session 35: suspected from Triton's compiler options; the sm_90 PTX of the
    rowwise kernel has div.rn.f32 and no .ftz instruction, so it should; not yet run on a GPU)."""
    x = torch.randn(8, 256, device="cuda")
    x[2] *= tiny
    x[5] *= tiny
    gn, ax, br, bc = normalize_spec(2, G.ROWWISE, None, None)
    _, s_triton = impl.quantize_fp8_impl(x, E4M3, gn, ax, br, bc, False, "triton")
    _, s_torch = impl.quantize_fp8_impl(x, E4M3, gn, ax, br, bc, False, "torch")
    assert (s_triton > 0).all(), f"scale_inv of tiny rows: {s_triton.flatten()[[2, 5]].tolist()}"
    torch.testing.assert_close(s_triton, s_torch, rtol=1e-6, atol=0)
