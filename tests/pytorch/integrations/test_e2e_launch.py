"""benchmark/e2e/compare.py's launch path: a configuration that loses its rendezvous port to another process
(parallel compare.py runs on one host) is launched once more; other failures are not retried."""

import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import compare  # noqa: E402


def _rows(steps: int = 3) -> list[dict]:
    row = {"step_time_ms": 500, "tokens_per_s_per_gpu": 1e4, "tflops_per_gpu": 1, "mfu": 0.1, "max_mem_gb": 1}
    return [{**row, "step": i, "loss": 5.0 - i} for i in range(1, steps + 1)]


@pytest.mark.parametrize("error, launches", [
    ("DistNetworkError: ... port: 50975, code: -98, name: EADDRINUSE, message: address already in use", 2),
    ("RuntimeError: CUDA out of memory", 1),
])  # fmt: skip
def test_a_run_that_lost_its_rendezvous_port_is_launched_once_more_on_a_new_port(
    monkeypatch, tmp_path, capsys, error, launches
):
    calls = []

    def fake_execute(run, cmd, timeout, warmup):
        calls.append(next(a for a in cmd if a.startswith("--master_port=")))
        if len(calls) == 1 or "EADDRINUSE" not in error:
            run.status, run.error, run.returncode = "failed", error, 1
        else:
            run.status, run.rows = "ok", _rows()

    ports = iter(range(40000, 40010))
    monkeypatch.setattr(compare, "execute", fake_execute)
    monkeypatch.setattr(compare, "free_port", lambda: next(ports))
    argv = ["turbo=on", "precisions=bf16", "steps=3", "warmup=1", f"out={tmp_path}"]
    assert compare.main(argv) == (0 if launches == 2 else 1)
    assert calls == ["--master_port=40000", "--master_port=40001"][:launches]
    assert ("port taken" in capsys.readouterr().out) == (launches == 2)
