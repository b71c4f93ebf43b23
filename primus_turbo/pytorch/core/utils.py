"""Small helpers shared by kernels and ops."""

from __future__ import annotations

import functools
import os

import torch


def triton_interpret_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run_on(*tensors: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if triton_interpret_enabled():
        return all(t.device.type in ("cpu", "cuda") for t in tensors)
    return all(t.is_cuda for t in tensors)


# The device types turbo ops run on; autocast has a mode for both. A set rather than
# ``torch.amp.is_autocast_available``: Dynamo (torch 2.11) cannot trace that builtin, and a fullgraph
# compile of modules.Linear broke on it.
_AUTOCAST_DEVICE_TYPES = frozenset(("cuda", "cpu"))


def autocast_enabled_on(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)`` on CUDA and CPU; False elsewhere (meta: no autocast)."""
    return device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type)


def autocast_cast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the active ``torch.autocast`` dtype of its device, as autocast casts a matmul's inputs (mm,
    F.linear): floating tensors other than fp64; ``x`` itself when autocast is off or it already has that
    dtype. Turbo ops are custom functions, which autocast passes through: the ops that follow it cast here."""
    device_type = x.device.type
    if autocast_enabled_on(device_type) and x.is_floating_point() and x.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device_type)
        if x.dtype != dtype:
            return x.to(dtype)
    return x


def is_hopper(device: torch.device | None = None) -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


ENV_DEBUG_CHECKS = "PRIMUS_TURBO_DEBUG_CHECKS"


def debug_checks_enabled() -> bool:
    """PRIMUS_TURBO_DEBUG_CHECKS=1 turns on value checks that need a host sync on CUDA tensors."""
    return os.environ.get(ENV_DEBUG_CHECKS, "0").strip().lower() in ("1", "true", "on", "yes")


def eager_direct(op):
    """Wrap a ``torch.library.custom_op``: traced calls (torch.compile) go through the op, one opaque
    graph node with its fake; eager calls run the op's Python body directly. The custom-op layer costs
    ~10 us of host time per call on a fast host and up to ~0.3 ms on the H100 machines (cProfile,
    benchmark/results/h100/profile_host_60cb5c1.txt), more than many of the kernels it launches.
    Tensor subclasses (DTensor, functional collectives' AsyncCollectiveTensor, ...) still go through the
    op, whose dispatch unwraps them: the body's kernels need real storage.
    ``register_fake`` and ``custom_op`` (the op itself) stay reachable on the wrapper."""
    body = op._init_fn

    @functools.wraps(body)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or not _plain_tensors(args, kwargs):
            return op(*args, **kwargs)
        return body(*args, **kwargs)

    call.custom_op = op
    call.register_fake = op.register_fake
    return call


def _plain_tensors(args, kwargs) -> bool:
    """No argument is a torch.Tensor subclass instance."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
            return False
    return True


def zero_rows_from(out: torch.Tensor, probs: torch.Tensor | None, start: torch.Tensor) -> None:
    """Zero rows [start, N) of ``out`` [N, H] (and of ``probs`` [N]) in place; ``start`` is an int scalar
    tensor on out's device (no host sync): only the tail is written, unlike a zero-filled allocation."""
    n, h = out.shape
    if n == 0:
        return
    if not triton_can_run_on(out, start):
        tail = torch.arange(n, device=out.device) >= start
        out.masked_fill_(tail.unsqueeze(1), 0)
        if probs is not None:
            probs.masked_fill_(tail, 0)
        return
    import triton

    from primus_turbo.triton.memory.zero_rows_kernel import zero_rows_from_kernel

    block_h = min(1024, triton.next_power_of_2(max(h, 16)))
    block_r = max(1, min(64, 16384 // block_h))
    zero_rows_from_kernel[(min(ceil_div(n, block_r), 1024),)](
        out, probs if probs is not None else out, start, n, h, out.stride(0), HAS_PROBS=probs is not None,
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=8,
    )  # fmt: skip
