"""The commit recorded with benchmark results (benchmark/ops/bench_utils.py git_commit): HEAD, "+dirty"
when tracked files differ from it (a device copy of the tree with a stale .git), PRIMUS_TURBO_COMMIT first."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "ops"))
from bench_utils import git_commit  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    env = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    done = subprocess.run(["git", *env, *args], cwd=repo, check=True, capture_output=True, text=True)
    return done.stdout.strip()


def test_git_commit_head_dirty_and_override(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIMUS_TURBO_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "kernel.cu").write_text("// v1\n")
    _git(tmp_path, "add", "kernel.cu")
    _git(tmp_path, "commit", "-q", "-m", "v1")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert git_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "kernel.cu").write_text("// v2: newer files under an older .git\n")
    assert git_commit(tmp_path) == head + "+dirty"
    monkeypatch.setenv("PRIMUS_TURBO_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"


def test_git_commit_outside_a_repository(tmp_path, monkeypatch):
    monkeypatch.delenv("PRIMUS_TURBO_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_commit(tmp_path) == "unknown"
