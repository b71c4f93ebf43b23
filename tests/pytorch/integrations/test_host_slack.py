"""The host's slack per step in the sync-free loops: ``DeferredMetrics.host_wait_ms`` (how long the host,
having issued the next step, waited for a step's GPU work), written into the JSONL rows, and the e2e report's
section (steps the host waited in, its lead at the end)."""

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


def test_report_gives_the_steps_the_host_waited_and_its_final_lead(tmp_path):
    """Timed steps (after warm-up, without the last, flushed one) whose read-back waited over 1 ms, their
    median wait, and the last row's wait as the host's lead at the end. Runs without the field (the synced
    loop, a CPU) get no line."""
    fp8 = report.RunResult(
        "megatron", True, "fp8", status="ok",
        rows=_rows([(None, 5000.0), (20.0, 252.0), (0.2, 305.0), (18.0, 250.0), (0.1, 310.0), (90.0, 254.0)]),
    )  # fmt: skip
    synced = report.RunResult("megatron", True, "bf16", status="ok", rows=_rows([(None, 270.0)] * 4))
    text = "\n".join(report.host_slack_section([fp8, synced], warmup=1))
    expected = "megatron turbo fp8: the host waited for the GPU in 2 of 4 timed steps (median 19.0 ms); lead"
    assert expected in text and "at the end of the run: 90.0 ms" in text, text
    assert "bf16" not in text
    assert report.host_slack_section([synced], warmup=1) == []
    path = report.write_report(tmp_path, [fp8, synced], warmup=1, meta={"recipe": "x"}, plot_note="none")
    assert "## Host lead" in path.read_text()
