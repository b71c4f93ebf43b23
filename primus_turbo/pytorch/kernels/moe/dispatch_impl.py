"""Expert-parallel dispatch/combine: layout, handle, and the backends behind one dispatcher.

Semantics (DeepEP normal mode, intranode): each token goes once to every EP rank that hosts at
least one of its top-k experts; the receiver gets the token, its top-k indices translated to local
expert ids (-1 where the expert lives elsewhere) and the matching probs (0 there). Combine is the
exact reverse: every rank sends its rows back and the source rank sums them per token (fp32
accumulation, fixed order: deterministic).

Backends (op_name "moe_dispatch_combine", env PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND; default order
DEEP_EP > NCCL > TURBO; TURBO is opt-in: 1.68x NCCL at the op level on 2 H200s, no end-to-end gain
measured yet):
  NCCL     all_to_all_single (gloo on CPU). The split sizes must be known on the host: that one
           device->host copy per dispatch is inherent to this path (combine reuses the sizes).
  TURBO    intranode kernels over torch symmetric memory (kernels/moe/ep_turbo.py): no host sync.
  DEEP_EP  the external deep_ep package, when importable.

Sending order: rows for rank w are grouped (rank-major, token order within a rank), i.e. exactly
``token_permute(x, is_token_in_rank)``, so the send side reuses the permute kernels and combine's
reduction is ``token_unpermute``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.utils import debug_checks_enabled
from primus_turbo.pytorch.kernels.moe.permute_impl import build_row_id_map, moe_permute_fwd, moe_unpermute_fwd


@dataclass
class DispatchHandle:
    """What combine (and the backward passes) need to reverse a dispatch."""

    backend: BackendType
    group: object
    num_tokens: int  # T on the source rank
    num_experts: int
    hidden: int
    row_id_map: torch.Tensor  # [T, W] int32: row of token t in the send buffer for rank w, or -1
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    num_recv: int = 0
    extra: dict = field(default_factory=dict)  # backend-specific state (TURBO: offsets on device)
    # received (token, local expert) routes when the host knows it (NCCL: from the count exchange it
    # already syncs on); None for the sync-free backends, whose consumers size by an upper bound
    num_recv_routes: int | None = None


def validate_routing(indices, num_experts, world_size: int, op: str = "moe_dispatch") -> None:
    """Routing rules shared by moe_dispatch and deep_ep.Buffer (get_dispatch_layout and dispatch).

    The value range is checked on CPU always, on CUDA only with PRIMUS_TURBO_DEBUG_CHECKS=1 (it needs a host
    sync): an id in [E, E + E / W) would otherwise be dropped silently by the layout and a larger one index
    out of bounds in its scatter."""
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"{op}: num_experts must be an int, got {type(num_experts).__name__}")
    if num_experts < 1 or num_experts % world_size != 0:
        raise ValueError(
            f"{op}: num_experts={num_experts} must be a positive multiple of the EP size {world_size}"
        )
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        raise ValueError(
            f"{op}: indices must be a [num_tokens, topk] tensor, got {getattr(indices, 'shape', None)}"
        )
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: indices dtype {indices.dtype}; accepted int32/int64")
    if indices.shape[1] > num_experts:
        raise ValueError(f"{op}: topk={indices.shape[1]} > num_experts={num_experts}")
    if indices.numel() and (indices.device.type == "cpu" or debug_checks_enabled()):
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"{op}: indices must be in [-1, {num_experts}), got range [{lo}, {hi}]")


def validate_dispatch(x, x_scale, indices, probs, num_experts, group, op: str = "moe_dispatch") -> None:
    """Argument rules of a dispatch, one validator for every entry point (moe_dispatch, Buffer.dispatch)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{op}: torch.distributed is not initialized")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{op}: x must be a [num_tokens, hidden] tensor (or an (x, x_scale) pair)")
    scale_rows = x_scale.shape[0] if isinstance(x_scale, torch.Tensor) and x_scale.dim() else None
    if x_scale is not None and scale_rows != x.shape[0]:
        raise ValueError(
            f"{op}: x_scale must be [num_tokens={x.shape[0]}, ...], got {getattr(x_scale, 'shape', None)}"
        )
    if isinstance(indices, torch.Tensor) and indices.dim() == 2 and indices.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: indices must be [num_tokens={x.shape[0]}, topk], got {tuple(indices.shape)}")
    validate_routing(indices, num_experts, dist.get_world_size(group), op)
    if probs is not None and tuple(probs.shape) != tuple(indices.shape):
        raise ValueError(f"{op}: probs shape {tuple(probs.shape)} != indices shape {tuple(indices.shape)}")


def dispatch_layout(indices: torch.Tensor, num_experts: int, world_size: int):
    """(num_tokens_per_rank [W] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, W] bool).

    Local, device-only (no sync). DeepEP's ``get_dispatch_layout`` minus the RDMA counts."""
    experts_per_rank = num_experts // world_size
    valid = indices >= 0
    dest = torch.where(valid, indices // experts_per_rank, torch.full_like(indices, world_size))
    in_rank = torch.zeros((indices.shape[0], world_size + 1), dtype=torch.bool, device=indices.device)
    in_rank.scatter_(1, dest.long(), True)
    is_token_in_rank = in_rank[:, :world_size].contiguous()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=indices.device)
    flat = torch.where(valid, indices, torch.full_like(indices, num_experts)).reshape(-1).long()
    per_expert.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return is_token_in_rank.sum(0, dtype=torch.int32), per_expert[:num_experts], is_token_in_rank


def localize(indices, probs, rank_of_row, experts_per_rank):
    """Translate global expert ids of send rows to the receiver's local ids (-1 elsewhere)."""
    # in the indices' dtype (int32 stays int32, as TURBO and DeepEP return it): rank_of_row is int64
    local = indices - (rank_of_row * experts_per_rank).to(indices.dtype).unsqueeze(-1)
    ok = (indices >= 0) & (local >= 0) & (local < experts_per_rank)
    local_idx = torch.where(ok, local, torch.full_like(local, -1))
    local_probs = torch.where(ok, probs, torch.zeros_like(probs)) if probs is not None else None
    return local_idx, local_probs


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Row-preserving uint8 view: all_to_all in bytes works for every dtype on NCCL and gloo."""
    t = t.contiguous()
    width = math.prod(t.shape[1:]) * t.element_size()  # from the shape: a 0-row tensor has no -1 to infer
    if t.numel():
        return t.view(torch.uint8).reshape(t.shape[0], width)
    return torch.empty((t.shape[0], width), dtype=torch.uint8, device=t.device)


def _a2a(send: torch.Tensor, recv_rows: int, send_splits, recv_splits, group) -> torch.Tensor:
    """all_to_all_single on a [rows, ...] tensor of any dtype (moved as bytes)."""
    tail = send.shape[1:]
    recv = torch.empty((recv_rows, *tail), dtype=send.dtype, device=send.device)
    src, dst = _bytes(send), _bytes(recv)
    if src.shape[1] == 0:
        return recv
    dist.all_to_all_single(dst, src, recv_splits, send_splits, group=group)
    return dst.view(send.dtype).reshape(recv_rows, *tail) if recv.numel() else recv


# -- NCCL backend -------------------------------------------------------------------------------


class DispatchNCCL(KernelBackend):
    @staticmethod
    def can_handle(**kw) -> bool:
        return dist.is_available() and dist.is_initialized()

    @staticmethod
    def execute(*, kind, **kw):
        return _nccl_dispatch(**kw) if kind == "dispatch" else _nccl_combine(**kw)


_META_ROWS: dict = {}


def _meta_row(meta: tuple, device: torch.device) -> torch.Tensor:
    """The metadata signature on the device, cached: a fresh host->device copy per dispatch would block
    the host until the GPU queue drains, before the count exchange is even queued."""
    row = _META_ROWS.get((meta, device))
    if row is None:
        row = _META_ROWS[(meta, device)] = torch.tensor(meta, dtype=torch.int64, device=device)
    return row


def _exchange_counts(send_counts, send_routes, meta, group, world_size):
    """One all_to_all carrying the per-rank row counts, the (token, expert) routes per rank and a
    metadata signature, checked on arrival so that ranks called with inconsistent shapes raise
    instead of hanging in the payload exchange. Returns (send splits, recv splits, routes received)."""
    row = _meta_row(tuple(meta), send_counts.device)
    counts = torch.stack([send_counts.to(torch.int64), send_routes.to(torch.int64)], dim=1)
    send = torch.cat([counts, row.expand(world_size, -1)], dim=1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    # the inherent host sync of the NCCL path: one device->host copy of what was received and sent
    recv_cpu = torch.cat([recv, send[:, :1]], dim=1).cpu()
    send_splits, recv_splits = recv_cpu[:, -1].tolist(), recv_cpu[:, 0].tolist()
    routes = int(recv_cpu[:, 1].sum())
    recv_cpu = recv_cpu[:, :-1]
    bad = [w for w in range(world_size) if recv_cpu[w, 2:].tolist() != list(meta)]
    if bad:
        raise ValueError(
            f"moe_dispatch: ranks {bad} called with (num_experts, hidden, topk, dtype id, has_probs, x_scale "
            f"bytes per row or -1) = {[recv_cpu[w, 2:].tolist() for w in bad]}, this rank with {list(meta)}"
        )
    return send_splits, recv_splits, routes


_DTYPE_IDS = {d: i for i, d in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                          torch.float8_e5m2, torch.float64])}  # fmt: skip


def _nccl_dispatch(*, x, x_scale, indices, probs, num_experts, group, is_token_in_rank=None, **_):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    experts_per_rank = num_experts // world_size
    t, hidden = x.shape
    if is_token_in_rank is None:
        _, _, is_token_in_rank = dispatch_layout(indices, num_experts, world_size)
    send_counts = is_token_in_rank.sum(0, dtype=torch.int64)
    # routes per destination rank: the receiver's exact permute size, known with the same sync (scatter_add,
    # not bincount: CUDA bincount reads the max id back to the host, a second sync before the exchange)
    dest = torch.where(indices >= 0, indices // experts_per_rank, world_size).reshape(-1).long()
    send_routes = torch.zeros(world_size + 1, dtype=torch.int64, device=x.device)
    send_routes = send_routes.scatter_add_(0, dest, torch.ones_like(dest))[:world_size]
    scale_cols = math.prod(x_scale.shape[1:]) * x_scale.element_size() if x_scale is not None else -1
    meta = (num_experts, hidden, indices.shape[1], _DTYPE_IDS.get(x.dtype, 99), probs is not None,
            scale_cols)  # fmt: skip
    send_splits, recv_splits, recv_routes = _exchange_counts(
        send_counts, send_routes, meta, group, world_size
    )
    num_send, num_recv = sum(send_splits), sum(recv_splits)

    row_id_map, _, _ = build_row_id_map(is_token_in_rank, world_size, num_send, 0, None)
    send_x, _ = moe_permute_fwd(x, row_id_map, None, num_send, False)
    send_src = _send_sources(row_id_map, num_send)
    rank_of_row = torch.repeat_interleave(
        torch.arange(world_size, device=x.device),
        send_counts,  # on the device already: no host->device copy of the splits
        output_size=num_send,
    )
    send_idx, send_probs = localize(indices[send_src], probs[send_src] if probs is not None else None,
                                    rank_of_row, experts_per_rank)  # fmt: skip

    recv_x = _a2a(send_x, num_recv, send_splits, recv_splits, group)
    recv_idx = _a2a(send_idx, num_recv, send_splits, recv_splits, group)
    recv_probs = _a2a(send_probs, num_recv, send_splits, recv_splits, group) if probs is not None else None
    recv_scale = None
    if x_scale is not None:
        # columns from the shape: a rank with zero tokens has no -1 to infer (and would leave its peers
        # waiting in the scale exchange)
        send_scale = x_scale.reshape(t, math.prod(x_scale.shape[1:]))[send_src]
        recv_scale = _a2a(send_scale, num_recv, send_splits, recv_splits, group).reshape(
            num_recv, *x_scale.shape[1:]
        )
    tokens_per_expert = torch.zeros(experts_per_rank + 1, dtype=torch.int32, device=x.device)
    flat = (
        torch.where(recv_idx >= 0, recv_idx, torch.full_like(recv_idx, experts_per_rank)).reshape(-1).long()
    )
    tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    handle = DispatchHandle(
        BackendType.NCCL, group, t, num_experts, hidden, row_id_map, send_splits, recv_splits, num_recv,
        extra={"rank": rank}, num_recv_routes=recv_routes,
    )  # fmt: skip
    return recv_x, recv_scale, recv_idx, recv_probs, tokens_per_expert[:experts_per_rank], handle


def _send_sources(row_id_map: torch.Tensor, num_send: int) -> torch.Tensor:
    """Inverse of the [T, W] row map: the source token of every send row."""
    t = row_id_map.shape[0]
    src = torch.zeros(num_send + 1, dtype=torch.int64, device=row_id_map.device)
    rows = torch.where(row_id_map >= 0, row_id_map, num_send).reshape(-1).long()
    tok = torch.arange(t, device=row_id_map.device).unsqueeze(1).expand_as(row_id_map).reshape(-1)
    src.scatter_(0, rows, tok)
    return src[:num_send]


def _sum_per_token(back: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """The returned rows summed per source token. A rank that sent nothing (every route dropped) gets
    zeros: the eager unpermute gathers row 0 of the empty buffer for its -1 entries (an IndexError)."""
    if back.shape[0] == 0:
        return back.new_zeros((handle.num_tokens, *back.shape[1:]))
    return moe_unpermute_fwd(back, handle.row_id_map, None, handle.num_tokens)


def _nccl_combine(*, x, handle, topk_weights=None, **_):
    """Reverse of dispatch: recv rows back to their source rank, summed per token (fp32)."""
    back = _a2a(x.contiguous(), sum(handle.send_splits), handle.recv_splits, handle.send_splits, handle.group)
    out = _sum_per_token(back, handle)
    weights = None
    if topk_weights is not None:
        wback = _a2a(topk_weights.float().contiguous(), sum(handle.send_splits), handle.recv_splits,
                     handle.send_splits, handle.group)  # fmt: skip
        weights = _sum_per_token(wback, handle)
    return out, weights


def nccl_dispatch_cached(x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Dispatch of x with the layout of an earlier dispatch (combine's backward)."""
    num_send = sum(handle.send_splits)
    send_x, _ = moe_permute_fwd(x.contiguous(), handle.row_id_map, None, num_send, False)
    return _a2a(send_x, handle.num_recv, handle.send_splits, handle.recv_splits, handle.group)


# -- DEEP_EP backend ----------------------------------------------------------------------------


def _real_deep_ep():
    try:
        import deep_ep  # noqa: F401
    except Exception:
        return None
    if getattr(deep_ep, "__primus_turbo_shim__", False):  # our own Buffer installed as deep_ep
        return None
    return deep_ep


class DispatchDeepEP(KernelBackend):
    """The external DeepEP package (NVIDIA); only when it imports (never on CPU)."""

    @staticmethod
    def can_handle(**kw) -> bool:
        x = kw.get("x")
        return isinstance(x, torch.Tensor) and x.is_cuda and _real_deep_ep() is not None

    @staticmethod
    def execute(*, kind, **kw):
        from primus_turbo.pytorch.kernels.moe.ep_deepep import deepep_combine, deepep_dispatch

        return deepep_dispatch(**kw) if kind == "dispatch" else deepep_combine(**kw)


class DispatchTurbo(KernelBackend):
    """Own intranode kernels over torch symmetric memory (CUDA, NCCL group, one node)."""

    @staticmethod
    def can_handle(**kw) -> bool:
        try:
            from primus_turbo.pytorch.kernels.moe.ep_turbo import turbo_can_handle
        except Exception:
            return False
        return turbo_can_handle(**kw)

    @staticmethod
    def execute(*, kind, **kw):
        from primus_turbo.pytorch.kernels.moe.ep_turbo import turbo_combine, turbo_dispatch

        return turbo_dispatch(**kw) if kind == "dispatch" else turbo_combine(**kw)


class MoEDispatchCombineDispatcher(AutoKernelDispatcher):
    op_name = "moe_dispatch_combine"
    backends = {
        BackendType.TURBO: DispatchTurbo,
        BackendType.DEEP_EP: DispatchDeepEP,
        BackendType.NCCL: DispatchNCCL,
    }
    # TURBO is opt-in (PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND=TURBO) until its 2-GPU tests and
    # bench_moe_dispatch have run on H200; then move it first.
    default_order = (BackendType.DEEP_EP, BackendType.NCCL, BackendType.TURBO)

    @classmethod
    def make_key(cls, **kw):
        x = kw.get("x")
        return (kw["kind"], tuple(x.shape[1:]), x.dtype)

    @classmethod
    def precision(cls, **kw):
        x = kw.get("x")
        from primus_turbo.pytorch.core.backend import precision_of_dtype

        return precision_of_dtype(x.dtype) if isinstance(x, torch.Tensor) else "other"

    @classmethod
    def resolve(cls, **kw):
        # Never autotune a collective: ranks could pick different backends and deadlock.
        from primus_turbo.pytorch.core.backend import GlobalBackendManager

        if kw.get("kind") == "combine":
            return kw["handle"].backend
        pinned, _ = GlobalBackendManager.user_backend(cls.op_name, cls.precision(**kw))
        if pinned is not None:
            return super().resolve(**kw)
        for backend in cls.default_order:
            if cls.backends[backend].can_handle(**kw):
                return backend
        raise ValueError(f"{cls.op_name}: no backend can handle these inputs ({cls.describe(**kw)})")
