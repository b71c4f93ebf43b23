"""The host's slack per step in the sync-free loops: ``DeferredMetrics.host_wait_ms`` (how long the host,
having issued the next step, waited for a step's GPU work), written into the JSONL rows, and the e2e report's
section that counts host-paced steps."""

import os
import sys
import time

import pytest
import torch
from primus_turbo.integrations.common.metrics import DeferredMetrics

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import report  # noqa: E402


def _queue_steps(device, gpu_ms_per_step: float, host_ms_per_step: float, steps: int = 4) -> list:
    """Queue ``steps`` steps, each with ~gpu_ms of GPU sleep and ~host_ms of host sleep after it; returns the
    recorded steps' host_wait_ms."""
    waits, deferred = [], DeferredMetrics()
    record = lambda *r: waits.append(deferred.host_wait_ms)  # noqa: E731
    one = torch.ones((), device=device)
    for step in range(1, steps + 1):
        if device.type == "cuda" and gpu_ms_per_step:
            torch.cuda._sleep(int(gpu_ms_per_step * 1e6))  # ~1-2 GPU cycles per ns: >= gpu_ms / 2
        time.sleep(host_ms_per_step / 1e3)
        deferred.queue(step, one, one, {}, record)
    return waits


def test_host_wait_is_none_on_a_cpu():
    assert _queue_steps(torch.device("cpu"), 0.0, 0.0) == [None, None, None]


@pytest.mark.gpu
def test_host_wait_measures_the_gpu_time_left_after_the_host_issued_the_next_step():
    """GPU-paced steps (the GPU sleeps far longer than the host works): the host waits for most of each step.
    Host-paced steps (the host sleeps 60 ms, the GPU ~1 ms): the wait is about nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    gpu_paced = _queue_steps(device, gpu_ms_per_step=80.0, host_ms_per_step=0.0)
    torch.cuda.synchronize()
    host_paced = _queue_steps(device, gpu_ms_per_step=1.0, host_ms_per_step=60.0)
    assert all(w > 20.0 for w in gpu_paced[1:]), gpu_paced  # >= ~40 ms of sleep queued behind each step
    assert all(w < 5.0 for w in host_paced), host_paced


def test_step_metrics_write_the_host_wait_into_each_row(tmp_path):
    from types import SimpleNamespace

    from primus_turbo.integrations.common.metrics import StepMetrics

    path = tmp_path / "m.jsonl"
    train = SimpleNamespace(steps=2, progress=False, metrics_file=str(path), tensorboard_dir=None)
    metrics = StepMetrics(SimpleNamespace(train=train), 1, 1e9, "bf16", is_writer=True)
    rows = [metrics.record(1, 2.0, 0.5, 1024, 1e-3, 1.0, host_wait_ms=3.5)]
    rows.append(metrics.record(2, 1.9, 0.5, 1024, 1e-3, None))
    metrics.close()
    assert [r["host_wait_ms"] for r in rows] == [3.5, None]
    assert path.read_text().count('"host_wait_ms"') == 2


def _rows(waits_and_times):
    return [
        {"step": i + 1, "loss": 1.0, "step_time_ms": t, "tokens_per_s_per_gpu": 1.0, "tflops_per_gpu": 1.0,
         "host_wait_ms": w}
        for i, (w, t) in enumerate(waits_and_times)
    ]  # fmt: skip


def test_report_counts_the_host_paced_steps_and_their_step_time(tmp_path):
    """Steps after warm-up with under 1 ms of wait are host-paced; the section gives their median step time
    next to the rest's. Runs without the field (the synced loop, a CPU) get no line."""
    fp8 = report.RunResult(
        "megatron", True, "fp8", status="ok",
        rows=_rows([(None, 5000.0), (20.0, 252.0), (0.2, 305.0), (18.0, 250.0), (0.1, 310.0), (22.0, 254.0)]),
    )  # fmt: skip
    synced = report.RunResult("megatron", True, "bf16", status="ok", rows=_rows([(None, 270.0)] * 4))
    lines = report.host_slack_section([fp8, synced], warmup=1)
    text = "\n".join(lines)
    assert "megatron turbo fp8: median wait 18.0 ms per step; 2 of 5 timed steps host-paced" in text, text
    assert "their median step 307.5 ms vs 252.0 ms for the rest" in text, text
    assert "bf16" not in text
    assert report.host_slack_section([synced], warmup=1) == []
    assert report.summarize(fp8.rows, warmup=1)["host_wait_ms"] == 18.0
    path = report.write_report(tmp_path, [fp8, synced], warmup=1, meta={"recipe": "x"}, plot_note="none")
    assert "## Host slack" in path.read_text()
