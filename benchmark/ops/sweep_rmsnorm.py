"""RMSNorm forward kernel sweep in GPU time (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_rmsnorm.py [--out DIR]

``triton.testing.do_bench_cudagraph`` medians (no host overhead) of: the TURBO (csrc) forward and
backward, the TRITON one-pass forward over (BLOCK_M, num_warps) and the rows kernel (2049-8192 columns)
over (CHUNK, num_warps), torch.compile of the same fp32 math (forward alone under no_grad; its backward
through autograd, timed by do_bench when the graph capture declines), and the device-to-device copy of x.
A second table times the forwards with L2 flushed before every call (a graph of a 256 MB memset and the
kernel, less the memset's graph): graph replays without a flush keep part of x in L2 from call to call.
Every Triton variant's y is checked against the one-pass default's (bf16 tolerance). Candidates measured
and dropped (eviction hints on the one-pass kernel, two passes with a runtime row length): results in
benchmark/results/h200/sweep_rmsnorm_*.txt.
Writes DIR/sweep_rmsnorm.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION, cpp_ops  # noqa: E402
from primus_turbo.triton.normalization.rmsnorm_kernel import (  # noqa: E402
    rmsnorm_fwd_kernel,
    rmsnorm_fwd_rows_kernel,
    tile_config,
)

EPS = 1e-6
SHAPES = [(8192, 2048), (16384, 4096), (8192, 7168), (32768, 7168), (16384, 8192)]


def _us(fn) -> float:
    return tt.do_bench_cudagraph(fn, return_mode="median") * 1e3


_FLUSH = []


def _us_flushed(fn) -> float:
    """GPU time of fn with L2 flushed before each call: a graph of (256 MB memset, fn) minus the memset's."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    cache = _FLUSH[0]
    return _us(lambda: (cache.zero_(), fn())) - _us(cache.zero_)


def _math(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def sweep_shape(rows: int, hidden: int, report: io.StringIO) -> None:
    torch._dynamo.reset()
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(hidden, device="cuda") * 0.1 + 1.0).to(torch.bfloat16)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device="cuda")
    buf = torch.empty_like(x)
    copy_us = _us(lambda: buf.copy_(x))
    copy_gbps = 2 * x.numel() * 2 / copy_us / 1e3
    fwd_bytes = 2 * x.numel() * 2 + rows * 4
    bwd_bytes = 3 * x.numel() * 2 + rows * 4

    def pct(nbytes, us):
        return 100 * nbytes / us / 1e3 / copy_gbps

    compiled = torch.compile(_math, dynamic=False)
    with torch.no_grad():
        compiled(x, w)
        c_fwd = _us(lambda: compiled(x, w))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = compiled(xg, wg)
    try:  # the autograd engine may run the backward off the capturing stream
        c_bwd = _us(lambda: torch.autograd.grad(out, [xg, wg], dy, retain_graph=True))
    except Exception:  # noqa: BLE001
        torch.cuda.synchronize()
        c_bwd = 1e3 * tt.do_bench(
            lambda: torch.autograd.grad(out, [xg, wg], dy, retain_graph=True), return_mode="median"
        )
        report.write("\n(torch.compile backward: do_bench, not CUDA-graph timing)\n")
    report.write(
        f"\n### {rows} x {hidden} bf16; copy {copy_gbps:.0f} GB/s\n\n| kernel | fwd us | fwd %copy |"
        " fwd vs compile | bwd us | bwd %copy | bwd vs compile |\n|---|---|---|---|---|---|---|\n"
    )
    report.write(
        f"| torch.compile | {c_fwd:.1f} | {pct(fwd_bytes, c_fwd):.0f} | 1.00 | {c_bwd:.1f} | "
        f"{pct(bwd_bytes, c_bwd):.0f} | 1.00 |\n"
    )
    if HAS_CPP_EXTENSION:
        ops = cpp_ops()
        t_fwd = _us(lambda: ops.rmsnorm_fwd(x, w, EPS, False))
        r = ops.rmsnorm_fwd(x, w, EPS, False)[1]
        t_bwd = _us(lambda: ops.rmsnorm_bwd(dy, x, w, r, None, False))
        report.write(
            f"| TURBO (csrc) | {t_fwd:.1f} | {pct(fwd_bytes, t_fwd):.0f} | {c_fwd / t_fwd:.2f} | "
            f"{t_bwd:.1f} | {pct(bwd_bytes, t_bwd):.0f} | {c_bwd / t_bwd:.2f} |\n"
        )

    # Back-to-back graph replays keep part of x in L2 across calls (compile's first pass loads it with
    # evict_last); with L2 flushed before every call, as in training where x comes from another op:
    flushed = {"copy": _us_flushed(lambda: buf.copy_(x))}
    with torch.no_grad():
        flushed["torch.compile"] = _us_flushed(lambda: compiled(x, w))
    if HAS_CPP_EXTENSION:
        flushed["TURBO (csrc)"] = _us_flushed(lambda: ops.rmsnorm_fwd(x, w, EPS, False))
    if 2048 < hidden <= 8192:
        chunk = triton.next_power_of_2(hidden)
        warps = 16 if hidden > 4096 else 8

        def rows_fwd():
            rmsnorm_fwd_rows_kernel[(rows,)](
                x, x, w, y, y, rstd, EPS, N_COLS=hidden, HAS_RESIDUAL=False, ZERO_CENTERED=False, CHUNK=chunk,
                num_warps=warps, num_stages=1,
            )  # fmt: skip

        flushed[f"TRITON rows {chunk} w{warps}"] = _us_flushed(rows_fwd)
    report.write(
        "\nForward with L2 flushed before each call (graph time minus the flush's):\n\n"
        "| kernel | fwd us | fwd %copy (flushed copy) | vs compile |\n|---|---|---|---|\n"
    )
    for name, us in flushed.items():
        nbytes = 2 * x.numel() * 2 if name == "copy" else fwd_bytes
        report.write(
            f"| {name} | {us:.1f} | {100 * nbytes / us / (2 * x.numel() * 2 / flushed['copy']):.0f} | "
            f"{flushed['torch.compile'] / us:.2f} |\n"
        )
    report.write(
        "\n| kernel (graph replays, no flush) | fwd us | fwd %copy | fwd vs compile | bwd us | bwd %copy "
        "| bwd vs compile |\n|---|---|---|---|---|---|---|\n"
    )

    def launch(kind, block, warps):
        if kind == "rows":
            rmsnorm_fwd_rows_kernel[(rows,)](
                x, x, w, y, y, rstd, EPS, N_COLS=hidden, HAS_RESIDUAL=False, ZERO_CENTERED=False, CHUNK=block,
                num_warps=warps, num_stages=1,
            )  # fmt: skip
        else:
            rmsnorm_fwd_kernel[(triton.cdiv(rows, block),)](
                x, x, w, y, y, rstd, rows, hidden, EPS, HAS_RESIDUAL=False, ZERO_CENTERED=False,
                BLOCK_M=block, BLOCK_N=triton.next_power_of_2(hidden), num_warps=warps,
            )  # fmt: skip

    default = tile_config(hidden, rows)
    launch("one-pass", default[0], default[2])
    want = y.clone()
    variants = [("one-pass", m, wp) for m in (1, 2, 4) for wp in (4, 8, 16)]
    full = triton.next_power_of_2(hidden)
    variants += [("rows", c, wp) for c in dict.fromkeys((2048, full)) for wp in (8, 16)]
    for kind, block, warps in variants:
        tile = block if kind == "rows" else block * triton.next_power_of_2(hidden)
        if tile > 32768 or tile < 32 * warps or (kind == "rows" and block > triton.next_power_of_2(hidden)):
            continue
        try:
            y.zero_()
            launch(kind, block, warps)
            ok = torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)
            us = _us(lambda k=kind, b=block, wp=warps: launch(k, b, wp))
        except Exception as exc:  # noqa: BLE001 (a variant that does not compile is a result too)
            report.write(f"| TRITON {kind} {block} w{warps} | {type(exc).__name__} | | | | | |\n")
            continue
        tag = " (default)" if (kind, block, warps) == ("one-pass", default[0], default[2]) else ""
        report.write(
            f"| TRITON {kind} {block} w{warps}{tag} | {us:.1f} | {pct(fwd_bytes, us):.0f} | {c_fwd / us:.2f} "
            f"| | | {'' if ok else 'MISMATCH'} |\n"
        )
        print(rows, hidden, kind, block, warps, f"{us:.1f}", ok, flush=True)


def main() -> None:
    run_sweep(__doc__, "sweep_rmsnorm", "RMSNorm sweep (GPU time)", SHAPES, sweep_shape)


if __name__ == "__main__":
    main()
