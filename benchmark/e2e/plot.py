"""report.png for benchmark/e2e/compare.py: median step-time bars and loss curves, side by side.

matplotlib is optional (the GPU box has it; the CPU dev/CI environment may not): ``write_plot`` returns a note
instead of a path when it is missing, and the report says so.
"""

from __future__ import annotations

from pathlib import Path

from report import RunResult, summarize


def write_plot(out_dir: str | Path, results: list[RunResult], warmup: int) -> tuple[Path | None, str]:
    """Draw report.png; returns (path, "") or (None, why no plot was drawn)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed, no report.png (pip install matplotlib, then re-run)"
    ok = [r for r in results if r.status == "ok" and r.rows]
    if not ok:
        return None, "no successful configuration to plot"
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [r.label for r in ok]
    times = [summarize(r.rows, warmup)["step_time_ms"] for r in ok]
    colors = [("tab:orange" if r.precision == "fp8" else "tab:blue") if r.turbo else "tab:gray" for r in ok]
    bars.barh(labels, times, color=colors)
    for y, t in enumerate(times):
        bars.text(t, y, f" {t:.0f}", va="center", fontsize=8)
    bars.invert_yaxis()
    bars.set_xlabel(f"median step time after {warmup} warm-up steps (ms)")
    bars.set_title("step time (lower is better)")
    for r in ok:
        style = "-" if r.turbo else "--"
        curves.plot([row["step"] for row in r.rows], [row["loss"] for row in r.rows], style, label=r.label)
    curves.set_xlabel("step")
    curves.set_ylabel("loss")
    curves.set_title("training loss")
    curves.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, ""
