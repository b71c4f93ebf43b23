"""Float8Linear forward+backward, including every quantization, vs torch bf16 nn.Linear.

    python benchmark/ops/bench_linear_fp8.py --quick   # 1 shape
    python benchmark/ops/bench_linear_fp8.py           # M=8192, (N, K) in the 4 issue shapes

The weight is re-quantized every iteration (its cache is dropped), so the timing is the
no-gradient-accumulation worst case; "cached W" is the microbatch case (one weight quantization
per optimizer step). Recipes: HYBRID (E4M3 fwd / E5M2 grads) tensorwise/rowwise/blockwise, default
backends (dispatcher). Target (H200): >= 1.6x bf16 at every shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import GEMM_COLUMNS, bench_ms, bench_parser, out_dir, print_table, tflops, write_csv  # noqa: E402

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity  # noqa: E402
from primus_turbo.pytorch.modules.float8_linear import Float8Linear  # noqa: E402

COLUMNS = GEMM_COLUMNS + ["fwd+bwd (ms)", "speedup vs bf16", "cached W speedup"]
M = 8192
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (2048, 7168)]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke runs only


def snr_db(ref, out) -> float:
    err = (out.detach().float() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-30)))


def _step_ms(layer, x, grad, drop_cache: bool) -> tuple[float, float, float]:
    def fwd():
        if drop_cache:
            layer._weight_cache = None
        return layer(x)

    def step():
        fwd().backward(grad)

    fwd_ms, _ = bench_ms(fwd)
    total_ms, sd = bench_ms(step)
    return fwd_ms, total_ms, sd


def run_shape(n: int, k: int) -> list[dict]:
    x = torch.randn(M, k, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    hp = torch.nn.Linear(k, n, bias=False, device=DEVICE, dtype=torch.bfloat16)
    y = hp(x)
    grad = torch.randn_like(y)
    ref = x.detach().float() @ hp.weight.detach().float().t()
    hp_fwd, hp_total, _ = _step_ms(hp, x, grad, False)
    flop = 2.0 * M * n * k
    rows = [_row("bf16 nn.Linear", n, k, flop, hp_fwd, hp_total, 0.0, hp_total, hp_total, None)]
    for gran in ScalingGranularity:
        cfg = Float8QuantConfig(format=Format.HYBRID, granularity=gran)
        layer = Float8Linear.from_float(hp, config=cfg)
        fwd_ms, total_ms, sd = _step_ms(layer, x, grad, True)
        _, cached_ms, _ = _step_ms(layer, x, grad, False)
        out_snr = snr_db(ref, layer(x))
        rows.append(
            _row(
                f"Float8Linear {gran.name.lower()}",
                n,
                k,
                flop,
                fwd_ms,
                total_ms,
                sd,
                hp_total,
                cached_ms,
                out_snr,
            )
        )
        print_table(rows[-1:], COLUMNS)
    return rows


def _row(label, n, k, flop, fwd_ms, total_ms, sd, hp_total, cached_ms, out_snr) -> dict:
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
    }


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [r for n, k in shapes for r in run_shape(n, k)]
    write_csv(out_dir(args) / "linear_fp8.csv", rows, COLUMNS)
    print_table(
        rows, ["label", "M", "N", "K", "Check", "fwd+bwd (ms)", "speedup vs bf16", "cached W speedup"]
    )


if __name__ == "__main__":
    main()
