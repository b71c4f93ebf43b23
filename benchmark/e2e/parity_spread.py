"""FP8-vs-bf16 final-loss gap over seeds and repeats, against the reference precision's own run-to-run spread.

    python benchmark/e2e/parity_spread.py [--ref bf16] FAMILY@SEED=RUN [FAMILY@SEED=RUN ...]

RUN is a metrics JSONL or a compare.py output folder (its runs/*.jsonl, exactly one). FAMILY names what is
compared (``bf16``, ``fp8_rowwise``, ...); runs of one family at one seed are repeats or benign perturbations
(another GEMM kernel, another accumulation order): they differ only by rounding. Prints three tables:

- per seed: each family's runs' final losses (mean of the last 10% of steps, at most 50) and their mean;
- per family: the gap of its seed mean to the reference family's seed mean, averaged over the seeds both ran,
  with its standard error over seeds (n/a with one seed);
- the noise floor: the reference family's spread between runs of one seed (pooled standard deviation of a
  single run's final loss, relative), which is how far one run may land from another that differs only by
  rounding. A single FP8-vs-bf16 pair resolves no gap much below ~1.4x that spread.

``compare.py parity=true seeds=a,b repeats=2`` reports the same statistics for the runs it launches; this
script is for runs made apart (several device calls, other overrides per family).

A run whose step count or learning-rate schedule differs from the first run's is refused: its loss is not
comparable (loss_gaps.py notes such a run; here it would bias the mean).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loss_gaps import schedule_note  # noqa: E402
from report import load_metrics, markdown_table, pooled_spread, seed_gaps, smoothed_final_loss  # noqa: E402


def parse_run(arg: str) -> tuple[str, str, Path]:
    """``FAMILY@SEED=PATH`` -> (family, seed, metrics path)."""
    head, sep, path = arg.partition("=")
    family, at, seed = head.partition("@")
    if not (sep and at and family and seed and path):
        raise SystemExit(f"parity_spread: run {arg!r}: expected FAMILY@SEED=PATH (e.g. bf16@4=OUT)")
    p = Path(path)
    if p.is_dir():
        found = sorted((p / "runs").glob("*.jsonl")) or sorted(p.glob("*.jsonl"))
        if len(found) != 1:
            raise SystemExit(f"parity_spread: {arg!r}: {p} holds {len(found)} metrics files, expected one")
        p = found[0]
    if not p.is_file():
        raise SystemExit(f"parity_spread: run {arg!r}: no such file {p}")
    return family, seed, p


def collect(args: list[str]) -> dict[str, dict[str, list[float]]]:
    """{seed: {family: [final loss per run]}} in the order given."""
    table: dict[str, dict[str, list[float]]] = {}
    first = None
    for arg in args:
        family, seed, path = parse_run(arg)
        rows = load_metrics(str(path))
        if not rows:
            raise SystemExit(f"parity_spread: run {arg!r}: no metrics rows in {path}")
        if first is None:
            first = (arg, rows)
        elif schedule_note(arg, first[1], rows) is not None:  # loss_gaps.py's same-schedule check
            raise SystemExit(
                f"parity_spread: run {arg!r} ran {len(rows)} steps or another learning-rate schedule than "
                f"{first[0]!r} ({len(first[1])} steps): final losses are not comparable"
            )
        table.setdefault(seed, {}).setdefault(family, []).append(smoothed_final_loss(rows))
    return table


def report(table, ref: str) -> str:
    families = list(dict.fromkeys(f for fams in table.values() for f in fams))
    if ref not in families:
        known = ", ".join(families)
        raise SystemExit(f"parity_spread: --ref {ref!r}: no run of that family (families: {known})")
    body = []
    for seed, fams in table.items():
        cells = [seed]
        for family in families:
            runs = fams.get(family, [])
            mean = f" (mean {statistics.fmean(runs):.4f})" if len(runs) > 1 else ""
            cells.append(" / ".join(f"{x:.4f}" for x in runs) + mean if runs else "-")
        body.append(cells)
    out = ["Final loss per run (mean of the last 10% of steps):", ""]
    out += [markdown_table(["seed", *families], body), ""]
    rows = []
    for family in families:
        if family == ref:
            continue
        gaps = list(seed_gaps(table, family, ref).values())
        if not gaps:
            rows.append([family, "0", "n/a", "n/a", "n/a"])
            continue
        se = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
        span = f"{100 * min(gaps):+.2f}% .. {100 * max(gaps):+.2f}%"
        mean = f"{100 * statistics.fmean(gaps):+.2f}%"
        rows.append([family, str(len(gaps)), mean, "n/a" if se is None else f"{100 * se:.2f}%", span])
    out += [f"Gap of each family's seed mean to {ref}'s seed mean:", ""]
    out += [markdown_table(["family", "seeds", "mean gap", "standard error", "range over seeds"], rows), ""]
    spread, dof = pooled_spread(table, ref)
    if spread is None:
        out.append(f"Noise floor: n/a (no seed has two {ref} runs; add a repeat or a benign perturbation).")
    else:
        out.append(
            f"Noise floor: one {ref} run's final loss lies {100 * spread:.2f}% (pooled standard deviation, "
            f"{dof} degrees of freedom) from its seed's mean; the difference of two runs that differ only by "
            f"rounding has a standard deviation of {100 * math.sqrt(2) * spread:.2f}%."
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", default="bf16", help="the reference family (default bf16)")
    parser.add_argument("runs", nargs="+", help="FAMILY@SEED=PATH (a metrics JSONL or a compare.py folder)")
    args = parser.parse_args(argv)
    print(report(collect(args.runs), args.ref))
    return 0


if __name__ == "__main__":
    sys.exit(main())
