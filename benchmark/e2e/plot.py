"""report.png for benchmark/e2e/compare.py: median step-time bars and loss curves, side by side.

matplotlib is optional (the GPU box has it; the CPU dev/CI environment may not): ``write_plot`` returns a note
instead of a path when it is missing, and the report says so.
"""

from __future__ import annotations

from pathlib import Path

from report import FP8_PARITY_TARGET, RunResult, parity_pairs, summarize


def _parity_gap(results: list[RunResult]) -> tuple[list[int], list[float]] | None:
    """Per-step (fp8 - bf16) / bf16 loss in %, rolling mean over 5% of the steps; None without a pair."""
    pairs = parity_pairs(results)
    if not pairs:
        return None
    pair = pairs[0]
    bf16 = {row["step"]: row["loss"] for row in pair[0].rows}
    steps = [row["step"] for row in pair[1].rows if row["step"] in bf16]
    gap = [100 * (row["loss"] - bf16[row["step"]]) / bf16[row["step"]] for row in pair[1].rows
           if row["step"] in bf16]  # fmt: skip
    window = max(1, len(gap) // 20)
    smooth = [sum(gap[max(0, i - window + 1) : i + 1]) / len(gap[max(0, i - window + 1) : i + 1])
              for i in range(len(gap))]  # fmt: skip
    return steps, smooth


def write_plot(
    out_dir: str | Path, results: list[RunResult], warmup: int, parity: bool = False
) -> tuple[Path | None, str]:
    """Draw report.png (parity: plus the fp8-vs-bf16 loss gap); returns (path, "") or (None, why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "matplotlib is not installed, no report.png (pip install matplotlib, then re-run)"
    ok = [r for r in results if r.status == "ok" and r.rows]
    if not ok:
        return None, "no successful configuration to plot"
    gap = _parity_gap(results) if parity else None
    fig, axes = plt.subplots(1, 3 if gap else 2, figsize=(19 if gap else 13, 4.8))
    bars, curves = axes[0], axes[1]
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
    if gap:
        axes[2].plot(*gap, color="tab:orange")
        axes[2].axhline(100 * FP8_PARITY_TARGET, color="tab:red", linestyle="--", label="target")
        axes[2].axhline(0, color="gray", linewidth=0.5)
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("(fp8 - bf16) / bf16 loss (%)")
        axes[2].set_title("FP8 convergence gap (rolling mean)")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "report.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, ""
