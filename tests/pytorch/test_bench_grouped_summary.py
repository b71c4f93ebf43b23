"""bench_grouped_gemm --rounds: per (impl, shape) the median over rounds, one value per shape."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "ops"))
import bench_grouped_gemm as bench  # noqa: E402


def _row(label, impl, m, speedup):
    return {"label": label, "impl": impl, "B": 8, "M": m, "N": 64, "K": 32, bench.SPEEDUP: speedup}


def test_median_over_rounds_per_shape():
    """Two shapes share a label (same model, layer, distribution; different token counts) and the impl's
    backend suffix changes between rounds: still one median per shape; baseline rows (no speedup) ignored."""
    rows = []
    for a, b in [(1.0, 1.2), (1.3, 0.7), (0.9, 1.0)]:
        rows.append(_row("x-fc1 turbo auto balanced", "turbo auto (fwd TRITON)", 1024, a))
        rows.append(_row("x-fc1 turbo auto balanced", "turbo auto (fwd CUTLASS)", 4096, b))
        rows.append(_row("x-fc1 torch._grouped_mm balanced", "torch._grouped_mm", 1024, None))
    assert sorted(bench.median_speedups(rows)["turbo auto"]) == [1.0, 1.0]
    assert set(bench.median_speedups(rows)) == {"turbo auto"}
