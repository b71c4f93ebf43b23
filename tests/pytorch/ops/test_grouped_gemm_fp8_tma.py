"""The TMA FP8 grouped GEMM kernels (forward / dgrad layouts, variable-K) against the fp64 product of
the same quantized operands and against the pointer kernels. CPU: the Triton interpreter; GPU: sm_90."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_snr

from primus_turbo.pytorch.core.backend import BackendType, GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
    GroupedGemmFP8Dispatcher,
    dequantize_operands,
)
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8
from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
    SCALE_BLOCKWISE,
    SCALE_NONE,
    SCALE_ROWWISE,
    SCALE_TENSORWISE,
    launch_grouped_gemm,
    launch_grouped_gemm_variable_k,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_tma_kernel import (
    VK_TILE,
    VK_TILE_SMALL,
    _b_layout,
    launch_grouped_gemm_tma,
    launch_grouped_gemm_variable_k_tma,
    tma_forward_supported,
    tma_variable_k_supported,
)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
MODES = {"tensorwise": SCALE_TENSORWISE, "rowwise": SCALE_ROWWISE}
SNR_DB = 40.0  # same quantized operands: only accumulation order and the bf16 output rounding differ


@pytest.fixture
def dev(device):
    if device.type == "cuda" and not torch.cuda.get_device_capability(device) >= (9, 0):
        pytest.skip("TMA needs sm_90")
    return device


def _scales(mode, m, k, g, n, dev):
    if mode == SCALE_TENSORWISE:
        return torch.rand(1, device=dev) + 0.5, torch.rand(g, device=dev) + 0.5
    if mode == SCALE_ROWWISE:
        return torch.rand(m, device=dev) + 0.5, torch.rand(g, n, device=dev) + 0.5
    kb, nb = -(-k // 128), -(-n // 128)
    return torch.rand(m, kb, device=dev) + 0.5, torch.rand(g, kb, nb, device=dev) + 0.5


def _ref(a, b_view, sa, sb, lens, mode, m_total):
    af, bf = dequantize_operands(a, b_view, sa, sb, mode)
    out = torch.zeros(m_total, b_view.shape[2], dtype=torch.float64)
    start = 0
    for g, n in enumerate(lens.tolist()):
        out[start : start + n] = af[start : start + n].double().cpu() @ bf[g].double().cpu()
        start += n
    return out


def _check_forward(a, b_view, lens, mode, tag, config=None):
    m, k = a.shape
    g, _, n = b_view.shape
    sa, sb = _scales(mode, m, k, g, n, a.device)
    assert tma_forward_supported(a, b_view, mode, interpret=True), tag
    out = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=a.device)  # every row must be written
    launch_grouped_gemm_tma(a, b_view, out, lens, sa, sb, mode, config=config)
    ref = _ref(a, b_view, sa, sb, lens, mode, m)
    covered = int(lens.sum())
    assert_snr(out[:covered].double().cpu(), ref[:covered], SNR_DB, tag)
    assert torch.count_nonzero(out[covered:]) == 0, f"{tag}: rows past sum(group_lens) are not zeros"
    ptr = launch_grouped_gemm(a, b_view, torch.empty_like(out), lens, sa, sb, mode)
    assert_snr(out.double().cpu(), ptr.double().cpu(), SNR_DB, f"{tag} vs the pointer kernel")


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
@pytest.mark.parametrize("a_dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_tma_forward_layout(mode, a_dtype, dev):
    """b_view = the [G, N, K] weight copy transposed (groups shifted by rows); K with a partial tail
    step, an empty expert, a partial last row tile and rows past sum(group_lens)."""
    torch.manual_seed(0)
    big = dev.type == "cuda"
    g, n, k = (6, 384, 1280) if big else (3, 80, 176)
    lens = torch.tensor([700, 0, 33, 1500, 0, 260] if big else [5, 0, 30], device=dev)
    m = int(lens.sum()) + 9
    a = torch.randn(m, k, device=dev).to(a_dtype)
    w = torch.randn(g, n, k, device=dev).to(E4)
    _check_forward(a, w.transpose(1, 2), lens, mode, f"forward {mode} {a_dtype}")


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
def test_tma_forward_tma_store(mode, dev):
    """TMA_STORE: full row tiles inside a group leave through the descriptor, each group's last partial
    tile and the zero rows past sum(group_lens) through masked pointer stores; N with a partial column
    tile (the descriptor clips it)."""
    torch.manual_seed(5)
    big = dev.type == "cuda"
    g, n, k = (4, 640, 512) if big else (3, 80, 64)
    lens = torch.tensor([1000, 0, 256, 77] if big else [5, 0, 70], device=dev)
    m = int(lens.sum()) + 40
    a = torch.randn(m, k, device=dev).to(E4)
    w = torch.randn(g, n, k, device=dev).to(E4)
    _check_forward(a, w.transpose(1, 2), lens, mode, f"forward TMA_STORE {mode}", {"TMA_STORE": True})
    with pytest.raises(ValueError, match="TMA_STORE"):  # 36 bf16 columns: 72-byte rows
        out = torch.empty(m, 36, dtype=torch.bfloat16, device=dev)
        sa, sb = _scales(mode, m, k, g, 36, dev)
        launch_grouped_gemm_tma(a, w[:, :36].transpose(1, 2), out, lens, sa, sb, mode, {"TMA_STORE": True})


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
def test_tma_dgrad_layout(mode, dev):
    """b_view [G, N(reduce), K(out)] over the K-major [K, G*N] copy: groups shifted by columns."""
    torch.manual_seed(1)
    big = dev.type == "cuda"
    g, n_red, k_out = (4, 512, 640) if big else (3, 128, 96)
    lens = torch.tensor([300, 0, 1000, 45] if big else [7, 0, 26], device=dev)
    m = int(lens.sum())
    q_t = torch.randn(k_out, g * n_red, device=dev).to(E4)
    b_view = q_t.view(k_out, g, n_red).permute(1, 2, 0)
    grad = torch.randn(m, n_red, device=dev).to(E5)
    assert _b_layout(b_view, 128)[4] == n_red, "expected the column-shifted layout"
    _check_forward(grad, b_view, lens, mode, f"dgrad {mode}")


@pytest.mark.parametrize(
    "tile",
    [VK_TILE, VK_TILE_SMALL, {**VK_TILE, "TMA_STORE": True}],
    ids=["vk_tile", "vk_tile_small", "vk_tile_tma_store"],
)
@pytest.mark.parametrize("mode", [SCALE_TENSORWISE, SCALE_ROWWISE], ids=["tensorwise", "rowwise"])
def test_tma_variable_k(mode, tile, dev):
    """Groups that start and end inside token tiles, one inside a single tile, an empty one, one
    with only full tiles; tokens past sum(group_lens) never counted."""
    torch.manual_seed(2)
    big = dev.type == "cuda"
    p, q = (384, 640) if big else (40, 72)
    lens = torch.tensor([5, 0, 21, 3, 35, 64] if not big else [70, 0, 1000, 3, 333, 640], device=dev)
    m = -(-(int(lens.sum()) + 5) // 16) * 16
    x = torch.randn(p, m, device=dev).to(E5).t()
    y = torch.randn(q, m, device=dev).to(E4).t()
    g = lens.shape[0]
    if mode == SCALE_TENSORWISE:
        sx, sy = torch.rand(g, device=dev) + 0.5, torch.rand(g, device=dev) + 0.5
    else:
        sx, sy = torch.rand(p, device=dev) + 0.5, torch.rand(q, device=dev) + 0.5
    assert tma_variable_k_supported(x, y, interpret=True)
    out = torch.full((g, p, q), 7.0, dtype=torch.bfloat16, device=dev)
    # on GPU: the tile pinned (VK_TILE_SMALL: two CTAs per SM); the CPU launcher shrinks every tile
    launch_grouped_gemm_variable_k_tma(x, y, out, lens, sx, sy, mode, config=tile)
    xf, yf = x.double().cpu(), y.double().cpu()
    start = 0
    for i, n in enumerate(lens.tolist()):
        ref = xf[start : start + n].t() @ yf[start : start + n]
        ref = ref * (sx[i] * sy[i]).double().cpu() if mode == SCALE_TENSORWISE else ref
        if mode == SCALE_ROWWISE:
            ref = ref * sx.double().cpu()[:, None] * sy.double().cpu()[None, :]
        start += n
        if n == 0:
            assert torch.count_nonzero(out[i]) == 0, f"empty group {i} is not exactly zero"
        else:
            assert_snr(out[i].double().cpu(), ref, SNR_DB, f"variable-K group {i} ({n} tokens) mode {mode}")
    ptr = launch_grouped_gemm_variable_k(x, y, torch.empty_like(out), lens, sx, sy, mode)
    assert_snr(out.double().cpu(), ptr.double().cpu(), SNR_DB, "variable-K vs the pointer kernel")


def test_tma_variable_k_unaligned_output_rows(dev):
    """Q = 36 bf16 columns: output rows of 72 bytes, which a TMA store cannot address. The default tiles
    fall back to masked pointer stores (same result as the pointer kernel); TMA_STORE asked for
    explicitly is an error naming it."""
    torch.manual_seed(4)
    lens = torch.tensor([20, 0, 44], device=dev)
    x = torch.randn(40, 64, device=dev).to(E4).t()
    y = torch.randn(36, 64, device=dev).to(E4).t()
    sx, sy = torch.rand(3, device=dev) + 0.5, torch.rand(3, device=dev) + 0.5
    out = torch.full((3, 40, 36), 7.0, dtype=torch.bfloat16, device=dev)
    launch_grouped_gemm_variable_k_tma(x, y, out, lens, sx, sy, SCALE_TENSORWISE)
    ptr = launch_grouped_gemm_variable_k(x, y, torch.empty_like(out), lens, sx, sy, SCALE_TENSORWISE)
    assert torch.count_nonzero(out[1]) == 0
    assert_snr(out.double().cpu(), ptr.double().cpu(), SNR_DB, "unaligned rows vs the pointer kernel")
    with pytest.raises(ValueError, match="TMA_STORE"):
        launch_grouped_gemm_variable_k_tma(x, y, out, lens, sx, sy, SCALE_TENSORWISE, {"TMA_STORE": True})


def test_tma_eligibility_refusals(device):
    """What the TMA kernels do not take goes to the pointer kernel, never to a wrong TMA read."""
    a = torch.randn(64, 128, device=device).to(E4)
    w = torch.randn(2, 96, 128, device=device).to(E4)
    assert not tma_forward_supported(a, w.transpose(1, 2), SCALE_NONE, interpret=True)
    assert not tma_forward_supported(a, w.transpose(1, 2), SCALE_BLOCKWISE, interpret=True)  # pointer: faster
    with pytest.raises(ValueError, match="does not take"):
        launch_grouped_gemm_tma(a, w.transpose(1, 2), torch.empty(64, 96), torch.tensor([64]), None, None, 3)
    assert not tma_forward_supported(a.to(torch.bfloat16), w.transpose(1, 2), SCALE_ROWWISE, interpret=True)
    assert not tma_forward_supported(a[:, :120], w[..., :120].transpose(1, 2), SCALE_ROWWISE, interpret=True)
    assert _b_layout(w.transpose(1, 2).contiguous(), 128) is None  # N contiguous: not K-major
    q_t = torch.randn(96, 2 * 80, device=device).to(E4)  # dgrad copy with N = 80: a K step would cross
    assert _b_layout(q_t.view(96, 2, 80).permute(1, 2, 0), 64) is None
    assert _b_layout(q_t.view(96, 2, 80).permute(1, 2, 0)[:1], 64) is not None  # one expert: no neighbour
    x = torch.randn(24, 100, device=device).to(E4).t()  # M % 16 != 0
    assert not tma_variable_k_supported(x, x, interpret=True)
    assert not tma_variable_k_supported(torch.randn(96, 24, device=device).to(E4), x, interpret=True)


@pytest.mark.gpu
def test_default_forward_backend_is_tma_triton(device):
    """ROWWISE E4M3 through the op: the dispatcher's default is the TMA Triton kernel (measured faster
    than CUTLASS at four of five MoE shapes), still within the E4M3 gate of the fp64 reference."""
    if not torch.cuda.get_device_capability() >= (9, 0):
        pytest.skip("TMA needs sm_90")
    GlobalBackendManager.reset()
    torch.manual_seed(3)
    lens = torch.tensor([512, 0, 1536, 128], device=device)
    a = torch.randn(2176, 1024, dtype=torch.bfloat16, device=device)
    b = torch.randn(4, 768, 1024, dtype=torch.bfloat16, device=device) / 32
    out = grouped_gemm_fp8(a, b, lens, config=Float8QuantConfig(granularity=ScalingGranularity.ROWWISE))
    assert GroupedGemmFP8Dispatcher.last_backend is BackendType.TRITON
    ref = torch.cat([a[s : s + n].double() @ b[g].double().t() for g, (s, n) in enumerate(
        zip(torch.cumsum(lens, 0).sub(lens).tolist(), lens.tolist()))])  # fmt: skip
    assert_snr(out.double(), ref, 25.0, "default ROWWISE E4M3 forward")
