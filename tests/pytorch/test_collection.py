"""The CI command collects every test folder: pytest's default ``norecursedirs`` contains "dist", which
once silently dropped tests/pytorch/dist (the 2-process gloo tests) from every run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_folder_is_collected():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    ).stdout  # fmt: skip
    collected = {line.split("::")[0].rsplit("/", 1)[0] for line in out.splitlines() if "::" in line}
    folders = {
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if not any(part.startswith(".") for part in p.parts)
    }
    assert folders <= collected, f"test folders pytest does not collect: {sorted(folders - collected)}"
