"""Loss-curve gaps between finished runs: each run's mean loss per step window against a reference run.

    python benchmark/e2e/loss_gaps.py REF.jsonl RUN.jsonl [RUN.jsonl ...] [--parts 6]

Prints a markdown table (window, reference mean loss, each run's gap in %) and the smoothed final loss
(mean of the last 10% of steps, at most 50) of every run. Use it on parity runs made in separate calls
(e.g. a benign perturbation of the reference, such as ``turbo.gemm=false``, to read off the noise floor
of the parity metric at that horizon). A run whose learning rate differs from the reference's at the same
steps (another ``train.steps``, so another cosine schedule, or another ``train.lr``) gets a note under the
table: its gaps mix the schedule in.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report import gap_windows, load_metrics, markdown_table, smoothed_final_loss  # noqa: E402


def run_name(path: str, taken) -> str:
    """A run's column name: its folder above runs/ (compare.py's layout), else the file name."""
    p = Path(path)
    name = p.parent.parent.name if p.parent.name == "runs" else p.stem
    return name if name not in taken else str(p)


def gap_table(ref: list[dict], runs: dict[str, list[dict]], parts: int) -> str:
    columns = {name: gap_windows(ref, rows, parts) for name, rows in runs.items()}
    windows = next(iter(columns.values()))
    body = []
    for i, w in enumerate(windows):
        row = [f"{w['first']}-{w['last']}", f"{w['bf16']:.4f}"]
        row += [f"{100 * col[i]['gap']:+.2f}%" if i < len(col) else "n/a" for col in columns.values()]
        body.append(row)
    finals = ["smoothed final", f"{smoothed_final_loss(ref):.4f}"]
    finals += [f"{smoothed_final_loss(rows):.4f}" for rows in runs.values()]
    return markdown_table(["steps", "reference loss", *runs], body + [finals])


def schedule_note(name: str, ref: list[dict], rows: list[dict]) -> str | None:
    """A note when ``rows`` ran another learning-rate schedule than ``ref`` (their ``lr`` at the same steps),
    or another number of steps; None when they match."""
    ref_lr = {r["step"]: r.get("lr") for r in ref}
    common = [(r["step"], ref_lr[r["step"]], r.get("lr")) for r in rows if r["step"] in ref_lr]
    differ = [
        (s, a, b)
        for s, a, b in common
        if a is not None and b is not None and not math.isclose(a, b, rel_tol=1e-6)
    ]
    problems = []
    if differ:
        s, a, b = max(differ, key=lambda d: abs(d[2] - d[1]) / abs(d[1]) if d[1] else math.inf)
        problems.append(
            f"learning rate differs from the reference's at {len(differ)} of {len(common)} common steps "
            f"(most at step {s}: {b:.3g} vs {a:.3g})"
        )
    if rows[-1]["step"] != ref[-1]["step"]:
        problems.append(f"ran to step {rows[-1]['step']}, the reference to step {ref[-1]['step']}")
    if not problems:
        return None
    return (
        f"note: {name}: " + "; ".join(problems) + ": its gaps mix the schedule in with what the run changed"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ref", help="reference run's metrics jsonl")
    parser.add_argument("runs", nargs="+", help="other runs' metrics jsonl")
    parser.add_argument("--parts", type=int, default=6, help="equal step windows (default 6)")
    args = parser.parse_args(argv)
    if args.parts < 1:
        parser.error(f"--parts must be >= 1, got {args.parts}")
    ref = load_metrics(args.ref)
    if not ref:
        parser.error(f"{args.ref}: no loss rows")
    runs = {}
    for path in args.runs:
        rows = load_metrics(path)
        if not rows:
            parser.error(f"{path}: no loss rows")
        runs[run_name(path, runs)] = rows
    print(gap_table(ref, runs, args.parts))
    notes = [note for name, rows in runs.items() if (note := schedule_note(name, ref, rows))]
    if notes:
        print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
