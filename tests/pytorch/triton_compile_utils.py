"""Compile a Triton kernel for sm_90 on any machine (no GPU needed) and check its resources.

The interpreter cannot see compile errors, register spills or shared-memory overflow; this can:

    from triton_compile_utils import compile_for_sm90
    compile_for_sm90(my_kernel, {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024})
"""

from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER_SMEM_BYTES = 227 * 1024  # max dynamic shared memory per block on sm_90


def _python_fn(kernel):
    """Peel autotune/heuristics/interpreter wrappers down to the undecorated Python function."""
    obj = kernel
    for _ in range(8):
        if inspect.isfunction(obj):
            return obj
        obj = obj.fn
    raise TypeError(f"cannot find the Python function behind {kernel!r}")


def compile_for_sm90(
    kernel,
    signature: dict,
    constexprs: dict | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    **options,
):
    fn = JITFunction(_python_fn(kernel))
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs or {})
    compiled = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages, **options},
    )
    shared = compiled.metadata.shared
    assert shared <= HOPPER_SMEM_BYTES, (
        f"{fn.__name__}: {shared} B of shared memory > {HOPPER_SMEM_BYTES} B available on sm_90"
    )
    return compiled


def run_compile_check(test_file: str, *args: str, timeout_s: int = 900) -> None:
    """Run ``python <test_file> [args]`` (its ``__main__`` calls compile_for_sm90) in a fresh process
    with TRITON_INTERPRET unset. In an interpreter process Triton's own @jit helpers (``tl.max``'s
    combine function, ...) are interpreter wrappers that the code generator cannot compile, so the
    compile checks of every slice run this way. ``test_file``: a path, or a module name under
    tests/pytorch/ops."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    path = Path(test_file)
    if not path.suffix:
        path = here / "ops" / f"{test_file}.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(path.parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(path), *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert proc.returncode == 0, (
        f"sm_90 compile check {path.name} {' '.join(args)} failed:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
