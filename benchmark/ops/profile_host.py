"""Where the host time of an FP8 layer step goes: cProfile of fwd+bwd steps issued without a sync.

    python benchmark/ops/profile_host.py [--out DIR] [--steps N]

Layers: bf16 nn.Linear, Float8Linear (HYBRID tensorwise / rowwise, FP8 or bf16 wgrad) at M=8192,
N=K=4096, and grouped_gemm_fp8 (HYBRID rowwise, DeepSeek-V2-Lite fc1: 64 experts, 24576 rows). For each:
host ms per step (the time to issue it) against GPU ms per step (do_bench), the CUDA synchronize calls
per step (profiler API events; a bare torch._scaled_mm row isolates torch's own), then the top functions by
own time. Writes DIR/profile_host.txt. A diagnosis tool, not a benchmark of record.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, out_dir  # noqa: E402

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format  # noqa: E402
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G  # noqa: E402
from primus_turbo.pytorch.modules.float8_linear import Float8Linear  # noqa: E402
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8  # noqa: E402


def _linear_step(layer, x, grad):
    def step():
        x.grad = None
        layer(x).backward(grad)

    return step


def _grouped_step(cfg):
    e, rows, n, k = 64, 24576, 2816, 2048
    lens = torch.full((e,), rows // e, dtype=torch.int64, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()
    grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = w.grad = None
        grouped_gemm_fp8(x, w, lens, trans_b=True, config=cfg).backward(grad)

    return step


def sync_calls(step, steps: int = 3) -> str:
    """CUDA runtime synchronize calls per step (torch.profiler's API events): the ones a sync debug mode
    misses too, e.g. made inside a library."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    counts: dict[str, float] = {}
    for e in prof.events():
        if "Synchronize" in e.name and e.name != "cudaDeviceSynchronize":  # ours, after the loop
            counts[e.name] = counts.get(e.name, 0) + 1 / steps
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(counts.items())) or "none"


def _scaled_mm_step():
    """One bare rowwise torch._scaled_mm (E4M3, bf16 out): is a sync inside torch's op?"""
    a = torch.randn(8192, 4096, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 4096, device="cuda")
    return lambda: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)


def profile(name: str, step, steps: int, report: io.StringIO) -> None:
    gpu_ms, _ = bench_ms(step)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    head = (
        f"=== {name}: host {host_ms:.3f} ms/step (no profiler), GPU {gpu_ms:.3f} ms/step (do_bench); "
        f"syncs per step: {sync_calls(step)}"
    )
    print(head, flush=True)
    report.write(head + "\n")
    stats = io.StringIO()
    pstats.Stats(prof, stream=stats).sort_stats("tottime").print_stats(28)
    report.write(stats.getvalue() + "\n")


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_host: needs a CUDA device")
    torch.manual_seed(0)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hp = torch.nn.Linear(4096, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    report = io.StringIO()
    profile("bf16 nn.Linear", _linear_step(hp, x, grad), args.steps, report)
    profile("torch._scaled_mm rowwise 8192x4096x4096", _scaled_mm_step(), args.steps, report)
    for gran, hp_wgrad in ((G.TENSORWISE, False), (G.ROWWISE, False), (G.ROWWISE, True)):
        cfg = Float8QuantConfig(Format.HYBRID, gran, high_precision_wgrad=hp_wgrad)
        layer = Float8Linear.from_float(hp, config=cfg)
        layer.cache_weight = True  # the microbatch case: the weight is quantized once
        name = f"Float8Linear {gran.name.lower()}{' bf16-wgrad' if hp_wgrad else ''} (cached W)"
        profile(name, _linear_step(layer, x, grad), args.steps, report)
    for hp_wgrad in (False, True):
        cfg = Float8QuantConfig(Format.HYBRID, G.ROWWISE, high_precision_wgrad=hp_wgrad)
        name = f"grouped_gemm_fp8 rowwise hybrid{' bf16-wgrad' if hp_wgrad else ''} dsv2lite fc1"
        profile(name, _grouped_step(cfg), args.steps // 2, report)
    path = out_dir(args) / "profile_host.txt"
    path.write_text(report.getvalue())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
