"""Where the host time of an FP8 layer step goes: cProfile of fwd+bwd steps issued without a sync.

    python benchmark/ops/profile_host.py [--out DIR] [--steps N]

Layers: bf16 nn.Linear, Float8Linear (HYBRID tensorwise / rowwise, FP8 or bf16 wgrad) at M=8192,
N=K=4096, and grouped_gemm_fp8 (HYBRID rowwise, DeepSeek-V2-Lite fc1: 64 experts, 24576 rows). For each:
host ms per step (the time to issue it) against GPU ms per step (do_bench), the CUDA synchronize calls
per step (profiler API events; a bare torch._scaled_mm row isolates torch's own), then the top functions by
own time. Then a host-cost table at M=1024, N=K=2048 (GPU time per call below the host's, so the loop
measures the host): torch._scaled_mm row-wise vs the cached-plan cuBLASLt op vs the dispatcher, and a
Float8Linear vs nn.Linear step. Writes DIR/profile_host.txt. A diagnosis tool, not a benchmark of record.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, host_ms, out_dir  # noqa: E402

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


def host_us(fn, calls: int = 200) -> float:
    """Host microseconds per call of fn issued back to back (no sync inside the timed loop)."""
    return 1e3 * host_ms(fn, calls, warmup=10)


def host_table(report: io.StringIO) -> None:
    from primus_turbo.pytorch.core.cpp_extension import cpp_ops
    from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import HAS_CUBLASLT_PLANS, gemm_fp8_impl

    m, n, k = 1024, 2048, 2048
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(n, 1, device="cuda") + 0.5
    sb_row, bf16 = sb.reshape(1, -1), torch.bfloat16
    rows = [("torch._scaled_mm rowwise", lambda: torch._scaled_mm(a, b.t(), sa, sb_row, out_dtype=bf16))]
    if HAS_CUBLASLT_PLANS:
        plan_op = cpp_ops().gemm_fp8_cublaslt
        rows.append(("gemm_fp8_cublaslt (csrc, cached plan)", lambda: plan_op(a, sa, b, sb, 1, bf16, False)))
    rows.append(("gemm_fp8_impl (dispatcher, CUBLAS)", lambda: gemm_fp8_impl(a, sa, b, sb, 1, 0, bf16)))
    abf, bbf = a.to(torch.bfloat16), b.to(torch.bfloat16)
    rows.append(("torch.mm bf16", lambda: torch.mm(abf, bbf.t())))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    hp = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    rows.append(("nn.Linear bf16 fwd+bwd", _linear_step(hp, x, grad)))
    for hp_wgrad in (False, True):
        cfg = Float8QuantConfig(Format.HYBRID, G.ROWWISE, high_precision_wgrad=hp_wgrad)
        layer = Float8Linear.from_float(hp, config=cfg)
        layer.cache_weight = True
        name = f"Float8Linear rowwise{' bf16-wgrad' if hp_wgrad else ''} fwd+bwd (cached W)"
        rows.append((name, _linear_step(layer, x, grad)))
    lines = [f"=== host cost per call, M={m} N={n} K={k} (no profiler)", "| call | host us | GPU us |"]
    lines.append("|---|---|---|")
    for name, fn in rows:
        gpu_ms, _ = bench_ms(fn)
        lines.append(f"| {name} | {host_us(fn):.1f} | {gpu_ms * 1e3:.1f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    report.write(text + "\n\n")


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def glue_table(report: io.StringIO) -> None:
    """Host us per call of each layer of the FP8 linear path at M=256, N=K=1024 (GPU work ~5 us per
    kernel, so the loops measure the host): where a Float8Linear step's host time goes."""
    from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION, cpp_ops
    from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import GemmFP8Dispatcher, gemm_fp8_impl
    from primus_turbo.pytorch.kernels.quantization.quantization_impl import quantize_fp8_impl
    from primus_turbo.pytorch.ops.gemm_fp8 import gemm_fp8

    m, n, k = 256, 1024, 1024
    e4m3, bf16 = torch.float8_e4m3fn, torch.bfloat16
    x = torch.randn(m, k, device="cuda", dtype=bf16, requires_grad=True)
    xd = x.detach()
    grad = torch.randn(m, n, device="cuda", dtype=bf16)
    hp = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=bf16)
    cfg = Float8QuantConfig(Format.HYBRID, G.ROWWISE, high_precision_wgrad=True)
    layer = Float8Linear.from_float(hp, config=cfg)
    layer.cache_weight = True
    w8 = layer._quantized_weight(cfg)
    xq, xs = quantize_fp8_impl(xd, e4m3, "rowwise", -1, 0, 0, False)
    gkw = dict(a=xq, a_s=xs, b=w8.data, b_s=w8.scale_inv, scale_mode=1, scale_block=0, out_dtype=bf16)
    gkw["fast_accum"] = False
    rows = []
    if HAS_CPP_EXTENSION:
        ops = cpp_ops()
        rows += [
            ("torch.ops quantize_fp8_rowwise (packet)", lambda: ops.quantize_fp8_rowwise(xd, e4m3, False)),
            (
                "torch.ops quantize_fp8_rowwise.default",
                lambda: ops.quantize_fp8_rowwise.default(xd, e4m3, False),
            ),  # fmt: skip
        ]
        if hasattr(ops, "gemm_fp8_cublaslt"):
            args = (xq, xs, w8.data, w8.scale_inv, 1, bf16, False)
            rows += [
                ("torch.ops gemm_fp8_cublaslt (packet)", lambda: ops.gemm_fp8_cublaslt(*args)),
                ("torch.ops gemm_fp8_cublaslt.default", lambda: ops.gemm_fp8_cublaslt.default(*args)),
            ]
    rows += [
        ("quantize_fp8_impl rowwise", lambda: quantize_fp8_impl(xd, e4m3, "rowwise", -1, 0, 0, False)),
        ("GemmFP8Dispatcher.resolve", lambda: GemmFP8Dispatcher.resolve(**gkw)),
        ("gemm_fp8_impl (dispatch + op)", lambda: gemm_fp8_impl(xq, xs, w8.data, w8.scale_inv, 1, 0, bf16)),
        ("torch.mm bf16", lambda: torch.mm(xd, hp.weight.t())),
    ]
    from primus_turbo.pytorch.ops.gemm import gemm_wgrad

    def fwd_bwd(fn):
        def step():
            x.grad = None
            fn(x).backward(grad)

        return step

    gq, gs = quantize_fp8_impl(grad, torch.float8_e5m2, "rowwise", -1, 0, 0, False)
    w8n = w8.data_t, w8.scale_inv_t  # the dgrad reads B scaled along N
    gemm_fp8_impl(gq, gs, *w8n, 1, 0, bf16)
    dgrad_backend = GemmFP8Dispatcher.last_backend
    rows += [
        (
            f"gemm_fp8_impl dgrad E5M2 x E4M3 ({dgrad_backend.name if dgrad_backend else '?'})",
            lambda: gemm_fp8_impl(gq, gs, *w8n, 1, 0, bf16),
        ),  # fmt: skip
        (
            "quantize_fp8_impl rowwise E5M2 (grad)",
            lambda: quantize_fp8_impl(grad, torch.float8_e5m2, "rowwise", -1, 0, 0, False),
        ),  # fmt: skip
        ("gemm_wgrad bf16", lambda: gemm_wgrad(xd, grad, False, True, bf16)),
    ]

    def fp8_fwd_bwd():
        x.grad = None
        gemm_fp8(x, w8, trans_b=True, out_dtype=bf16, config=cfg).backward(grad)

    rows.append(("gemm_fp8(x, w8) fwd+bwd", fp8_fwd_bwd))
    out_fp8 = gemm_fp8(x, w8, trans_b=True, out_dtype=bf16, config=cfg)
    rows.append(("gemm_fp8 backward only (retain_graph)", lambda: out_fp8.backward(grad, retain_graph=True)))
    out_bf16 = hp(x)
    rows.append(
        ("nn.Linear backward only (retain_graph)", lambda: out_bf16.backward(grad, retain_graph=True))
    )

    def single_threaded(fn):
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()

        return run

    rows += [
        ("gemm_fp8(x, w8) fwd+bwd, autograd multithreading off", single_threaded(fp8_fwd_bwd)),
        ("Float8Linear fwd+bwd, autograd multithreading off", single_threaded(fwd_bwd(layer))),
        ("nn.Linear fwd+bwd, autograd multithreading off", single_threaded(fwd_bwd(hp))),
    ]

    def no_grad_fwd():
        with torch.no_grad():
            gemm_fp8(x, w8, trans_b=True, out_dtype=bf16, config=cfg)

    rows += [
        ("gemm_fp8(x, w8) under no_grad", no_grad_fwd),
        (
            "gemm_fp8(x, w8) forward (graph built)",
            lambda: gemm_fp8(x, w8, trans_b=True, out_dtype=bf16, config=cfg),
        ),  # fmt: skip
        ("Float8Linear forward (graph built)", lambda: layer(x)),
        ("Float8Linear fwd+bwd", fwd_bwd(layer)),
        ("nn.Linear forward (graph built)", lambda: hp(x)),
        ("nn.Linear fwd+bwd", fwd_bwd(hp)),
        ("identity autograd.Function fwd+bwd", fwd_bwd(lambda t: _Identity.apply(t) * 1.0)),
        ("t * 1.0 fwd+bwd (no Function)", fwd_bwd(lambda t: t * 1.0)),
    ]
    lines = [f"=== FP8 linear glue, host us per call, M={m} N={n} K={k} (no profiler)", "| call | host us |"]
    lines.append("|---|---|")
    for name, fn in rows:
        lines.append(f"| {name} | {host_us(fn, 300):.1f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    report.write(text + "\n\n")


def profile(name: str, step, steps: int, report: io.StringIO) -> None:
    gpu_ms, _ = bench_ms(step)
    issue_ms = host_ms(step, steps, warmup=5)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    head = (
        f"=== {name}: host {issue_ms:.3f} ms/step (no profiler), GPU {gpu_ms:.3f} ms/step (do_bench); "
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
    parser.add_argument("--table-only", action="store_true", help="only the small-shape host-cost table")
    parser.add_argument("--glue", action="store_true", help="host us of each layer of the FP8 linear path")
    parser.add_argument(
        "--small", action="store_true", help="profile the linears at M=1024, N=K=2048 (host bound) instead"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_host: needs a CUDA device")
    torch.manual_seed(0)
    report = io.StringIO()
    if args.glue:
        glue_table(report)
    host_table(report)
    if args.table_only or args.glue:
        path = out_dir(args) / "profile_host.txt"
        path.write_text(report.getvalue())
        print(f"wrote {path}")
        return
    m, n = (1024, 2048) if args.small else (8192, 4096)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    hp = torch.nn.Linear(n, n, bias=False, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    profile(f"bf16 nn.Linear {m}x{n}x{n}", _linear_step(hp, x, grad), args.steps, report)
    if not args.small:
        profile("torch._scaled_mm rowwise 8192x4096x4096", _scaled_mm_step(), args.steps, report)
    for gran, hp_wgrad in ((G.TENSORWISE, False), (G.ROWWISE, False), (G.ROWWISE, True)):
        cfg = Float8QuantConfig(Format.HYBRID, gran, high_precision_wgrad=hp_wgrad)
        layer = Float8Linear.from_float(hp, config=cfg)
        layer.cache_weight = True  # the microbatch case: the weight is quantized once
        name = f"Float8Linear {gran.name.lower()}{' bf16-wgrad' if hp_wgrad else ''} (cached W) {m}x{n}x{n}"
        profile(name, _linear_step(layer, x, grad), args.steps, report)
    for hp_wgrad in () if args.small else (False, True):
        cfg = Float8QuantConfig(Format.HYBRID, G.ROWWISE, high_precision_wgrad=hp_wgrad)
        name = f"grouped_gemm_fp8 rowwise hybrid{' bf16-wgrad' if hp_wgrad else ''} dsv2lite fc1"
        profile(name, _grouped_step(cfg), args.steps // 2, report)
    path = out_dir(args) / "profile_host.txt"
    path.write_text(report.getvalue())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
