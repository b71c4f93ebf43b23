"""RMSNorm forward and backward GB/s: turbo TURBO (csrc CUDA), turbo TRITON, torch eager
(torch.nn.functional.rms_norm) and torch.compile of the same fp32 math, same process, same inputs,
plus the measured device-to-device copy bandwidth of this GPU in the same run.

    python benchmark/ops/bench_rmsnorm.py --quick   # 2 shapes, < 60 s on an H200 incl. compiles
    python benchmark/ops/bench_rmsnorm.py           # tokens {8192, 16384, 32768} x hidden
                                                    # {2048, 4096, 7168, 8192} + residual variant
    python benchmark/ops/bench_rmsnorm.py --shapes 8192x2048,16384x7168r   # these only (r: + residual)

Bytes moved (each input read once, each output written once): forward x, weight -> y, rstd;
backward dy, x, weight, rstd -> dx, dweight; the residual variant adds residual (read) and
x + residual (written) forward, d(sum) (read) backward. Backward time is the autograd backward
alone (retain_graph), for every label. "turbo auto" is backend=None (the dispatcher's per-stage
pick). Check: turbo y, dx, dweight vs an fp32 reference at the bf16 tolerance (rtol = atol =
1e-2). "host fwd/bwd us": the host time to issue one call (no sync): where it reaches the GPU time
the row is bound by launch cost, not HBM. Targets (H200): TURBO >= 1.0x torch.compile and >= 85% of
the copy bandwidth, forward and backward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    MEMORY_COLUMNS,
    bench_ms,
    bench_parser,
    copy_bandwidth,
    gbps,
    gpu_paced_ms,
    host_ms,
    out_dir,
    print_table,
    write_csv,
)

import primus_turbo.pytorch as turbo  # noqa: E402
from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION  # noqa: E402

EPS = 1e-6
# GPU-paced GB/s (bench_utils.gpu_paced_ms: the host ahead, calls back to back): where the host time of a
# call passes do_bench's per-call cache flush, do_bench times the host too (the small shapes). Back to back,
# part of an input that fits L2 may still be there from the previous call: compare labels, not the copy.
PACED = ["Forward GB/s (GPU-paced)", "Backward GB/s (GPU-paced)"]
# The same bytes as one device-to-device copy (half read, half written), timed the same two ways: a copy of a
# shape's 64-200 MB runs below the 1 GiB copy (fixed launch and tail cost, part of it in L2 when paced), so
# "%same-size copy" is the like-for-like share; "%copy" stays against the 1 GiB copy, the bar.
SAME_COPY = ["paced fwd %same-size copy", "paced bwd %same-size copy"]
DEVICE = "cuda"  # a CPU smoke run of the plumbing sets "cpu"


def shapes(quick: bool) -> list[tuple[int, int, bool]]:
    """(tokens, hidden, residual)."""
    if quick:
        return [(16384, 4096, False), (16384, 7168, False)]
    plain = [(t, h, False) for t in (8192, 16384, 32768) for h in (2048, 4096, 7168, 8192)]
    return plain + [(16384, 4096, True), (16384, 7168, True)]


def rmsnorm_math(x, w):
    """The reference math torch.compile fuses: fp32 statistics, output in x.dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def residual_math(x, r, w):
    s = x + r
    return rmsnorm_math(s, w), s


def candidates(residual: bool) -> dict:
    compiled = torch.compile(residual_math if residual else rmsnorm_math, dynamic=False)
    out = {}
    # "auto": backend=None, the dispatcher's default (TURBO; TRITON forward above 128M elements)
    for name in ("TURBO", "TRITON", None):
        if name == "TURBO" and not HAS_CPP_EXTENSION:
            continue
        if residual:
            out[f"turbo {name or 'auto'}"] = lambda x, r, w, b=name: turbo.ops.rmsnorm_residual(
                x, r, w, EPS, backend=b
            )
        else:
            out[f"turbo {name or 'auto'}"] = lambda x, r, w, b=name: turbo.ops.rmsnorm(x, w, EPS, backend=b)
    if residual:

        def eager_residual(x, r, w):
            s = x + r
            return torch.nn.functional.rms_norm(s, (x.shape[-1],), w, EPS), s

        out["torch eager (add + F.rms_norm)"] = eager_residual
    else:
        out["torch eager (F.rms_norm)"] = lambda x, r, w: torch.nn.functional.rms_norm(
            x, (x.shape[-1],), w, EPS
        )
    out["torch.compile"] = lambda x, r, w: compiled(x, r, w) if residual else compiled(x, w)
    return out


def io_bytes(tokens: int, hidden: int, elem: int, residual: bool) -> tuple[int, int]:
    act, vec, rstd = tokens * hidden * elem, hidden * elem, tokens * 4
    fwd = 2 * act + vec + rstd + (2 * act if residual else 0)
    bwd = 3 * act + 2 * vec + rstd + (act if residual else 0)
    return fwd, bwd


def same_size_copy_gbps(nbytes: int) -> float:
    """GPU-paced GB/s of a device-to-device copy that reads nbytes / 2 and writes nbytes / 2."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return gbps(2 * src.numel(), gpu_paced_ms(lambda: dst.copy_(src)))


def check(outputs, ref_outputs) -> str:
    for out, ref in zip(outputs, ref_outputs):
        if not torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2):
            return "FAIL"
    return "PASS"


def run_shape(tokens: int, hidden: int, residual: bool, dtype=torch.bfloat16) -> list[dict]:
    torch._dynamo.reset()
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True) if residual else None
    w = (torch.randn(hidden, device=DEVICE) * 0.1 + 1.0).to(dtype).requires_grad_()
    inputs = [x, w] + ([r] if residual else [])
    dy = torch.randn_like(x)
    grads_out = [dy, torch.randn_like(x)] if residual else [dy]
    fwd_bytes, bwd_bytes = io_bytes(tokens, hidden, x.element_size(), residual)

    # fp32 reference for the Check column; the residual sum is rounded to x.dtype first, as the
    # unfused ops (and turbo) do, and d(x) = d(residual) = d(sum).
    x_ref = ((x + r) if residual else x).detach().float().requires_grad_()
    w_ref = w.detach().float().requires_grad_()
    ref_out = (rmsnorm_math(x_ref, w_ref), x_ref) if residual else (rmsnorm_math(x_ref, w_ref),)
    torch.autograd.backward(ref_out, [g.float() for g in grads_out])
    ref_all = [o.detach() for o in ref_out] + [x_ref.grad, w_ref.grad] + ([x_ref.grad] if residual else [])

    rows = []
    shape = f"{tokens}x{hidden}" + (" +residual" if residual else "")
    for label, fn in candidates(residual).items():
        out = fn(x, r, w)
        out = out if isinstance(out, tuple) else (out,)
        grads = torch.autograd.grad(out, inputs, grads_out, retain_graph=True)
        status = check([*out, *grads], ref_all) if label.startswith("turbo") else ""
        # forward as training runs it (grad enabled, rstd saved); no_grad would also recompile torch.compile
        fwd_ms, _ = bench_ms(lambda fn=fn: fn(x, r, w))
        bwd = lambda out=out: torch.autograd.grad(out, inputs, grads_out, retain_graph=True)  # noqa: E731
        bwd_ms, _ = bench_ms(bwd)
        rows.append(
            {
                "label": label,
                "shape": shape,
                "dtype": str(dtype).replace("torch.", ""),
                "Check": status,
                "Forward GB/s": gbps(fwd_bytes, fwd_ms),
                "Forward Time (ms)": fwd_ms,
                "Backward GB/s": gbps(bwd_bytes, bwd_ms),
                "Backward Time (ms)": bwd_ms,
                "host fwd us": 1e3 * host_ms(lambda fn=fn: fn(x, r, w)),
                "host bwd us": 1e3 * host_ms(bwd),
                PACED[0]: gbps(fwd_bytes, gpu_paced_ms(lambda fn=fn: fn(x, r, w))),
                PACED[1]: gbps(bwd_bytes, gpu_paced_ms(bwd)),
            }
        )
    compiled = next(row for row in rows if row["label"] == "torch.compile")
    copy_fwd, copy_bwd = same_size_copy_gbps(fwd_bytes), same_size_copy_gbps(bwd_bytes)
    for row in rows:
        row[SAME_COPY[0]] = 100 * row[PACED[0]] / copy_fwd
        row[SAME_COPY[1]] = 100 * row[PACED[1]] / copy_bwd
        row["fwd vs compile"] = row["Forward GB/s"] / compiled["Forward GB/s"]
        row["bwd vs compile"] = row["Backward GB/s"] / compiled["Backward GB/s"]
        row["paced fwd vs compile"] = row[PACED[0]] / compiled[PACED[0]]
        row["paced bwd vs compile"] = row[PACED[1]] / compiled[PACED[1]]
    return rows


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="", help="TOKENSxHIDDEN[r],...: only these (r: residual)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rmsnorm: needs a CUDA device")
    copy_gbps = copy_bandwidth(DEVICE)
    rows = []
    picked = [(*map(int, s.rstrip("r").split("x")), s.endswith("r")) for s in args.shapes.split(",") if s]
    picked = picked or shapes(args.quick)
    for tokens, hidden, residual in picked:
        rows += run_shape(tokens, hidden, residual)
    for row in rows:
        row["fwd %copy"] = 100 * row["Forward GB/s"] / copy_gbps
        row["bwd %copy"] = 100 * row["Backward GB/s"] / copy_gbps
        row["paced fwd %copy"] = 100 * row[PACED[0]] / copy_gbps
        row["paced bwd %copy"] = 100 * row[PACED[1]] / copy_gbps
    rows.append({"label": "copy (d2d, 1 GiB)", "shape": "1073741824 B", "dtype": "uint8", "Check": "",
                 "Forward GB/s": copy_gbps, "Backward GB/s": copy_gbps})  # fmt: skip
    name = "rmsnorm_shapes.csv" if args.shapes else "rmsnorm_quick.csv" if args.quick else "rmsnorm.csv"
    extra = ["host fwd us", "host bwd us", *PACED, "paced fwd vs compile", "paced bwd vs compile"]
    extra += ["paced fwd %copy", "paced bwd %copy", *SAME_COPY]
    write_csv(out_dir(args) / name, rows, MEMORY_COLUMNS + extra)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    table = ["label", "shape", "Check", "Forward GB/s", "fwd %copy", "fwd vs compile"]
    table += ["Backward GB/s", "bwd %copy", "bwd vs compile", "paced fwd vs compile", "paced bwd vs compile"]
    table += ["paced fwd %copy", "paced bwd %copy", *SAME_COPY]  # the host us columns: in the CSV
    print_table(rows[:-1], table)


if __name__ == "__main__":
    main()
