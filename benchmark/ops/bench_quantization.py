"""FP8 quantization bandwidth: turbo Triton kernels vs torch eager and torch.compile of the same math,
with the device's copy bandwidth measured in the same run.

    python benchmark/ops/bench_quantization.py --quick   # 1 shape, < 60 s on an H200
    python benchmark/ops/bench_quantization.py           # 3 shapes

Rows: granularity x {plain, +transpose (both K-major copies, one call)}; "rowwise csrc" and "rowwise
csrc+transpose" are the CUDA C++ kernels (backend "turbo", the default on CUDA when the extension is
built) where "rowwise" is the Triton one. With the transpose, two reads of x are the floor (the column
scales need the whole column before the first cast): at most 4/6 of copy bandwidth in these GB/s.
"host us" is the host time to issue one call (no sync): what a training step pays when the GPU is not
the bottleneck. "two-pass" is what a caller does without the fused variant: quantize x, then quantize
x.t().contiguous().
GB/s counts logical bytes: bf16 read once + FP8 written (once, or twice with the transpose) +
scales. Targets (H200): turbo >= 1.0x torch.compile and >= 90% of copy bandwidth (copy ~4.2 TB/s);
fused transpose faster than two-pass.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, gbps, host_ms, out_dir, print_table, write_csv  # noqa: E402

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION  # noqa: E402
from primus_turbo.pytorch.kernels.quantization import quantization_impl as impl  # noqa: E402
from primus_turbo.pytorch.ops.quantization import normalize_spec  # noqa: E402

E4M3 = torch.float8_e4m3fn
SPECS = {  # label: (granularity, block_size)
    "tensorwise": ("TENSORWISE", None),
    "rowwise": ("ROWWISE", None),
    "block1x128": ("BLOCKWISE", 128),
    "block128x128": ("BLOCKWISE", (128, 128)),
}
COLUMNS = [
    "label",
    "shape",
    "dtype",
    "Check",
    "Forward GB/s",
    "Forward Time (ms)",
    "torch GB/s",
    "compile GB/s",
    "copy GB/s",
    "vs compile",
    "% of copy",
    "two-pass GB/s",
    "host us",
]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke runs only


def _quantizer(spec, transpose: bool, backend: str):
    g, ax, br, bc = normalize_spec(2, spec[0], spec[1], None)
    if transpose:
        return lambda x: impl.quantize_fp8_with_transpose_impl(x, E4M3, g, br, bc, False, backend)
    return lambda x: impl.quantize_fp8_impl(x, E4M3, g, ax, br, bc, False, backend)


def _check(turbo_out, torch_out) -> str:
    for a, b in zip(turbo_out, torch_out):
        if a.dtype == E4M3:
            if (a.float() != b.float()).float().mean() > 1e-3:
                return "FAIL"
        elif not torch.allclose(a, b, rtol=1e-5, atol=0):
            return "FAIL"
    return "PASS"


def io_bytes(x: torch.Tensor, outputs) -> int:
    """Logical bytes of one quantize call: x read once, each distinct output (the FP8 copies and their scales;
    a tensorwise scale returned twice counts once) written once."""
    distinct = {id(t): t for t in outputs}.values()
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in distinct)


def _host_us(fn, n: int = 50) -> float:
    return 1e3 * host_ms(fn, n)


def run_shape(m: int, k: int, quick: bool = False) -> list[dict]:
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    copy_ms, _ = bench_ms(lambda: x.clone())
    copy_bw = gbps(2 * x.numel() * 2, copy_ms)
    rows = []
    variants = [(name, spec, t, "triton") for name, spec in SPECS.items() for t in (False, True)]
    if HAS_CPP_EXTENSION and DEVICE == "cuda":
        variants.insert(2, ("rowwise csrc", SPECS["rowwise"], False, "turbo"))
        variants.insert(5, ("rowwise csrc", SPECS["rowwise"], True, "turbo"))
    for name, spec, transpose, backend in variants:
        turbo_fn = _quantizer(spec, transpose, backend)
        torch_fn = _quantizer(spec, transpose, "torch")
        # --quick compiles the plain variants only (each torch.compile costs seconds). A fresh dynamo cache
        # per variant: the variants' lambdas share a code object, so past dynamo's recompile limit (8) the
        # compiled function ran eager: session 24's 16384x8192 "compile" column equals eager (100-133 GB/s)
        torch._dynamo.reset()
        compiled = None if (quick and transpose) else torch.compile(torch_fn, dynamic=False)
        nbytes = io_bytes(x, turbo_fn(x))
        t_ms, _ = bench_ms(lambda f=turbo_fn: f(x))
        e_ms, _ = bench_ms(lambda f=torch_fn: f(x))
        c_ms = bench_ms(lambda f=compiled: f(x))[0] if compiled else float("nan")
        row = {
            "label": f"{name}{'+transpose' if transpose else ''}",
            "shape": f"{m}x{k}",
            "dtype": "bf16->e4m3",
            "Check": _check(turbo_fn(x), torch_fn(x)),
            "Forward GB/s": gbps(nbytes, t_ms),
            "Forward Time (ms)": t_ms,
            "torch GB/s": gbps(nbytes, e_ms),
            "compile GB/s": gbps(nbytes, c_ms),
            "copy GB/s": copy_bw,
            "vs compile": c_ms / t_ms,
            "% of copy": 100 * gbps(nbytes, t_ms) / copy_bw,
            "host us": _host_us(lambda f=turbo_fn: f(x)),
        }
        if transpose:
            plain = _quantizer(spec, False, "triton")
            two_ms, _ = bench_ms(lambda plain=plain: (plain(x), plain(x.t().contiguous())))
            row["two-pass GB/s"] = gbps(nbytes, two_ms)
        rows.append(row)
        print_table([row], COLUMNS)
    return rows


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    shapes = [(8192, 4096)] if args.quick else [(8192, 4096), (8192, 7168), (16384, 8192)]
    rows = [r for m, k in shapes for r in run_shape(m, k, args.quick)]
    write_csv(out_dir(args) / "quantization.csv", rows, COLUMNS)
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
