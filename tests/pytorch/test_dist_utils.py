"""The launch helper of the torchrun tests: a port taken between pick and bind is retried, nothing else is."""

from __future__ import annotations

import sys
import time

from dist_utils import run_on_free_port


def _script(counter, fail_with: str) -> str:
    """Counts its runs in ``counter``; the first run prints ``fail_with`` and exits 1, later runs succeed."""
    return (
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        f"print({fail_with!r} if n == 0 else 'ok')\n"
        "sys.exit(1 if n == 0 else 0)\n"
    )


def test_retries_a_port_taken_before_the_bind(tmp_path):
    counter = tmp_path / "runs"
    ports = []

    def cmd(port):
        ports.append(port)
        return [sys.executable, "-c", _script(counter, "EADDRINUSE: address already in use")]

    proc = run_on_free_port(cmd, capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout
    assert counter.read_text() == "2" and len(ports) == 2


def test_other_failures_are_not_retried(tmp_path):
    counter = tmp_path / "runs"
    script = _script(counter, "ValueError: bad config")
    proc = run_on_free_port(lambda port: [sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 1 and "bad config" in proc.stdout
    assert counter.read_text() == "1"


def _noop_body(rank, world_size, device):
    pass


def test_run_distributed_retries_a_port_taken_before_rank_0_binds(monkeypatch):
    """The first port handed out is held by a listening socket: rank 0's store fails with EADDRINUSE, the
    launch is retried on a fresh port (quickly: rank 1 is not left to time out) and the test passes."""
    import socket

    import dist_utils

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]
    real = dist_utils.free_port

    def next_port():
        return ports.pop(0) if ports else real()

    monkeypatch.setattr(dist_utils, "free_port", next_port)
    try:
        start = time.monotonic()
        dist_utils.run_distributed(_noop_body, world_size=2, backend="gloo", timeout_s=60)
        assert not ports and time.monotonic() - start < 60
    finally:
        taken.close()


def test_run_distributed_reports_a_failing_rank_without_retrying():
    import dist_utils
    import pytest

    with pytest.raises(AssertionError, match="ValueError: rank 1 fails"):
        dist_utils.run_distributed(_failing_body, world_size=2, backend="gloo", timeout_s=60)


def _failing_body(rank, world_size, device):
    if rank == 1:
        raise ValueError("rank 1 fails")
