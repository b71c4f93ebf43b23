"""benchmark/e2e/parity_spread.py: FP8-vs-bf16 gaps over seeds against bf16's own run-to-run spread,
on synthetic metrics with hand-computed answers, and its refusals."""

import json
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import compare  # noqa: E402
import parity_spread  # noqa: E402
import report  # noqa: E402


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


# ---- compare.py repeats=N: the same statistics inside the parity report ----------------------------------


def _flat(seed, precision, final, repeat=1):
    row = {"step_time_ms": 100, "tokens_per_s_per_gpu": 1e5, "tflops_per_gpu": 1, "mfu": 0.1, "max_mem_gb": 1}
    rows = [{**row, "step": s, "loss": final} for s in range(1, 21)]
    return report.RunResult("megatron", True, precision, status="ok", rows=rows, seed=seed, repeat=repeat)


def test_repeats_option_runs_each_configuration_n_times_per_seed(tmp_path):
    opts, overrides = compare.parse_args(["parity=true", "seeds=1,2", "repeats=2", "steps=4"])
    runs = compare.matrix(opts)
    assert [(r.seed, r.repeat, r.precision) for r in runs] == [
        (1, 1, "bf16"), (1, 1, "fp8"), (1, 2, "bf16"), (1, 2, "fp8"),
        (2, 1, "bf16"), (2, 1, "fp8"), (2, 2, "bf16"), (2, 2, "fp8"),
    ]  # fmt: skip
    slugs = [r.slug for r in runs]
    assert len(set(slugs)) == 8 and slugs[2] == "megatron_turbo_bf16_seed1_r2" and slugs[0].endswith("seed1")
    compare.command(runs[2], opts, overrides, tmp_path)
    assert runs[2].metrics_path.endswith("megatron_turbo_bf16_seed1_r2.jsonl")
    assert runs[2].label == "megatron turbo bf16 seed1 r2"
    for bad in ("0", "x", "-1"):
        with pytest.raises(SystemExit, match=f"repeats={bad}: expected a whole number >= 1"):
            compare.parse_args([f"repeats={bad}"])


def test_parity_report_compares_seed_means_and_gives_the_bf16_spread(tmp_path):
    """The first test's numbers through compare.py's report: seed 1 bf16 2.0 / 2.2 vs fp8 2.31 (+10%), seed 2
    1.0 vs 1.05 (+5%): mean +7.5% +- 2.5%, bf16 spread 6.73% per run."""
    runs = [_flat(1, "bf16", 2.0), _flat(1, "fp8", 2.31), _flat(1, "bf16", 2.2, repeat=2),
            _flat(2, "bf16", 1.0), _flat(2, "fp8", 1.05)]  # fmt: skip
    parity = report.parity_summary(runs)
    assert parity["relative_gap"] == pytest.approx(0.075) and parity["standard_error"] == pytest.approx(0.025)
    assert parity["bf16_spread"] == pytest.approx(0.0673435, rel=1e-5) and parity["bf16_spread_dof"] == 1
    assert not parity["pass"]
    text = report.write_report(tmp_path, runs, warmup=1, meta={}, parity=True).read_text()
    assert "+7.50% +- 2.50% standard error (mean over 2 seeds" in text
    assert "lies 6.73% from its seed's mean" in text and "differ by 9.52%" in text
    assert "| 1 | 2.0000 / 2.2000 | 2.3100 | +10.00% |" in text and report.NOISE_NOTE not in text
    # one seed, repeated bf16: the measured spread replaces the generic note
    one = report.write_report(tmp_path / "one", runs[:3], warmup=1, meta={}, parity=True).read_text()
    assert "lies 6.73% from its seed's mean" in one and report.NOISE_NOTE not in one
    assert "| 1 | 2.0000 / 2.2000 | 2.3100 | +10.00% |" in one


def test_compare_parity_with_repeats_on_a_cpu(tmp_path, compare_on_cpu):
    """A real run: tiny_moe, 3 steps, bf16 and emulated FP8 twice each; each run has its own files and row."""
    args = ["recipe=tiny_moe", "parity=true", "repeats=2", "steps=3", "warmup=1", "timeout=240",
            "fp8.emulate=true", "parallel.ep=1", f"out={tmp_path}"]  # fmt: skip
    rc, out = compare_on_cpu(args, timeout=900)
    assert rc == 0, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").glob("*.jsonl")) == [
        "megatron_turbo_bf16.jsonl", "megatron_turbo_bf16_r2.jsonl",
        "megatron_turbo_fp8.jsonl", "megatron_turbo_fp8_r2.jsonl",
    ]  # fmt: skip
    text = (tmp_path / "report.md").read_text()
    assert "| megatron turbo fp8 r2 | ok |" in text
    # a CPU repeats bitwise: bf16's spread is exactly zero, and it is reported, not hidden
    assert "lies 0.00% from its seed's mean" in text


def test_parity_on_the_shipped_sample_notes_that_it_is_memorized(capsys):
    compare.parse_args(["parity=true"])  # 500 steps on data/sample.txt
    assert "memorizes it within ~100 steps" in capsys.readouterr().err
    for quiet in (["parity=true", "data.path=.corpus/corpus.txt.gz"], ["parity=true", "steps=50"]):
        compare.parse_args(quiet)
        assert capsys.readouterr().err == ""
