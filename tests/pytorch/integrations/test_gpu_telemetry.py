"""compare.py's GPU telemetry (gpu_telemetry.py): nvidia-smi samples parsed, reduced to the timed steps of
the run's GPUs, the sampler started and stopped around a run, and the report section that lists them."""

import json
import os
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import gpu_telemetry  # noqa: E402
import report  # noqa: E402


def _smi_line(seconds: float, index: int, clock: float, watts: float, reasons: int) -> str:
    import time

    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"
    return f"{stamp}, {index}, {clock:.0f}, {watts:.2f}, 0x{reasons:016x}"


def test_gpu_telemetry_summarizes_the_timed_steps_of_the_run_gpus(tmp_path):
    t0 = 1_800_000_000.0
    lines = [_smi_line(t0 + i * 0.25, 0, 1980 if i < 4 else 1700, 120 if i < 4 else 690, 0 if i < 4 else 0x4)
             for i in range(20)]  # fmt: skip
    lines += [_smi_line(t0 + 2.0, 1, 345, 70, 0x1)]  # another GPU, not this run's
    lines += ["2026/11/27 10:45:35.102, 0, [N/A], 77.3, 0x1", "2026/11/27 10:45"]  # unparsable: skipped
    path = tmp_path / "run.smi.csv"
    path.write_text("\n".join(lines) + "\n")
    samples = gpu_telemetry.parse(path)
    assert len(samples) == 21
    rows = [{"step": s, "time": t0 + 0.5 * s, "step_time_ms": 500.0} for s in range(1, 10)]
    window = gpu_telemetry.timed_window(rows, warmup=3)  # steps 4-9: from 1.5 s to 4.5 s
    assert window == (t0 + 1.5, t0 + 4.5)
    gpu = gpu_telemetry.summarize(samples, *window, gpus=1)
    # samples 6 .. 18 (both ends inside), all after the clock dropped under the cap
    assert gpu == {"samples": 13, "sm_clock_mhz": 1700, "power_w": 690, "power_capped": 1.0, "thermal": 0.0}
    assert "power cap in 100%" in gpu_telemetry.describe(gpu)
    assert gpu_telemetry.summarize(samples, t0 + 100, t0 + 200) is None
    assert gpu_telemetry.parse(tmp_path / "absent.csv") == []


def test_gpu_telemetry_sampler_runs_nvidia_smi_and_stops_it(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH that prints a row every 50 ms: the sampler writes its rows while the
    block runs and stops it after; without nvidia-smi nothing is written."""
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(
        '#!/bin/sh\ncase "$*" in *--loop-ms=250*) ;; *) exit 2;; esac\n'
        'row="2026/11/27 10:45:35.102, 0, 1755, 650.00, 0x0000000000000004"\n'
        'while true; do echo "$row"; sleep 0.05; done\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    path = tmp_path / "run.smi.csv"
    with gpu_telemetry.Sampler(path) as sampler:
        time.sleep(0.5)
    assert sampler.proc.poll() is not None  # stopped
    samples = gpu_telemetry.parse(path)
    assert len(samples) >= 3 and samples[0][1:] == (0, 1755.0, 650.0, 4)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with gpu_telemetry.Sampler(path):
        pass
    assert not path.exists()


def test_report_lists_each_run_gpu_clock_and_power(tmp_path):
    run = report.RunResult("megatron", True, "fp8", status="ok")
    row = {"loss": 2.0, "step_time_ms": 250.0, "tokens_per_s_per_gpu": 1.0, "tflops_per_gpu": 1.0, "mfu": 0.2,
           "max_mem_gb": 1.0, "lr": 1e-4, "grad_norm": 1.0}  # fmt: skip
    run.rows = [{**row, "step": s, "time": float(s)} for s in range(1, 5)]
    run.gpu = {"samples": 12, "sm_clock_mhz": 1700.0, "power_w": 690.0, "power_capped": 0.75, "thermal": 0.0}
    text = report.write_report(tmp_path, [run], warmup=1, meta={"recipe": "r"}).read_text()
    assert "## GPU clock and power during the timed steps" in text
    assert (
        "- megatron turbo fp8: SM 1700 MHz, 690 W (medians of 12 samples), power cap in 75% of them" in text
    )
    assert json.loads((tmp_path / "results.json").read_text())["configurations"][0]["gpu"]["power_w"] == 690.0
