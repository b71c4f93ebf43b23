"""TURBO async-TP pipelines: chunked GEMMs overlapped with copy-engine pushes over symmetric memory.

Both pipelines *push* (the producer writes into the consumer's symmetric buffer with
``Tensor.copy_``, a ``cudaMemcpyAsync`` that the driver runs on a copy engine over NVLink) on a
side stream while the compute stream runs the GEMM of a chunk that is already local. Pushing
instead of pulling (torch's symm-mem ops pull) removes the staging copy of the local shard and the
barrier that must follow it, so the first GEMM starts immediately.

Ordering, per call (``b`` = ``_SymmetricMemory.barrier``, a tiny all-ranks kernel; every barrier
runs on the side stream, none on the compute stream, so no GEMM ever waits on a peer's launch):
  side stream   : wait(ev_start) -> b(0) -> push part 0 -> b -> ev0 -> push part 1 -> b -> ev1 ...
  compute stream: ev_start -> GEMM(local chunk) -> wait(ev0) -> GEMM(part 0) -> wait(ev1) -> ...
The opening b(0) completes only when every rank's side stream has passed its own wait(ev_start),
i.e. every rank has finished reading its slots in the previous call (of either op: they share the
workspace), so nobody overwrites a slot a peer still reads; it replaces a closing barrier on the
compute stream, which stalled the next call's first GEMM until the slowest rank caught up. A
barrier after a push completes only when every rank has finished the same push, so after it this
rank's buffer holds every peer's part. The side stream's part is enqueued in one go (one stream
switch, pooled events): at ~0.3 ms of GEMM a call is otherwise bound by its own Python launches.

Workspaces are one uint8 symmetric tensor per process group, grown on demand (a collective
rendezvous, so every rank must call with the same shapes: true for TP). Old workspaces are kept
alive rather than freed, because a peer may still be writing into them asynchronously.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "symm_mem_available",
    "enable_symm_mem_for_group",
    "pipelined_all_gather_consume",
    "pipelined_produce_reduce_scatter",
    "matmul_reduce_scatter_cpp",
]

_ALIGN = 256  # bytes; keeps every slot 16-byte aligned for cuBLAS (row-wise scales) and copy engines
_MAX_SPLITS = 8  # barrier channels 1..8 signal row blocks; channel 0 opens the call
_workspaces: dict[str, tuple[torch.Tensor, object]] = {}
_retired: list = []  # grown-out-of workspaces and handles, never freed (see module doc)
_side_streams: dict[int, torch.cuda.Stream] = {}
_cuda = torch.cuda  # stream/event API, swapped for a synchronous fake by the CPU pipeline test


def symm_mem_available() -> bool:
    """True when this torch build has CUDA symmetric memory (does not touch any device)."""
    if not torch.cuda.is_available() or not torch.distributed.is_available():
        return False
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
        from torch._C._distributed_c10d import _SymmetricMemory  # noqa: F401
    except ImportError:
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


_enabled_groups: set[str] = set()


def enable_symm_mem_for_group(group_name: str) -> None:
    """Register the group with torch's symmetric memory once (required by older torch releases,
    a deprecated no-op in newer ones; harmless either way)."""
    if group_name in _enabled_groups:
        return
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
    _enabled_groups.add(group_name)


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _workspace(group_name: str, nbytes: int, device: torch.device):
    import torch.distributed._symmetric_memory as symm_mem

    enable_symm_mem_for_group(group_name)
    entry = _workspaces.get(group_name)
    if entry is None or entry[0].numel() < nbytes:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"async_tp TURBO: the symmetric workspace of group {group_name} must grow to {nbytes} bytes, "
                "which cannot happen during CUDA graph capture; run one eager step first"
            )
        if entry is not None:
            _retired.append(entry[0])
            _retired.append(entry[1])  # keep the handle alive too: cached views key on its id()
            _views.clear()
        size = max(nbytes, 64 << 20)  # 64 MiB floor: one growth covers typical TP shapes
        buf = symm_mem.empty(size, dtype=torch.uint8, device=device)
        _workspaces[group_name] = (buf, symm_mem.rendezvous(buf, group_name))
    return _workspaces[group_name][1]


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        # high priority so the pushes are not starved by the GEMM's CTAs
        _side_streams[index] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[index]


_views: dict[tuple, torch.Tensor] = {}


def _view(handle, rank: int, offset: int, like: torch.Tensor) -> torch.Tensor:
    """``like``-shaped view of ``rank``'s workspace at byte ``offset``.

    Cached: get_buffer builds a tensor from a raw pointer (~5 us of host time each, a dozen per
    call), and a small GEMM's pipeline is host-bound without the cache.
    """
    key = (id(handle), rank, offset, tuple(like.shape), like.dtype)
    view = _views.get(key)
    if view is None:
        if len(_views) > 4096:
            _views.clear()
        nbytes = like.numel() * like.element_size()
        raw = handle.get_buffer(rank, (nbytes,), torch.uint8, offset)
        view = _views[key] = raw.view(like.dtype).view(like.shape)
    return view


def _row_parts(rows: int, splits: int) -> list[tuple[int, int]]:
    step = -(-rows // splits)
    return [(s, min(s + step, rows)) for s in range(0, rows, step)]


def _events(device: torch.device, n: int) -> list:
    """``n`` reusable CUDA events for one call (created once per device, grown on demand).

    Reuse is safe: ``wait_event`` captures the event's most recent record at the time it is enqueued,
    and every use of an event within a call is enqueued before the next call records it again.
    """
    index = device.index if device.index is not None else 0
    pool = _event_pools.setdefault(index, [])
    while len(pool) < n:
        pool.append(_cuda.Event())
    return pool


_event_pools: dict[int, list] = {}


def pipelined_all_gather_consume(
    shards: list[torch.Tensor],
    consume: Callable[[list[torch.Tensor], int], None],
    gathered: list[torch.Tensor] | None,
    group_name: str,
    world_size: int,
    rank: int,
    num_splits: int = 1,
) -> None:
    """all_gather(shards) along dim 0, calling ``consume(row_block, global_row_start)`` per block.

    ``shards`` are contiguous tensors with the same number of rows (e.g. an FP8 activation and its
    row-wise scales). ``gathered`` (optional) receives the full tensors, [world_size * rows, ...].
    Each rank pushes its shard to every peer in ``num_splits`` row blocks, so the consumer of block
    j can start while block j+1 is still in flight.

    Host cost matters as much as overlap here (a 0.3 ms GEMM is launch-bound at dozens of Python-level
    CUDA calls): the side stream's whole schedule is enqueued under one stream switch, with pooled
    events, before the compute stream's.
    """
    rows = shards[0].shape[0]
    parts = _row_parts(rows, max(1, min(num_splits, _MAX_SPLITS))) if rows else []
    shard_bytes = [_aligned(x.numel() * x.element_size()) for x in shards]
    slot_bytes = sum(shard_bytes)
    handle = _workspace(group_name, slot_bytes * world_size, shards[0].device)
    compute = _cuda.current_stream()
    side = _side_stream(shards[0].device)
    ev = _events(shards[0].device, len(parts) + 2)  # [start, arrived_1..P, done]

    def slot(owner: int, src: int) -> list[torch.Tensor]:
        offset, views = src * slot_bytes, []
        for x, nb in zip(shards, shard_bytes):
            views.append(_view(handle, owner, offset, x))
            offset += nb
        return views

    local = {src: slot(rank, src) for src in range(world_size) if src != rank}
    peers = [(rank + step) % world_size for step in range(1, world_size)]
    remote = [slot(peer, rank) for peer in peers]
    ev[0].record(compute)
    _cuda.set_stream(side)
    try:
        side.wait_event(ev[0])
        handle.barrier(channel=0)  # every rank is done reading its slots (previous call)
        for channel, (r0, r1) in enumerate(parts, start=1):
            for dsts in remote:
                for dst, x in zip(dsts, shards):
                    dst[r0:r1].copy_(x[r0:r1], non_blocking=True)
            handle.barrier(channel=channel)
            ev[channel].record(side)
        if gathered is not None:  # the copy-out runs on the side stream while the GEMMs below run
            for src in range(world_size):
                views = shards if src == rank else local[src]
                for full, part in zip(gathered, views):
                    full[src * rows : (src + 1) * rows].copy_(part, non_blocking=True)
        ev[-1].record(side)
    finally:
        _cuda.set_stream(compute)

    consume(shards, rank * rows)
    for channel, (r0, r1) in enumerate(parts, start=1):
        compute.wait_event(ev[channel])
        for step in range(1, world_size):
            src = (rank - step) % world_size
            consume([t[r0:r1] for t in local[src]], src * rows + r0)
    compute.wait_event(ev[-1])


def pipelined_produce_reduce_scatter(
    produce: Callable[[int, int, torch.Tensor], None],
    out: torch.Tensor,
    reduce_op: str,
    group_name: str,
    world_size: int,
    rank: int,
    num_splits: int = 1,
    accumulate: Callable[[int, int, torch.Tensor, float, float, torch.Tensor], None] | None = None,
) -> None:
    """out = reduce_op over ranks of rows block ``rank`` of the full [world_size * m, N] product.

    ``produce(r0, r1, dst)`` writes rows [r0, r1) of this rank's partial product into ``dst``.
    Blocks destined to peers are produced first (row block by row block, into a local staging
    buffer of (world_size - 1) x out) and each row block is pushed into the peers' slots for this
    rank as soon as it is produced, while the next block computes.

    Without ``accumulate``: this rank's own block is produced straight into its slot and one
    ``sum``/``mean`` over the ``world_size`` slots finishes the reduction (an extra pass over
    world_size x out on the compute stream, after the last push).
    With ``accumulate(r0, r1, c, alpha, beta, dst)`` (dst = alpha * rows [r0, r1) of the product
    + beta * c, e.g. ``torch.addmm``): each row block's arrival is signalled by its own barrier and
    the own block is computed onto the peers' arrived partials, so the reduction rides in the
    GEMM's epilogue and no separate reduction kernel runs. Needs >= 2 row blocks to hide the
    pushes (own block j waits for the peers' block j).

    Enqueue order (host cost, see pipelined_all_gather_consume): every peer-block GEMM on the compute
    stream (an event per row block), then the side stream's pushes and barriers under one stream
    switch, then the own-block GEMMs.
    """
    m = out.shape[0]
    parts = _row_parts(m, max(1, min(num_splits, _MAX_SPLITS))) if m else []
    slot_bytes = _aligned(out.numel() * out.element_size())
    handle = _workspace(group_name, slot_bytes * world_size, out.device)
    compute = _cuda.current_stream()
    side = _side_stream(out.device)
    nparts = len(parts)
    ev = _events(out.device, 2 * nparts + 2)  # [start, produced_1..P, arrived_1..P, done]
    peers = [(rank + step) % world_size for step in range(1, world_size)]

    def slot(owner: int, src: int) -> torch.Tensor:
        return _view(handle, owner, src * slot_bytes, out)

    ev[0].record(compute)
    stage = out.new_empty((len(peers), *out.shape))  # freed after compute waits for the side stream
    for j, (r0, r1) in enumerate(parts, start=1):
        for i, peer in enumerate(peers):
            produce(peer * m + r0, peer * m + r1, stage[i, r0:r1])
        ev[j].record(compute)
    remote = [slot(peer, rank) for peer in peers]
    _cuda.set_stream(side)
    try:
        side.wait_event(ev[0])
        handle.barrier(channel=0)  # every rank is done reading its slots (previous call)
        for j, (r0, r1) in enumerate(parts, start=1):
            side.wait_event(ev[j])
            for i, dst in enumerate(remote):
                dst[r0:r1].copy_(stage[i, r0:r1], non_blocking=True)
            if accumulate is not None:
                handle.barrier(channel=j)
                ev[nparts + j].record(side)
        if accumulate is None:
            handle.barrier(channel=1)
        ev[-1].record(side)
    finally:
        _cuda.set_stream(compute)
    if accumulate is None:
        own = slot(rank, rank)
        for r0, r1 in parts:
            produce(rank * m + r0, rank * m + r1, own[r0:r1])
        compute.wait_event(ev[-1])
        _reduce_slots(handle, rank, world_size, slot_bytes, out, reduce_op)
        return
    scale = 1.0 / world_size if reduce_op == "avg" else 1.0
    local = [slot(rank, peer) for peer in peers]
    for j, (r0, r1) in enumerate(parts, start=1):
        compute.wait_event(ev[nparts + j])
        dst = out[r0:r1]
        if world_size == 2:
            c = local[0][r0:r1]
        else:
            c = dst
            torch.add(local[0][r0:r1], local[1][r0:r1], out=dst)
            for peer_slot in local[2:]:
                dst.add_(peer_slot[r0:r1])
        accumulate(rank * m + r0, rank * m + r1, c, scale, scale, dst)
    compute.wait_event(ev[-1])


def matmul_reduce_scatter_cpp(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    reduce_op: str,
    group_name: str,
    world_size: int,
    rank: int,
    num_splits: int,
    fuse_own: bool = True,
) -> None:
    """``pipelined_produce_reduce_scatter`` with ``produce = a @ b`` and the addmm ``accumulate``,
    the whole schedule enqueued by the csrc op ``async_tp_rs_fused`` (cuBLAS via ATen, copy-engine
    pushes, our barrier kernel on the handle's signal pads), which saves the Python interpreter's
    share of the host time. ``fuse_own=False``: the own block is one GEMM that does not wait for the
    pushes, then one add of the peers' partials (fewer GEMM launches: each costs ~30 us of host time
    on the H200 hosts measured, which bounds a call whose GEMMs take ~0.3 ms)."""
    from primus_turbo.pytorch.core.cpp_extension import cpp_ops

    m = out.shape[0]
    if m == 0:  # every rank has the same shapes: all skip, and the next call's barrier(0) still pairs up
        return
    bounds = [r0 for r0, _ in _row_parts(m, max(1, min(num_splits, _MAX_SPLITS)))] + [m]
    slot_bytes = _aligned(out.numel() * out.element_size())
    handle = _workspace(group_name, slot_bytes * world_size, out.device)
    peers = [(rank + step) % world_size for step in range(1, world_size)]
    remote = [_view(handle, peer, rank * slot_bytes, out) for peer in peers]
    local = [_view(handle, rank, peer * slot_bytes, out) for peer in peers]
    stage = out.new_empty((len(peers), *out.shape))
    side = _side_stream(out.device)
    scale = 1.0 / world_size if reduce_op == "avg" else 1.0
    cpp_ops().async_tp_rs_fused(
        a, b, out, stage, remote, local, bounds, handle.signal_pad_ptrs_dev, rank, world_size,
        side.stream_id, side.device_index, side.device_type, scale, fuse_own,
    )  # fmt: skip


def _reduce_slots(handle, rank: int, world_size: int, slot_bytes: int, out: torch.Tensor, reduce_op: str):
    elem = out.element_size()
    if slot_bytes % elem:
        raise AssertionError("slot size must be a multiple of the element size")
    # Slots are slot_bytes apart: view them as one strided [world_size, m, N] tensor, reduce in one kernel.
    flat = handle.get_buffer(rank, (world_size * slot_bytes // elem,), out.dtype, 0)
    stacked = flat.as_strided((world_size, *out.shape), (slot_bytes // elem, *out.stride()))
    if reduce_op == "sum":
        torch.sum(stacked, dim=0, out=out)
    else:
        torch.mean(stacked, dim=0, out=out)
