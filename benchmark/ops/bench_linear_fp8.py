"""Float8Linear forward+backward, including every quantization, vs torch bf16 nn.Linear.

    python benchmark/ops/bench_linear_fp8.py --quick   # 1 shape
    python benchmark/ops/bench_linear_fp8.py           # M=8192, (N, K) in the 4 issue shapes
    python benchmark/ops/bench_linear_fp8.py --quick --profile   # + each label's kernels by GPU time

The weight is re-quantized every iteration (its cache is dropped), so the timing is the
no-gradient-accumulation worst case; "cached W" is the microbatch case (one weight quantization
per optimizer step). Recipes: HYBRID (E4M3 fwd / E5M2 grads) tensorwise/rowwise/blockwise, default
backends (dispatcher); "bf16-wgrad": ``high_precision_wgrad=True`` (FP8 forward and dgrad, the weight
gradient a bf16 GEMM of the saved bf16 input). "FP8 GEMMs only": fwd, dgrad and wgrad as three
``torch._scaled_mm`` calls (cuBLASLt, tensor-wise E4M3) on operands quantized beforehand, with no
quantization and no autograd: the ceiling of any Float8Linear at the shape (CUDA only).
Target (H200): >= 1.6x bf16 at every shape. "host
fwd+bwd" is the host time to issue one step: when it is close to "fwd+bwd", the step is bound by
Python/launch overhead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    GEMM_COLUMNS,
    bench_ms,
    bench_parser,
    host_ms,
    out_dir,
    print_table,
    tflops,
    write_csv,
)

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity  # noqa: E402
from primus_turbo.pytorch.modules.float8_linear import Float8Linear  # noqa: E402

COLUMNS = GEMM_COLUMNS + ["fwd+bwd (ms)", "speedup vs bf16", "cached W speedup", "host fwd+bwd (ms)"]
M = 8192
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (2048, 7168)]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke runs only


def snr_db(ref, out) -> float:
    err = (out.detach().float() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-30)))


def _step_ms(layer, x, grad, drop_cache: bool) -> tuple[float, float, float, float]:
    """(fwd ms, fwd+bwd ms, its stddev, host ms per step). x.grad is reset every step (in a model
    dx flows on; accumulating it would add an activation-sized add to every label)."""

    def fwd():
        if drop_cache:
            layer._weight_cache = None
        return layer(x)

    def step():
        x.grad = None
        fwd().backward(grad)

    fwd_ms, _ = bench_ms(fwd)
    total_ms, sd = bench_ms(step)
    return fwd_ms, total_ms, sd, host_ms(step)


def run_shape(n: int, k: int) -> list[dict]:
    x = torch.randn(M, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    hp = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16)
    y = hp(x)
    grad = torch.randn_like(y)
    ref = x.detach().float() @ hp.weight.detach().float().t()
    hp_fwd, hp_total, hp_sd, hp_host = _step_ms(hp, x, grad, False)
    flop = 2.0 * M * n * k
    rows = [_row("bf16 nn.Linear", n, k, flop, (hp_fwd, hp_total, hp_sd, hp_host), hp_total, hp_total, None)]
    if DEVICE == "cuda":
        gemms = _gemms_only_ms(x, hp.weight, grad)
        rows.append(_row(GEMMS_ONLY, n, k, flop, gemms, hp_total, gemms[1], None))
    recipes = [(gran, False) for gran in ScalingGranularity]
    recipes += [(ScalingGranularity.TENSORWISE, True), (ScalingGranularity.ROWWISE, True)]
    for gran, hp_wgrad in recipes:
        cfg = Float8QuantConfig(format=Format.HYBRID, granularity=gran, high_precision_wgrad=hp_wgrad)
        layer = Float8Linear.from_float(hp, config=cfg)
        timings = _step_ms(layer, x, grad, True)
        layer.cache_weight = True  # the microbatch case: one weight quantization per optimizer step
        _, cached_ms, _, _ = _step_ms(layer, x, grad, False)
        layer.cache_weight = False
        out_snr = snr_db(ref, layer(x))
        label = f"Float8Linear {gran.name.lower()}" + (" bf16-wgrad" if hp_wgrad else "")
        rows.append(_row(label, n, k, flop, timings, hp_total, cached_ms, out_snr))
        if PROFILE:
            _profile(label, layer, x, grad)
        print_table(rows[-1:], COLUMNS)
    return rows


GEMMS_ONLY = "FP8 GEMMs only (tensorwise, pre-quantized)"


def _gemms_only_ms(x, w, grad) -> tuple[float, float, float, float]:
    """(fwd, fwd+dgrad+wgrad, stddev, host) ms of the three FP8 GEMMs on pre-quantized E4M3 copies in the
    layouts torch._scaled_mm takes (A row-major, B column-major)."""

    def q(t):
        return t.detach().contiguous().to(torch.float8_e4m3fn)

    x_q, xt_q, w_q, wt_q, g_q, gt_q = (q(t) for t in (x, x.t(), w, w.t(), grad, grad.t()))
    one = torch.ones((), device=x.device)

    def mm(a, b):
        return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)

    def fwd():
        return mm(x_q, w_q.t())  # [M, K] @ [K, N]

    def step():
        return fwd(), mm(g_q, wt_q.t()), mm(gt_q, xt_q.t())  # dgrad [M, N] @ [N, K]; wgrad [N, M] @ [M, K]

    fwd_ms, _ = bench_ms(fwd)
    total_ms, sd = bench_ms(step)
    return fwd_ms, total_ms, sd, host_ms(step)


def _profile(label, layer, x, grad) -> None:
    """--profile: the kernels of 3 steps (weight re-quantized), by GPU time, and the host-side ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            layer._weight_cache = None
            x.grad = None
            layer(x).backward(grad)
    sort = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    print(f"--- {label}: 3 steps ---")
    print(prof.key_averages().table(sort_by=sort, row_limit=15))


def _row(label, n, k, flop, timings, hp_total, cached_ms, out_snr) -> dict:
    fwd_ms, total_ms, sd, host_ms = timings
    bwd_ms = total_ms - fwd_ms
    return {
        "label": label,
        "B": 1,
        "M": M,
        "N": n,
        "K": k,
        "Check": "" if out_snr is None else ("PASS" if out_snr >= 25.0 else "FAIL"),
        "Forward TFLOPS": tflops(flop, fwd_ms),
        "Backward TFLOPS": tflops(2 * flop, bwd_ms),
        "Backward TFLOPS_stddev": tflops(2 * flop, bwd_ms) * sd / max(bwd_ms, 1e-9),
        "Forward Time (ms)": fwd_ms,
        "Backward Time (ms)": bwd_ms,
        "out_snr": "" if out_snr is None else out_snr,
        "fwd+bwd (ms)": total_ms,
        "speedup vs bf16": hp_total / total_ms,
        "cached W speedup": hp_total / cached_ms,
        "host fwd+bwd (ms)": host_ms,
    }


PROFILE = False


def main() -> None:
    global PROFILE
    parser = bench_parser(__doc__)
    parser.add_argument("--profile", action="store_true", help="print each FP8 label's kernels (profiler)")
    args = parser.parse_args()
    PROFILE = args.profile
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [r for n, k in shapes for r in run_shape(n, k)]
    write_csv(out_dir(args) / "linear_fp8.csv", rows, COLUMNS)
    print_table(rows, ["label", "M", "N", "K", "Check", *COLUMNS[-4:]])


if __name__ == "__main__":
    main()
