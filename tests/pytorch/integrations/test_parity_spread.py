"""benchmark/e2e/parity_spread.py: FP8-vs-bf16 gaps over seeds against bf16's own run-to-run spread,
on synthetic metrics with hand-computed answers, and its refusals."""

import json
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import parity_spread  # noqa: E402


def _run(tmp_path, name, final, steps=20, lr=1e-3):
    """A compare.py-style folder whose last 10% of steps (2 of 20) average ``final``."""
    path = tmp_path / name / "runs" / "megatron_turbo_x.jsonl"
    path.parent.mkdir(parents=True)
    losses = [5.0] * (steps - 2) + [final - 0.1, final + 0.1]
    rows = [{"step": i + 1, "loss": v, "lr": lr} for i, v in enumerate(losses)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path.parent.parent)


def _tables(text):
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| seed") and not line.startswith("| family"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_gap_per_seed_mean_over_seeds_and_the_reference_noise_floor(tmp_path, capsys):
    runs = [
        f"bf16@1={_run(tmp_path, 'b1', 2.0)}", f"bf16@1={_run(tmp_path, 'b1r', 2.2)}",
        f"bf16@2={_run(tmp_path, 'b2', 1.0)}",
        f"fp8@1={_run(tmp_path, 'f1', 2.31)}", f"fp8@2={_run(tmp_path, 'f2', 1.05)}",
    ]  # fmt: skip
    assert parity_spread.main(runs) == 0
    out = capsys.readouterr().out
    rows = _tables(out)
    assert rows["1"] == ["2.0000 / 2.2000 (mean 2.1000)", "2.3100"]
    assert rows["2"] == ["1.0000", "1.0500"]
    # seed gaps +10% (2.31 / 2.1) and +5%: mean +7.5%, standard error stdev / sqrt(2) = 2.5%
    assert rows["fp8"] == ["2", "+7.50%", "2.50%", "+5.00% .. +10.00%"]
    # bf16 at seed 1: +-4.76% around its mean, one degree of freedom -> 6.73%; a pair: x sqrt(2) = 9.52%
    assert "lies 6.73% (pooled standard deviation, 1 degrees of freedom)" in out
    assert "standard deviation of 9.52%" in out


def test_one_seed_and_no_repeat_say_n_a(tmp_path, capsys):
    parity_spread.main([f"bf16@1={_run(tmp_path, 'b', 2.0)}", f"fp8@1={_run(tmp_path, 'f', 2.02)}"])
    out = capsys.readouterr().out
    assert _tables(out)["fp8"] == ["1", "+1.00%", "n/a", "+1.00% .. +1.00%"]
    assert "Noise floor: n/a (no seed has two bf16 runs" in out


@pytest.mark.parametrize("case, message", [
    ("format", "expected FAMILY@SEED=PATH"),
    ("steps", "ran 30 steps or another learning-rate schedule"),
    ("lr", "ran 20 steps or another learning-rate schedule"),
    ("two_files", "holds 2 metrics files, expected one"),
    ("ref", "--ref 'bf16': no run of that family (families: fp8)"),
])  # fmt: skip
def test_refuses_what_it_cannot_compare(tmp_path, capsys, case, message):
    first = f"{'fp8' if case == 'ref' else 'bf16'}@1={_run(tmp_path, 'a', 2.0)}"
    other = {
        "format": lambda: f"bf16={_run(tmp_path, 'b', 2.0)}",
        "steps": lambda: f"fp8@1={_run(tmp_path, 'b', 2.0, steps=30)}",
        "lr": lambda: f"fp8@1={_run(tmp_path, 'b', 2.0, lr=2e-3)}",
        "two_files": lambda: f"fp8@1={tmp_path}/b",
        "ref": lambda: f"fp8@2={_run(tmp_path, 'b', 2.0)}",
    }[case]()
    if case == "two_files":
        for name in ("x", "y"):
            (tmp_path / "b" / "runs").mkdir(parents=True, exist_ok=True)
            (tmp_path / "b" / "runs" / f"{name}.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(SystemExit) as err:
        parity_spread.main([first, other])
    assert message in str(err.value)
