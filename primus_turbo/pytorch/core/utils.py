"""Small helpers shared by kernels and ops."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from primus_turbo.env import parse_bool_env, triton_interpret_env


def triton_interpret_enabled() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), as Triton reads it."""
    return triton_interpret_env()  # "false" / "off" / "no" read as on before


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
    """PRIMUS_TURBO_DEBUG_CHECKS=1 turns on value checks that need a host sync on CUDA tensors; a value
    other than 1/0/true/false/on/off/yes/no is an error naming the variable (``enable`` checked nothing)."""
    return parse_bool_env(ENV_DEBUG_CHECKS)


def check_ranks_agree(op: str, signature: dict, group) -> None:
    """PRIMUS_TURBO_DEBUG_CHECKS=1 only (one all_gather_object per call): raise ValueError on every rank of
    ``group`` when the ranks' ``signature`` (the shapes, dtypes and flags a collective needs equal) differ.
    Without it such a call hangs (NCCL), aborts one rank (gloo) or reads a peer's bytes as another layout.
    """
    if torch.compiler.is_compiling() or not debug_checks_enabled():
        return
    if isinstance(group, str):
        from torch.distributed import distributed_c10d as c10d

        group = c10d._resolve_process_group(group)
    group = group if group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return
    signatures = [None] * dist.get_world_size(group)
    dist.all_gather_object(signatures, signature, group=group)
    if any(sig != signatures[0] for sig in signatures):
        per_rank = "; ".join(f"rank {i}: {sig}" for i, sig in enumerate(signatures))
        raise ValueError(f"{op}: the ranks of the group were called with different arguments ({per_rank})")


def eager_direct(op):
    """Wrap a ``torch.library.custom_op``: traced calls (torch.compile) go through the op, one opaque
    graph node with its fake; eager calls run the op's Python body directly. The custom-op layer costs
    ~10 us of host time per call on a fast host and up to ~0.3 ms on the H100 machines (cProfile,
    benchmark/results/h100/profile_host_60cb5c1.txt), more than many of the kernels it launches.
    Tensor subclasses (DTensor, functional collectives' AsyncCollectiveTensor, ...) still go through the
    op, whose dispatch unwraps them: the body's kernels need real storage.
    ``register_fake`` and ``custom_op`` (the op itself) stay reachable on the wrapper."""
    body = op._init_fn
    # decided once per op: ops without tensor lists keep the flat check (this runs on every eager call)
    plain_tensors = _plain_tensors_in_lists if _takes_tensor_lists(op) else _plain_tensors

    @functools.wraps(body)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or not plain_tensors(args, kwargs):
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


def _plain_tensors_in_lists(args, kwargs) -> bool:
    """``_plain_tensors`` that also looks inside list/tuple arguments (a ``Tensor[]`` of the op's schema: a
    DTensor among all_gather_matmul's weights reached the body directly)."""
    for a in (*args, *kwargs.values()):
        for t in a if type(a) is list or type(a) is tuple else (a,):
            if (
                isinstance(t, torch.Tensor)
                and type(t) is not torch.Tensor
                and type(t) is not torch.nn.Parameter
            ):
                return False
    return True


def _takes_tensor_lists(op) -> bool:
    """Whether the custom op's schema has a ``Tensor[]`` (or ``Tensor?[]``, optional or not) argument (True
    when the schema cannot be read: the list-aware check is the safe one)."""
    schema = getattr(getattr(op, "_opoverload", None), "_schema", None)
    if schema is None:
        return True
    for arg in schema.arguments:
        kind = arg.type.getElementType() if isinstance(arg.type, torch.OptionalType) else arg.type
        if isinstance(kind, torch.ListType) and "Tensor" in str(kind.getElementType()):
            return True
    return False


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
