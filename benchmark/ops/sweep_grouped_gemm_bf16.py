"""bf16 grouped GEMM tiles, pointer vs TMA kernels, vs CUTLASS (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_grouped_gemm_bf16.py [--out DIR] [--quick]

The bf16 grouped op's automatic choice is CUTLASS (torch._grouped_mm): the Triton pointer kernels ran
0.73-0.84x of it (bench_grouped_gemm, session 24). This sweep measures the same Triton kernels with their
operand tiles through TMA descriptors (``grouped_gemm_tma_kernel`` with an N-contiguous B for the dgrad,
``grouped_gemm_variable_k_tma_kernel`` over row-major X / Y), per MoE shape, in GPU time
(``do_bench_cudagraph``, no host time): forward, dgrad, wgrad (bf16 out) and the wgrad added into an fp32
gradient buffer (what Megatron's main_grad path runs), each against CUTLASS on the same operands. Every
row's output is checked against CUTLASS's (SNR in dB). Writes DIR/sweep_grouped_gemm_bf16.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402
from sweep_grouped_gemm_fp8 import SHAPES, _fwd_cfg, _ms, _row, _try, _vk_cfg, group_lens, snr  # noqa: E402

from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (  # noqa: E402
    launch_grouped_gemm,
    launch_grouped_gemm_variable_k,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_tma_kernel import (  # noqa: E402
    launch_grouped_gemm_tma,
    launch_grouped_gemm_variable_k_tma,
)

# (BLOCK_M|P, BLOCK_N|Q, BLOCK_K, num_warps, num_stages, PROGS_PER_SM, TMA_STORE); None: the default tile
FWD_TILES = [
    None,
    (128, 256, 64, 8, 3, 1, False),
    (128, 256, 64, 8, 4, 1, False),
    (256, 128, 64, 8, 3, 1, True),
    (128, 128, 64, 4, 4, 1, True),
    (128, 128, 64, 8, 4, 1, True),
    (128, 128, 64, 4, 3, 2, False),
]
VK_TILES = [
    None,
    (128, 256, 64, 8, 3, 1, False),
    (128, 256, 64, 8, 4, 1, False),
    (256, 128, 64, 8, 3, 1, True),
    (128, 128, 64, 4, 4, 1, True),
    (128, 128, 64, 4, 3, 2, False),
    (128, 256, 32, 8, 5, 1, True),
]


def sweep_shape(name, experts, rows, n, k, dist, report: io.StringIO) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lens = group_lens(rows, experts, dist, 1, dev)
    offs = torch.cumsum(lens, 0).to(torch.int32)
    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * rows * n * k
    report.write(f"\n## {name}: {experts} experts, {rows} rows ({dist}), N={n}, K={k}\n")
    head = "| {} | us | TFLOP/s | vs CUTLASS | SNR vs CUTLASS (dB) |\n|---|---|---|---|---|\n"

    def gemm_rows(title, x, b_view, out_cols, cut):
        report.write("\n" + head.format(title))
        out = torch.empty(rows, out_cols, dtype=torch.bfloat16, device=dev)
        ref = cut().clone()
        cut_ms = _ms(cut)
        _row(report, "CUTLASS torch._grouped_mm", flop, (cut_ms, float("inf")), cut_ms)
        run = lambda: launch_grouped_gemm(x, b_view, out, lens)  # noqa: E731
        _row(report, "Triton ptr default", flop, _try(run, ref), cut_ms)
        for tile in FWD_TILES:
            run = lambda tile=tile: launch_grouped_gemm_tma(x, b_view, out, lens, config=_fwd_cfg(tile))  # noqa: E731
            _row(report, f"Triton TMA {tile or 'default'}", flop, _try(run, ref), cut_ms)

    # forward: B = the [G, N, K] weight viewed [G, K, N] (K contiguous); dgrad: B = the weight itself as
    # [G, N(reduce), K(out)] (N-major: the N-contiguous TMA box)
    gemm_rows("forward", a, w.transpose(1, 2), n, lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs))
    gemm_rows("dgrad", dy, w, k, lambda: torch._grouped_mm(dy, w, offs=offs))

    # wgrad dW[g] [N, K] = dY_g^T @ A_g, row-major operands
    report.write("\n" + head.format("wgrad (bf16 out)"))
    vk_out = torch.empty(experts, n, k, dtype=torch.bfloat16, device=dev)
    cut = lambda: torch._grouped_mm(dy.t(), a, offs=offs)  # noqa: E731
    vref = cut().clone()
    cut_ms = _ms(cut)
    _row(report, "CUTLASS torch._grouped_mm", flop, (cut_ms, float("inf")), cut_ms)
    run = lambda: launch_grouped_gemm_variable_k(dy, a, vk_out, lens)  # noqa: E731
    _row(report, "Triton ptr default", flop, _try(run, vref), cut_ms)
    for tile in VK_TILES:
        run = lambda tile=tile: launch_grouped_gemm_variable_k_tma(dy, a, vk_out, lens, config=_vk_cfg(tile))  # noqa: E731
        _row(report, f"Triton TMA {tile or 'default'}", flop, _try(run, vref), cut_ms)

    # wgrad added into an fp32 buffer (Megatron main_grad): CUTLASS + an add pass vs the kernels with the
    # buffer as the accumulator's start (accumulate=2). The buffer grows each run: SNR against one run's sum.
    report.write("\n" + head.format("wgrad += into fp32"))
    acc = torch.randn(experts, n, k, device=dev)
    base = acc.clone()
    fref = (base + vref.float()).clone()

    def cut_add():
        acc.add_(torch._grouped_mm(dy.t(), a, offs=offs))
        return acc

    def once(fn):  # one run from the same start, for the SNR
        acc.copy_(base)
        return fn()

    def timed(fn):
        try:
            q = snr(fref, once(fn))
            return _ms(fn), q
        except Exception as e:
            return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"

    cut_ms = timed(cut_add)
    _row(report, "CUTLASS + add_", flop, cut_ms, cut_ms[0])
    ptr = lambda: launch_grouped_gemm_variable_k(dy, a, acc, lens, accumulate=2, config={"num_stages": 4})  # noqa: E731
    _row(report, "Triton ptr accumulate=2 (shipped)", flop, timed(ptr), cut_ms[0])
    for tile in VK_TILES:
        run = lambda tile=tile: launch_grouped_gemm_variable_k_tma(  # noqa: E731
            dy, a, acc, lens, config=_vk_cfg(tile), accumulate=2
        )
        _row(report, f"Triton TMA {tile or 'default'}", flop, timed(run), cut_ms[0])


if __name__ == "__main__":
    run_sweep(__doc__, "sweep_grouped_gemm_bf16", "bf16 grouped GEMM sweep", SHAPES, sweep_shape)
