"""Shared benchmark plumbing: timing, FLOP/byte accounting, CSV schema, run metadata.

Every bench script times turbo and the best torch path in the same process on the same inputs
with ``triton.testing.do_bench`` medians, and writes one CSV plus a ``<name>.meta.json`` (device,
versions, date, commit) into ``--out`` (default ``benchmark/results/<gpu>/``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

GEMM_COLUMNS = [
    "label",
    "B",
    "M",
    "N",
    "K",
    "Check",
    "Forward TFLOPS",
    "Forward TFLOPS_stddev",
    "Backward TFLOPS",
    "Backward TFLOPS_stddev",
    "Forward Time (ms)",
    "Backward Time (ms)",
    "out_snr",
    "da_snr",
    "db_snr",
]
MEMORY_COLUMNS = [
    "label",
    "shape",
    "dtype",
    "Check",
    "Forward GB/s",
    "Forward Time (ms)",
    "Backward GB/s",
    "Backward Time (ms)",
]


def gpu_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "h800", "h20", "a100", "b200"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


def git_commit(repo: Path) -> str:
    """The commit a result belongs to: PRIMUS_TURBO_COMMIT when set, else HEAD, with "+dirty" when tracked
    files differ from it, else "unknown". The device tool's copy of the tree may carry a stale .git: its
    HEAD is an older commit while the files are newer, which reads as "<old>+dirty", never as <old>."""
    if os.environ.get("PRIMUS_TURBO_COMMIT"):
        return os.environ["PRIMUS_TURBO_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=repo, timeout=10
        ).stdout.strip()

    try:
        head = git("rev-parse", "--verify", "-q", "HEAD")
        dirty = bool(head) and bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + "+dirty" if dirty else head) or "unknown"


def run_metadata() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(Path(__file__).parent),
    }


def bench_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help="output folder (default benchmark/results/<gpu>)")
    p.add_argument("--quick", action="store_true", help="a few shapes only (smoke run)")
    return p


def run_sweep(doc: str, name: str, title: str, cases, sweep_case) -> None:
    """Main of the sweep scripts (diagnosis tools): parse ``--out`` / ``--quick`` (the first case only),
    require CUDA, run ``sweep_case(*case, report)`` per case into one markdown report headed by the device
    and versions, print each case as it finishes and rewrite DIR/<name>.txt after it (a device call cut
    short keeps what was measured). A case that raises is reported as stopped and the sweep goes on."""
    import io

    import triton

    args = bench_parser(doc.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{name}: needs a CUDA device")
    report = io.StringIO()
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    report.write(f"# {title} on {torch.cuda.get_device_name()}, {versions}\n")
    path = out_dir(args) / f"{name}.txt"
    for case in cases[:1] if args.quick else cases:
        part = io.StringIO()
        try:
            sweep_case(*case, part)
        except Exception as e:  # a faulting candidate can poison the CUDA context: keep what was measured
            label = case[0] if isinstance(case, (tuple, list)) else case
            part.write(f"\n{label}: stopped by {type(e).__name__}: {str(e).splitlines()[0][:200]}\n")
        print(part.getvalue(), flush=True)
        report.write(part.getvalue())
        path.write_text(report.getvalue())


def out_dir(args) -> Path:
    d = args.out or Path(__file__).resolve().parents[1] / "results" / gpu_slug()
    d.mkdir(parents=True, exist_ok=True)
    return d


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> tuple[float, float]:
    """(median ms, stddev ms) with triton.testing.do_bench (CUDA events, cache flushed)."""
    import triton.testing

    times = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")
    t = torch.tensor(times, dtype=torch.float64)
    return float(t.median()), float(t.std()) if t.numel() > 1 else 0.0


def gpu_paced_ms(fn, calls: int = 20, repeats: int = 3, sleep_ms: float = 40.0) -> float:
    """Median ms per call of ``fn`` with the host ahead of the GPU: a sleep kernel is queued first, then
    ``calls`` calls back to back between two CUDA events, so the GPU runs them without waiting for Python
    (no cache flush between calls). The time a call costs inside a GPU-paced training step, where do_bench's
    per-call number (cache flushed before each call, the call's host time exposed once it passes the flush)
    also charges the host. ``sleep_ms`` must cover the host time of ``calls`` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    cycles = int(sleep_ms * 1e-3 * 2.0e9)  # H100/H200 SM clocks are <= 1.98 GHz: the sleep lasts >= sleep_ms
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str = "cuda") -> float:
    """Device-to-device copy GB/s of a 1 GiB buffer: the ceiling for memory-bound rows."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _ = bench_ms(lambda: dst.copy_(src))
    return gbps(2 * src.numel(), ms)


def host_ms(step, n: int = 10, warmup: int = 1) -> float:
    """Host ms to issue one call of ``step`` (no sync inside the loop): when it reaches the GPU
    time, the call is host bound and do_bench's number is Python overhead, not kernels."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) * 1e3 / n
    sync()
    return host


def tflops(flop: float, ms: float) -> float:
    return flop / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def write_csv(path: Path, rows: list[dict], columns: list[str] | None = None) -> None:
    columns = columns or list(rows[0].keys())
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)
    meta = run_metadata()
    Path(str(path).rsplit(".", 1)[0] + ".meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"wrote {path} ({len(rows)} rows) on {meta['device']}")


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)
