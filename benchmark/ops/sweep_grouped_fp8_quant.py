"""The FP8 grouped GEMM's per-call quantization, pass by pass (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_grouped_fp8_quant.py [--out DIR]

``grouped_gemm_fp8``'s forward quantizes the activation (the forward copy, plus the wgrad's
token-contiguous copy unless ``high_precision_wgrad``) and the expert weight (the forward copy and the
dgrad's K-major copy in one fused pass); the backward quantizes grad_out the same way. The op-level
bench only shows these by difference (op time - GEMM time). Here each pass is timed alone, GPU time
with the L2 flushed (``do_bench``), against a device copy of the same bytes read + written, per MoE
shape of ``bench_grouped_gemm --quick``, and each fused pass split into its kernels (torch.profiler,
mean GPU time per call over 10 calls). Writes DIR/sweep_grouped_fp8_quant.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import copy_bandwidth, run_sweep  # noqa: E402

from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import SCALE_ROWWISE  # noqa: E402
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import (  # noqa: E402
    _quant_act,
    _quant_act_and_wgrad,
    _quant_weight_with_dgrad_copy,
)

# (name, experts, rows, N, K): rows x K activations, [experts, N, K] weights
SHAPES = [
    ("dsv3-fc1", 32, 4096 * 8, 4096, 7168),
    ("dsv2lite-fc1", 64, 4096 * 6, 2816, 2048),
    ("mixtral-fc1", 8, 4096 * 2, 28672, 4096),
]
E4M3 = torch.float8_e4m3fn


def _ms(fn) -> float:
    return tt.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _kernels(fn, calls: int = 10) -> list[tuple[str, float]]:
    """(kernel name, mean us per call) of fn's GPU kernels, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / calls) for e in prof.key_averages()]
    return sorted([r for r in rows if r[1] > 0], key=lambda r: -r[1])


def _row(report, label, ms, moved, copy_gbps) -> None:
    gbps = moved / ms / 1e6
    pct = 100 * gbps / copy_gbps
    report.write(f"| {label} | {ms * 1e3:.0f} | {moved / 1e6:.0f} | {gbps:.0f} | {pct:.0f}% |\n")


def sweep_shape(name, experts, rows, n, k, report) -> None:
    dev = "cuda"
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
    w = torch.randn(experts, n, k, dtype=torch.bfloat16, device=dev) / k**0.5
    copy_gbps = copy_bandwidth(dev)
    head = f"x [{rows}, {k}], w [{experts}, {n}, {k}] bf16; 1 GiB copy {copy_gbps:.0f} GB/s"
    report.write(f"\n## {name}: {head}\n\n")
    report.write("| pass | us | MB read+written (once each) | GB/s | % of copy |\n|---|---|---|---|---|\n")
    xb, wb = x.numel() * 2, w.numel() * 2
    _row(report, "copy x (bf16)", _ms(lambda: x.clone()), 2 * xb, copy_gbps)
    _row(report, "copy w (bf16)", _ms(lambda: w.clone()), 2 * wb, copy_gbps)
    fwd_only = _ms(lambda: _quant_act(x, E4M3, SCALE_ROWWISE))
    _row(report, "act: forward copy (rowwise)", fwd_only, xb * 3 // 2, copy_gbps)
    both = _ms(lambda: _quant_act_and_wgrad(x, E4M3, SCALE_ROWWISE))
    _row(report, "act: forward + wgrad copies (fused)", both, xb * 2, copy_gbps)
    wq = _ms(lambda: _quant_weight_with_dgrad_copy(w, E4M3, SCALE_ROWWISE))
    _row(report, "weight: forward + dgrad copies (fused)", wq, wb * 2, copy_gbps)
    report.write(f"\nforward quantization total (act both + weight): {(both + wq) * 1e3:.0f} us\n")
    report.write("\n| fused pass: kernel | us per call |\n|---|---|\n")
    for label, fn in (
        ("act", lambda: _quant_act_and_wgrad(x, E4M3, SCALE_ROWWISE)),
        ("weight", lambda: _quant_weight_with_dgrad_copy(w, E4M3, SCALE_ROWWISE)),
    ):
        for name, us in _kernels(fn):
            report.write(f"| {label}: {name[:90]} | {us:.0f} |\n")


def main() -> None:
    run_sweep(__doc__, "sweep_grouped_fp8_quant", "FP8 grouped GEMM quantization passes", SHAPES, sweep_shape)


if __name__ == "__main__":
    main()
