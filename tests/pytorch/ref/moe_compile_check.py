"""Helpers shared by the MoE/activation tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent.parent / "ops"


def run_compile_check(module: str, timeout_s: int = 600) -> None:
    """Run ``tests/pytorch/ops/<module>.py``'s ``__main__`` (its sm_90 compile checks) in a fresh
    process with the Triton interpreter off: under TRITON_INTERPRET=1, the second
    compile_for_sm90 call in one process fails in Triton's code generator."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(_HERE.parent), str(_HERE), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(_HERE / f"{module}.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, (
        f"sm_90 compile of {module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
