"""FP8 grouped GEMM tiles, pointer vs TMA kernels, vs CUTLASS (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_grouped_gemm_fp8.py [--out DIR] [--quick]

The Triton FP8 grouped kernels serve what torch._scaled_grouped_mm (CUTLASS) cannot: HYBRID's E5M2
gradients (the dgrad and the FP8 wgrad), BLOCKWISE, unaligned groups in the wgrad; since the
eb7a9e8 sweep also the ROWWISE / TENSORWISE forward where the TMA kernel applies. Per MoE shape, GPU
time (``do_bench_cudagraph``, no host time) of:

* forward kernel: the pointer kernel (before/after its tile change), the TMA kernel
  (``grouped_gemm_tma_kernel``) at its default and other tiles, the dgrad's operands (E5M2 gradient x
  the K-major weight copy) on both, and BLOCKWISE on the pointer kernel;
* variable-K (wgrad) kernel over token-contiguous copies: pointer and TMA kernels, aligned and
  unaligned groups;

against CUTLASS on the same E4M3 operands (the variable-K with groups padded to multiples of 16, which
CUTLASS needs) and torch._grouped_mm bf16. Every row's output is checked against the pointer kernel's
(SNR in dB). Writes DIR/sweep_grouped_gemm_fp8.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402

from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (  # noqa: E402
    SCALE_BLOCKWISE,
    SCALE_ROWWISE,
    launch_grouped_gemm,
    launch_grouped_gemm_variable_k,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_tma_kernel import (  # noqa: E402
    launch_grouped_gemm_tma,
    launch_grouped_gemm_variable_k_tma,
)

# (name, experts, rows, N, K, dist): the bench_grouped_gemm quick set plus the fc2 layers
SHAPES = [  # most telling first (a device call may cut the sweep short)
    ("dsv3-fc1", 32, 4096 * 8, 4096, 7168, "skewed"),
    ("dsv2lite-fc1", 64, 4096 * 6, 2816, 2048, "balanced"),
    ("mixtral-fc1", 8, 4096 * 2, 28672, 4096, "balanced"),
    ("dsv3-fc2", 32, 4096 * 8, 7168, 2048, "balanced"),
    ("dsv2lite-fc2", 64, 4096 * 6, 2048, 1408, "balanced"),
]
# (BLOCK_M|P, BLOCK_N|Q, BLOCK_K, num_warps, num_stages): None is the launcher's default tile
OLD_TILE = (128, 128, 128, 8, 4)  # the pointer kernels' FP8 tile before eb7a9e8's sweep
# (+ PROGS_PER_SM, TMA_STORE: full row tiles stored through a descriptor)
FWD_TILES = [None, (128, 256, 128, 8, 3, 1, False), (128, 128, 128, 8, 4), (128, 256, 64, 8, 4, 1, True)]
# + PROGS_PER_SM: several CTAs per SM overlap one tile's epilogue with another's loads (small tiles only: a
# 128x256 fp32 accumulator over 8 warps leaves registers for one). None: the launcher's shape-dependent
# default (VK_TILE, or VK_TILE_SMALL for small per-expert outputs). EDGE_TMA (all token tiles through TMA,
# X masked in registers) was measured at 48acb0c: slower everywhere and wrong at some tiles; removed.
# + TMA_STORE: the output tile through a [G, P, Q] descriptor instead of masked pointer stores.
VK_TILES = [
    None,
    (256, 128, 128, 8, 3),
    (128, 256, 64, 8, 4, 1),
    (128, 128, 64, 4, 4, 2),
    (128, 256, 64, 8, 4, 1, True),
    (128, 128, 64, 4, 4, 2, True),
    (128, 256, 64, 8, 3, 1, True),
]


def _fwd_cfg(tile):
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "PROGS_PER_SM", "TMA_STORE")
    return None if tile is None else dict(zip(keys, tile))


def _vk_cfg(tile):
    keys = ("BLOCK_P", "BLOCK_Q", "BLOCK_K", "num_warps", "num_stages", "PROGS_PER_SM", "TMA_STORE")
    return None if tile is None else dict(zip(keys, tile))


def group_lens(rows, experts, dist, align, device):
    if dist == "balanced":
        lens = torch.full((experts,), rows // experts, dtype=torch.int64)
        lens[: rows % experts] += 1
    else:  # one expert gets 60%
        rest = torch.rand(experts - 1, generator=torch.Generator().manual_seed(0)).double() + 0.05
        lens = torch.cat(
            [torch.tensor([rows * 3 // 5]), (rest / rest.sum() * (rows * 2 // 5)).floor().long()]
        )
    if align > 1:
        lens = (lens // align) * align
    lens[0] += rows - int(lens.sum())
    return lens.to(device)


def snr(ref, out):
    err = (out.float() - ref.float()).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(ref.float().pow(2).sum() / err))


def _ms(fn):
    return tt.do_bench_cudagraph(fn, rep=60, return_mode="median")


def _try(fn, ref):
    try:
        out = fn()
        torch.cuda.synchronize()
        return _ms(fn), snr(ref, out)
    except Exception as e:  # a tile that does not compile or fit: reported, the sweep goes on
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def _row(report, label, flop, res, base_ms):
    ms, q = res
    if ms is None:
        report.write(f"| {label} | failed | | | {q} |\n")
        return
    report.write(f"| {label} | {ms * 1e3:.1f} | {flop / ms / 1e9:.0f} | {base_ms / ms:.2f}x | {q:.1f} |\n")


def sweep_shape(name, experts, rows, n, k, dist, report: io.StringIO) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    lens = group_lens(rows, experts, dist, 16, dev)  # multiples of 16: CUTLASS's wgrad needs them
    offs = torch.cumsum(lens, 0).to(torch.int32)
    a16 = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w16 = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.05
    g16 = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    a8, w8 = a16.to(e4), (w16 * 20).to(e4)
    sa = torch.rand(rows, device=dev) + 0.5
    sw = torch.rand(experts, n, device=dev) * 0.05 + 0.025
    flop = 2.0 * rows * n * k
    report.write(f"\n## {name}: {experts} experts, {rows} rows ({dist}), N={n}, K={k}\n\n")
    report.write(
        "| forward kernel | us | TFLOP/s | vs CUTLASS | SNR vs pointer (dB) |\n|---|---|---|---|---|\n"
    )
    bf16_ms = _ms(lambda: torch._grouped_mm(a16, w16.transpose(1, 2), offs=offs))
    cut = lambda: torch._scaled_grouped_mm(  # noqa: E731
        a8, w8.transpose(1, 2), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    cut_ms = _ms(cut)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)
    wv = w8.transpose(1, 2)
    ptr = lambda tile=None: (
        lambda: launch_grouped_gemm(  # noqa: E731
            a8, wv, out, lens, sa, sw, SCALE_ROWWISE, config=_fwd_cfg(tile)
        )
    )
    tma = lambda tile=None: (
        lambda: launch_grouped_gemm_tma(  # noqa: E731
            a8, wv, out, lens, sa, sw, SCALE_ROWWISE, config=_fwd_cfg(tile)
        )
    )
    ref = ptr()().clone()
    _row(report, "torch._grouped_mm bf16", flop, (bf16_ms, float("nan")), cut_ms)
    _row(report, "CUTLASS _scaled_grouped_mm E4M3", flop, (cut_ms, snr(ref, cut())), cut_ms)
    _row(report, f"Triton ptr {OLD_TILE} (before)", flop, _try(ptr(OLD_TILE), ref), cut_ms)
    _row(report, "Triton ptr default", flop, _try(ptr(), ref), cut_ms)
    for tile in FWD_TILES:
        _row(report, f"Triton TMA {tile or 'default'}", flop, _try(tma(tile), ref), cut_ms)
    # the dgrad's operands: E5M2 gradient x the K-major [K, G*N] weight copy (groups shifted by columns)
    g8 = g16.to(e5)
    q_t = w8.reshape(experts * n, k).t().contiguous()  # [K, G*N]
    dview = q_t.view(k, experts, n).permute(1, 2, 0)  # [G, N(reduce), K(out)]
    sg, sdw = torch.rand(rows, device=dev) + 0.5, torch.rand(experts, k, device=dev) * 0.05 + 0.025
    dout = torch.empty(rows, k, dtype=torch.bfloat16, device=dev)
    dref = launch_grouped_gemm(g8, dview, dout, lens, sg, sdw, SCALE_ROWWISE).clone()
    dgrad_runs = (
        ("ptr default", launch_grouped_gemm, None),
        ("TMA default", launch_grouped_gemm_tma, None),
        ("TMA pointer stores", launch_grouped_gemm_tma, {"TMA_STORE": False}),
    )
    for label, fn, cfg in dgrad_runs:
        run = lambda fn=fn, cfg=cfg: fn(g8, dview, dout, lens, sg, sdw, SCALE_ROWWISE, config=cfg)  # noqa: E731
        _row(report, f"dgrad (E5M2 x K-major copy) Triton {label}", flop, _try(run, dref), cut_ms)
    # BLOCKWISE forward (1x128 activation, 128x128 weight scales): the >= 1000 TFLOP/s target of #5 (the TMA
    # kernel with per-K-step scales measured 0.33-0.82x of the pointer kernel at adb78e3 and was dropped)
    sab = torch.rand(rows, -(-k // 128), device=dev) + 0.5
    swb = torch.rand(experts, -(-k // 128), -(-n // 128), device=dev) * 0.05 + 0.025
    bref = launch_grouped_gemm(a8, wv, out, lens, sab, swb, SCALE_BLOCKWISE).clone()
    blockwise_tiles = (  # BLOCK_N == BLOCK_K == 128: one weight scale per tile and K step
        ("ptr 128x128x128 (shipped)", launch_grouped_gemm, None),
        ("ptr 128x128x128/8/3", launch_grouped_gemm, (128, 128, 128, 8, 3)),
        ("ptr 64x128x128/4/5", launch_grouped_gemm, (64, 128, 128, 4, 5)),
        ("ptr 64x128x128/4/3", launch_grouped_gemm, (64, 128, 128, 4, 3)),
    )
    for label, fn, tile in blockwise_tiles:
        run = lambda fn=fn, tile=tile: fn(a8, wv, out, lens, sab, swb, SCALE_BLOCKWISE, config=_fwd_cfg(tile))  # noqa: E731
        _row(report, f"BLOCKWISE Triton {label}", flop, _try(run, bref), cut_ms)

    # wgrad of this layer: dW[g] [N, K] = dC_g^T @ A_g over token-contiguous copies
    report.write(
        "\n| variable-K (wgrad) | us | TFLOP/s | vs CUTLASS | SNR vs pointer (dB) |\n|---|---|---|---|---|\n"
    )
    x_t, y_t = g16.t().contiguous().to(e4), a16.t().contiguous().to(e4)  # [N, M], [K, M]
    sx, sy = torch.rand(n, device=dev) + 0.5, torch.rand(k, device=dev) + 0.5
    vk_out = torch.empty(experts, n, k, dtype=torch.bfloat16, device=dev)

    def vk(launch, tile=None, group_lens=lens):
        return lambda: launch(
            x_t.t(), y_t.t(), vk_out, group_lens, sx, sy, SCALE_ROWWISE, config=_vk_cfg(tile)
        )

    vref = vk(launch_grouped_gemm_variable_k)().clone()
    bf16_wg = _ms(lambda: torch._grouped_mm(g16.t(), a16, offs=offs))
    sa_g = sx.reshape(1, n).expand(experts, n).reshape(-1).contiguous()
    sb_g = sy.reshape(1, k).expand(experts, k).reshape(-1).contiguous()
    vcut = lambda: torch._scaled_grouped_mm(  # noqa: E731
        x_t, y_t.t(), sa_g, sb_g, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    vcut_ms = _ms(vcut)
    _row(report, "torch._grouped_mm bf16", flop, (bf16_wg, float("nan")), vcut_ms)
    _row(report, "CUTLASS _scaled_grouped_mm E4M3", flop, (vcut_ms, snr(vref, vcut())), vcut_ms)
    _row(
        report,
        f"Triton ptr {OLD_TILE} (before)",
        flop,
        _try(vk(launch_grouped_gemm_variable_k, OLD_TILE), vref),
        vcut_ms,
    )
    _row(report, "Triton ptr default", flop, _try(vk(launch_grouped_gemm_variable_k), vref), vcut_ms)
    for tile in VK_TILES:  # the pointer kernel has no PROGS_PER_SM: TMA rows only
        run = vk(launch_grouped_gemm_variable_k_tma, tile)
        _row(report, f"Triton TMA {tile or 'default'}", flop, _try(run, vref), vcut_ms)
    # unaligned groups (what only the Triton wgrad serves)
    ulens = group_lens(rows, experts, dist, 1, dev)
    uref = vk(launch_grouped_gemm_variable_k, None, ulens)().clone()
    unaligned = [
        ("ptr", launch_grouped_gemm_variable_k, None),
        ("TMA", launch_grouped_gemm_variable_k_tma, None),
    ]
    unaligned += [("TMA", launch_grouped_gemm_variable_k_tma, t) for t in VK_TILES[4:6]]
    for label, launch, tile in unaligned:
        run = vk(launch, tile, ulens)
        _row(report, f"unaligned groups: Triton {label} {tile or 'default'}", flop, _try(run, uref), vcut_ms)


if __name__ == "__main__":
    run_sweep(__doc__, "sweep_grouped_gemm_fp8", "FP8 grouped GEMM sweep", SHAPES, sweep_shape)
