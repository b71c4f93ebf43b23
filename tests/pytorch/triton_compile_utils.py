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
