"""Grouped GEMM for MoE experts (y_g = x_g @ W_g.T, W [E, N, K], the Megatron/TorchTitan layout):
forward, backward (dgrad + variable-K wgrad), separate dgrad/wgrad, for bf16 and FP8, against
torch._grouped_mm, torch._scaled_grouped_mm and a per-expert loop, same process, same inputs.

    python benchmark/ops/bench_grouped_gemm.py --quick   # 3 shapes, < 60 s on an H200 incl. compile
    python benchmark/ops/bench_grouped_gemm.py           # models x fc1/fc2 x tokens x balanced/skewed
                                                          # + an E sweep {8,16,32,64,256}, < 4 min
    ... --rounds 3   # every shape 3 times, impls interleaved; summary per shape: the median speedup
                     # (rows running the same kernel differed by 3-8% within one call in session 25)

Shapes: DeepSeek-V2-Lite (hidden 2048, expert 1408, E=64, top-6), DeepSeek-V3 (7168 / 2048, E=32
experts per GPU at EP=8, top-8; E=256 on fc2), Mixtral (4096 / 14336, E=8, top-2). fc1 is the fused
gate+up projection (N = 2 x expert dim, K = hidden), fc2 the down projection. Rows = tokens x top-k,
split balanced or skewed (expert 0 gets 60%).

Labels (impl):
  torch._grouped_mm        bf16 baseline (CUTLASS); bwd = its dgrad + 2-D x 2-D wgrad
  dense torch.mm bound     not a grouped GEMM: cuBLAS on one [M, K] x [K, N] problem of the same FLOPs (fwd,
                           dgrad, wgrad), no group edges or tails; a practical ceiling for any grouped kernel
                           at the shape (its speedup column says how far above _grouped_mm that ceiling is)
  loop                     per-expert torch.mm (TORCH backend, syncs; E <= 16 only)
  turbo default            turbo.ops.grouped_gemm, the dispatcher's in-code choice (no pin, no autotune: what
                           a user gets); suffix: the fwd / dgrad / wgrad backends
  turbo auto               turbo.ops.grouped_gemm, dispatcher with autotune (CUTLASS vs TRITON; the TORCH
                           loop syncs with the host and is never timed on CUDA); suffix as above
  turbo TRITON             turbo.ops.grouped_gemm pinned to the persistent Triton kernels
  torch._scaled_grouped_mm FP8 rowwise forward on pre-quantized operands (kernel only, no bwd)
  turbo fp8 <GRAN>         turbo.ops.grouped_gemm_fp8 TRITON (rowwise/tensorwise: auto), quantization included
  turbo fp8 rowwise hybrid [bf16-wgrad]
                           the deepseek_moe_fp8 recipe's experts: HYBRID (E5M2 gradients) rowwise, auto,
                           with the FP8 wgrad or (bf16-wgrad, fp8.wgrad=bf16) the bf16 grouped wgrad of
                           the saved bf16 input; gate 20 dB (E5M2 gradients)
  turbo fp8 rowwise hybrid bf16-wgrad prequant
                           as hybrid bf16-wgrad with the expert weight quantized once outside the timed
                           calls (quantize_grouped_weight: what training does once per optimizer step
                           under gradient accumulation; the recipes' per-step FP8 weight cache)
  turbo fp8 rowwise cutlass-wgrad
                           E4M3 rowwise, auto, with GroupedGemmFP8VariableKDispatcher.
                           group_lens_multiple_of_16 set: the wgrad may take torch._scaled_grouped_mm
                           (suffix: the wgrad backend); only where every expert has a multiple of 16 rows
Check: out/da/db SNR vs the torch._grouped_mm bf16 results (bf16 rounding alone: ~50 dB): bf16 >= 40 dB,
FP8 >= 25 dB.
Targets (H200): turbo default / auto fwd+bwd >= 1.15x torch._grouped_mm geomean, never < 1.0x; FP8 fwd+bwd
>= 1.5x bf16 _grouped_mm geomean; blockwise FP8 >= 1000 TFLOP/s fwd (DeepSeek-V3); FP8 wgrad >= 800.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import GEMM_COLUMNS, bench_ms, bench_parser, out_dir, print_table, tflops, write_csv  # noqa: E402

import primus_turbo.pytorch as turbo  # noqa: E402
from primus_turbo.pytorch.core.backend import GlobalBackendManager  # noqa: E402
from primus_turbo.pytorch.core.low_precision import (  # noqa: E402
    Float8QuantConfig,
    Format,
    ScalingGranularity,
)
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (  # noqa: E402
    GroupedGemmFP8VariableKDispatcher,
)
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (  # noqa: E402
    GroupedGemmDispatcher,
    GroupedGemmVariableKDispatcher,
    cutlass_offsets,
    grouped_gemm_impl,
    grouped_gemm_variable_k_impl,
)
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import quantize_grouped_weight  # noqa: E402
from primus_turbo.pytorch.ops.quantization import quantize_fp8  # noqa: E402

COLUMNS = GEMM_COLUMNS + ["impl", "dist", "Dgrad TFLOPS", "Wgrad TFLOPS", "fwd+bwd speedup vs _grouped_mm"]
CUTLASS_WGRAD = "turbo fp8 rowwise cutlass-wgrad"
HYBRID_BF16_WGRAD = "turbo fp8 rowwise hybrid bf16-wgrad"
PREQUANT = HYBRID_BF16_WGRAD + " prequant"
DENSE_BOUND = "dense torch.mm bound"
MODELS = {  # name: (hidden, expert dim, experts, top-k)
    "dsv2lite": (2048, 1408, 64, 6),
    "dsv3": (7168, 2048, 32, 8),
    "mixtral": (4096, 14336, 8, 2),
}


def configs(quick: bool) -> list[tuple]:
    """(model, layer, E, rows, N, K, dist)."""

    def layer_dims(model, layer):
        hidden, inter, _, _ = MODELS[model]
        return (2 * inter, hidden) if layer == "fc1" else (hidden, inter)

    if quick:
        out = [("dsv2lite", "fc1", 64, 4096 * 6, "balanced"), ("dsv3", "fc1", 32, 4096 * 8, "skewed")]
        out.append(("mixtral", "fc1", 8, 4096 * 2, "balanced"))
    else:
        out = []
        for model, (_, _, e, topk) in MODELS.items():
            for layer in ("fc1", "fc2"):
                for tokens in (4096, 16384):
                    for dist in ("balanced", "skewed"):
                        out.append((model, layer, e, tokens * topk, dist))
        out.append(("mixtral", "fc2", 8, 65536 * 2, "balanced"))
        out.append(("dsv3", "fc2", 256, 8192 * 8, "balanced"))
        out += [("dsv2lite", "fc2", e, 8192 * 6, "skewed") for e in (8, 16, 32, 256)]
    return [(m, lay, e, rows, *layer_dims(m, lay), dist) for m, lay, e, rows, dist in out]


def group_lens_for(rows: int, experts: int, dist: str, device) -> torch.Tensor:
    if dist == "balanced":
        lens = torch.full((experts,), rows // experts, dtype=torch.int64)
        lens[: rows % experts] += 1
    else:
        big = rows * 3 // 5
        rest = torch.rand(experts - 1, generator=torch.Generator().manual_seed(0)).double() + 0.05
        lens = torch.cat([torch.tensor([big]), (rest / rest.sum() * (rows - big)).floor().long()])
        lens[-1] += rows - lens.sum()
    return lens.to(device)


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (out.detach().float() - ref.float()).pow(2).sum()
    return float(10 * torch.log10(ref.float().pow(2).sum() / err.clamp_min(1e-30)))


def _offs(lens):
    return torch.cumsum(lens, 0).to(torch.int32)


def torch_grouped_mm_impls(x, w, lens, grad):
    """(fwd, bwd, dgrad, wgrad) callables of the torch._grouped_mm baseline."""
    offs = _offs(lens)
    wt = w.transpose(1, 2)

    def dgrad():
        return torch._grouped_mm(grad, w, offs=offs)

    def wgrad():
        return torch._grouped_mm(grad.t(), x, offs=offs)

    def bwd():
        return dgrad(), wgrad()

    return (lambda: torch._grouped_mm(x, wt, offs=offs)), bwd, dgrad, wgrad


DEFAULT = "default"  # no pin, autotune off: the in-code choice


def turbo_impls(x, w, lens, grad, backend, fp8_config=None, prequantized=False):
    # the weight quantized once, outside the timed calls; its gradient still flows to w
    w_arg = quantize_grouped_weight(w, fp8_config) if prequantized else w

    def fwd():
        GlobalBackendManager.set_grouped_gemm_backend(None if backend == DEFAULT else backend)
        GlobalBackendManager.set_auto_tune(backend is None)
        if fp8_config is None:
            return turbo.ops.grouped_gemm(x, w, lens, trans_b=True)
        return turbo.ops.grouped_gemm_fp8(x, w_arg, lens, trans_b=True, config=fp8_config)

    out = fwd()

    def bwd():
        return torch.autograd.grad(out, (x, w), grad, retain_graph=True)

    dgrad = wgrad = None
    if fp8_config is None:
        offs = cutlass_offsets(lens, x.shape[0])  # what the autograd Function builds once per forward

        def dgrad():
            return grouped_gemm_impl(grad, w.detach(), lens, False, offs)

        def wgrad():
            return grouped_gemm_variable_k_impl(grad, x.detach(), lens, offs)

    return fwd, bwd, dgrad, wgrad


def _picks(x, w, lens, grad):
    """The backends the dispatchers resolve to for this shape's fwd / dgrad / wgrad (autotune: cached)."""
    fwd = GroupedGemmDispatcher.resolve(a=x, b=w, group_lens=lens, trans_b=True)
    dgrad = GroupedGemmDispatcher.resolve(a=grad, b=w, group_lens=lens, trans_b=False)
    wgrad = GroupedGemmVariableKDispatcher.resolve(x=grad, y=x, group_lens=lens)
    return f"fwd {fwd.name}, dgrad {dgrad.name}, wgrad {wgrad.name}"


def dense_bound_impls(x, w, grad):
    """(fwd, bwd, None, None) of the dense bound: one [M, K] x [K, N] cuBLAS GEMM a direction, same FLOPs."""
    w2 = w.detach()[0].t().contiguous()  # [K, N]: expert 0's weight stands for all (values are not checked)
    x = x.detach()

    def bwd():
        return grad @ w2.t(), grad.t() @ x

    return (lambda: x @ w2), bwd, None, None


def scaled_grouped_mm_fwd(x, w, lens):
    qx, sx = quantize_fp8(x.detach(), torch.float8_e4m3fn, ScalingGranularity.ROWWISE)
    qw, sw = quantize_fp8(w.detach(), torch.float8_e4m3fn, ScalingGranularity.ROWWISE)
    offs, sx, sw = _offs(lens), sx.reshape(-1).contiguous(), sw[..., 0].contiguous()
    return lambda: torch._scaled_grouped_mm(
        qx, qw.transpose(1, 2), sx, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )


REP = {"warmup_ms": 25, "rep_ms": 100}  # --quick: 10 / 40


def _ms(fn):
    return bench_ms(fn, **REP)


def measure(impl, dist, shape, fns, refs, gate, base_total, check=True):
    model, layer, e, rows, n, k = shape
    fwd, bwd, dgrad, wgrad = fns
    flop = 2.0 * rows * n * k
    row = {"label": f"{model}-{layer} {impl} {dist}", "impl": impl, "dist": dist}
    row.update({"B": e, "M": rows, "N": n, "K": k})
    out = fwd()
    f_ms, f_sd = _ms(fwd)
    row.update(
        {"Forward TFLOPS": tflops(flop, f_ms), "Forward TFLOPS_stddev": tflops(flop, f_ms) * f_sd / f_ms}
    )
    row["Forward Time (ms)"] = f_ms
    if check:
        row["out_snr"] = snr_db(refs[0], out)
    ok = not check or row["out_snr"] >= gate
    total = None
    if bwd is not None:
        grads = bwd()
        b_ms, b_sd = _ms(bwd)
        row.update({"Backward TFLOPS": tflops(2 * flop, b_ms), "Backward Time (ms)": b_ms})
        row["Backward TFLOPS_stddev"] = tflops(2 * flop, b_ms) * b_sd / b_ms  # first-order
        if check:
            row.update({"da_snr": snr_db(refs[1], grads[0]), "db_snr": snr_db(refs[2], grads[1])})
            ok = ok and row["da_snr"] >= gate and row["db_snr"] >= gate
        total = f_ms + b_ms
    for name, fn in (("Dgrad TFLOPS", dgrad), ("Wgrad TFLOPS", wgrad)):
        if fn is not None:
            row[name] = tflops(flop, _ms(fn)[0])
    if total is not None and base_total:
        row["fwd+bwd speedup vs _grouped_mm"] = base_total / total
    row["Check"] = ("PASS" if ok else "FAIL") if check else "n/a"
    return row, total


def run_shape(shape, dist, quick, device):
    model, layer, e, rows, n, k = shape
    torch.manual_seed(0)
    lens = group_lens_for(rows, e, dist, device)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = (torch.randn(e, n, k, dtype=torch.bfloat16, device=device) / math.sqrt(k)).requires_grad_()
    grad = torch.randn(rows, n, dtype=torch.bfloat16, device=device)
    base = torch_grouped_mm_impls(x.detach(), w.detach(), lens, grad)
    offs = _offs(lens)
    refs = (
        torch._grouped_mm(x.detach(), w.detach().transpose(1, 2), offs=offs),
        torch._grouped_mm(grad, w.detach(), offs=offs),
        torch._grouped_mm(grad.t(), x.detach(), offs=offs),
    )
    rows_out = []
    row, base_total = measure("torch._grouped_mm", dist, shape, base, refs, 40.0, None)
    rows_out.append(row)
    dense = dense_bound_impls(x, w, grad)
    rows_out.append(measure(DENSE_BOUND, dist, shape, dense, refs, 0.0, base_total, check=False)[0])
    impls = [("turbo default", DEFAULT, None), ("turbo auto", None, None), ("turbo TRITON", "TRITON", None)]
    if e <= 16 and not quick:
        impls.append(("loop", "TORCH", None))
    grans = [ScalingGranularity.ROWWISE, ScalingGranularity.BLOCKWISE]
    if not quick:
        grans.insert(0, ScalingGranularity.TENSORWISE)
    for g in grans:
        backend = "TRITON" if g is ScalingGranularity.BLOCKWISE else None  # auto: TMA Triton fwd/dgrad
        impls.append((f"turbo fp8 {g.name.lower()}", backend, Float8QuantConfig(granularity=g)))
    # the deepseek_moe_fp8 recipe's experts: HYBRID rowwise, with the FP8 or the bf16 wgrad (fp8.wgrad=bf16)
    for hp in (False, True):
        cfg = Float8QuantConfig(Format.HYBRID, ScalingGranularity.ROWWISE, high_precision_wgrad=hp)
        impls.append((HYBRID_BF16_WGRAD if hp else "turbo fp8 rowwise hybrid", None, cfg))
    impls.append((PREQUANT, None, impls[-1][2]))
    # the CUTLASS wgrad device-asserts unless every expert has a multiple of 16 tokens (skewed: not)
    if bool((lens % 16 == 0).all()):
        rowwise_e4m3 = Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.ROWWISE)
        impls.append((CUTLASS_WGRAD, None, rowwise_e4m3))
    wgrad_dispatcher = GroupedGemmFP8VariableKDispatcher
    for name, backend, cfg in impls:
        wgrad_dispatcher.group_lens_multiple_of_16 = name == CUTLASS_WGRAD
        wgrad_dispatcher.clear_cache()  # autotune picks cached without the promise: re-tune
        fns = turbo_impls(x, w, lens, grad, backend, cfg, prequantized=name == PREQUANT)
        gate = 40.0 if cfg is None else (20.0 if cfg.format is Format.HYBRID else 25.0)
        row, _ = measure(name, dist, shape, fns, refs, gate, base_total)
        if name in ("turbo default", "turbo auto"):
            row["impl"] += f" ({_picks(x, w, lens, grad)})"
        if name == CUTLASS_WGRAD:
            row["impl"] += f" ({wgrad_dispatcher.last_backend.name})"
        rows_out.append(row)
    wgrad_dispatcher.group_lens_multiple_of_16 = False
    wgrad_dispatcher.clear_cache()
    try:  # a baseline that the installed torch cannot run is reported, not fatal
        fns = (scaled_grouped_mm_fwd(x, w, lens), None, None, None)
        rows_out.append(measure("torch._scaled_grouped_mm", dist, shape, fns, refs, 25.0, None)[0])
    except (RuntimeError, NotImplementedError) as exc:
        print(f"torch._scaled_grouped_mm skipped on {shape}: {str(exc).splitlines()[0]}")
    GlobalBackendManager.reset()
    return rows_out


def geomean(values):
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


SPEEDUP = "fwd+bwd speedup vs _grouped_mm"


def median_speedups(rows) -> dict[str, list[float]]:
    """Per impl, one speedup per shape: the median over that shape's rounds (each round's speedup is against
    the same round's torch._grouped_mm row, measured seconds before it)."""
    by_key: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get(SPEEDUP):
            impl = r["impl"].split(" (")[0]
            key = (impl, r["label"], r["B"], r["M"], r["N"], r["K"])
            by_key.setdefault(key, []).append(r[SPEEDUP])
    out: dict[str, list[float]] = {}
    for (impl, *_), values in by_key.items():
        out.setdefault(impl, []).append(float(torch.tensor(values).median()))
    return out


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure every shape N times (all impls per round, so clock / power drift hits them alike); "
        "the summary takes each shape's median speedup",
    )  # fmt: skip
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_grouped_gemm: needs a CUDA device")
    if args.rounds < 1:
        sys.exit(f"bench_grouped_gemm: --rounds must be >= 1, got {args.rounds}")
    device = torch.device("cuda")
    if args.quick:
        REP.update(warmup_ms=10, rep_ms=40)
    rows = []
    for model, layer, e, n_rows, n, k, dist in configs(args.quick):
        for rnd in range(args.rounds):
            for row in run_shape((model, layer, e, n_rows, n, k), dist, args.quick, device):
                rows.append({**row, "round": rnd})
            torch.cuda.empty_cache()
    name = "grouped_gemm_quick.csv" if args.quick else "grouped_gemm.csv"
    write_csv(out_dir(args) / name, rows, COLUMNS + ["round"])
    short = ["label", "B", "M", "N", "K", "Check", "Forward TFLOPS", "Backward TFLOPS", "Dgrad TFLOPS"]
    print_table(rows, short + ["Wgrad TFLOPS", SPEEDUP])
    print(f"\ngeomean fwd+bwd speedup vs torch._grouped_mm (per shape: median of {args.rounds} round(s)):")
    for impl, sp in sorted(median_speedups(rows).items()):
        print(f"  {impl:24s} {geomean(sp):.3f}x  (min {min(sp):.3f}x)")


if __name__ == "__main__":
    main()
