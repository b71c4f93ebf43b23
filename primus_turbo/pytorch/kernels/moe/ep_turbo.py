"""TURBO expert-parallel backend: intranode dispatch/combine over torch symmetric memory, no host sync.

Every rank owns one symmetric workspace (per process group) holding, in this order:
    counts [W, W] int64        counts[s, d] = rows rank s sends to rank d (row s written by rank s)
    recv_x [R, H]              R = W * max_tokens rows; source s owns rows [base_s, base_s + counts[s, me])
    recv_idx / recv_probs [R, K], recv_scale [R, S]
    comb_y [R, H], comb_w [R, K]   combine landing zone, laid out like this rank's send order
Dispatch: barrier; number my tokens per destination and write my count row into every peer (one
kernel); barrier; push my rows into every peer's recv_x (Triton, peers' memory through their base
pointers); barrier; copy the received rows out, counting them per local expert.
Combine: barrier; push rows back into their source's comb_y; barrier; sum per token (unpermute).
Barriers are ``_SymmetricMemory.barrier`` kernels (device-side signal pads), so nothing waits on the
host and the sequence is CUDA-graph capturable. Receive tensors are worst-case sized (R rows);
rows past the received total have index -1 (their data is unspecified).

``PRIMUS_TURBO_EP_MAX_TOKENS`` (default 8192) bounds the tokens per rank; it must be the same on
every rank (the workspace is a collective allocation), and a call with more tokens uses NCCL.
Multicast is never used (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 on our machines).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import triton

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.core.utils import debug_checks_enabled, triton_interpret_enabled
from primus_turbo.pytorch.kernels.moe.dispatch_impl import DispatchHandle
from primus_turbo.pytorch.kernels.moe.permute_impl import moe_unpermute_fwd

_workspaces: dict = {}
_group_infos: dict = {}
_group_ok: dict = {}
_retired: list = []
# Bounded SMs for the push kernels; deep_ep.Buffer.set_num_sms or PRIMUS_TURBO_EP_NUM_SMS set it. DeepEP uses
# 20-24 so that compute can overlap; nothing overlaps with our integrations' dispatch/combine, and on 2x H200
# (bench_moe_dispatch, same run) 64 programs made the combine 0.35 -> 0.28 ms and the dispatch 0.47 -> 0.37 ms
# against 32 (half of the 132 SMs stay free).
NUM_PROGRAMS = int(os.environ.get("PRIMUS_TURBO_EP_NUM_SMS", "64"))


def max_tokens() -> int:
    return int(os.environ.get("PRIMUS_TURBO_EP_MAX_TOKENS", "8192"))


def _align(n: int) -> int:
    return (n + 255) // 256 * 256


def turbo_can_handle(**kw) -> bool:
    x, group = kw.get("x"), kw.get("group")
    if kw.get("kind") != "dispatch" or not isinstance(x, torch.Tensor) or not x.is_cuda:
        return False
    if triton_interpret_enabled():
        return False
    group = group if group is not None else dist.group.WORLD
    ok = _group_ok.get(group)
    if ok is None:  # per group once: c10d lookups cost host time on every dispatch
        try:
            import torch.distributed._symmetric_memory as symm_mem  # noqa: F401

            world = dist.get_world_size(group)
            ok = dist.get_backend(group) == "nccl" and world <= min(torch.cuda.device_count(), 8)
        except Exception:
            ok = False
        _group_ok[group] = ok
    if not ok:
        return False
    indices = kw.get("indices")
    return x.shape[0] <= max_tokens() and (indices is None or indices.shape[1] <= 64)


def _layout(world, hidden, elem, topk, scale_cols):
    rows = world * max_tokens()
    sizes = [("counts", world * world * 8), ("recv_x", rows * hidden * elem), ("recv_idx", rows * topk * 4),
             ("recv_probs", rows * topk * 4), ("recv_scale", rows * max(scale_cols, 1) * 4),
             ("comb_y", rows * hidden * max(elem, 2)), ("comb_w", rows * topk * 4)]  # fmt: skip
    offsets, total = {}, 0
    for name, size in sizes:
        offsets[name] = total
        total += _align(size)
    return offsets, total, rows


def _workspace(group, nbytes: int, device):
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    cur = _workspaces.get(name)
    grow = cur is None or cur[0].numel() < nbytes
    # Allocation is collective: check every rank asks for the same size first (a host sync), so mismatched
    # ranks raise instead of hanging. Only when the workspace is created or grows, unless
    # PRIMUS_TURBO_DEBUG_CHECKS=1 checks every call: a mismatch where only one rank grows would hang there.
    if grow or debug_checks_enabled():
        sizes = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, nbytes, group=group)
        if len(set(sizes)) != 1:
            raise ValueError(
                f"moe_dispatch (TURBO): ranks need different workspace sizes {sizes} (hidden size, topk, "
                "dtype or PRIMUS_TURBO_EP_MAX_TOKENS differ across ranks)"
            )
    if grow:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            try:
                enable(name)
            except Exception:
                pass
        if cur is not None:  # kernels queued on the old workspace may still run: keep it alive
            _retired.append(cur)
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        hdl = symm_mem.rendezvous(buf, name)
        raw_ptrs = hdl.buffer_ptrs() if callable(hdl.buffer_ptrs) else hdl.buffer_ptrs
        ptrs = torch.tensor(list(raw_ptrs), dtype=torch.int64, device=device)
        cur = (buf, hdl, ptrs)
        _workspaces[name] = cur
    return cur


def _group_info(group) -> tuple[int, int]:
    """(world size, rank) of a process group, cached (the c10d lookups cost ~10 us of host per call)."""
    info = _group_infos.get(group)
    if info is None:
        info = _group_infos[group] = (dist.get_world_size(group), dist.get_rank(group))
    return info


def _programs(rows: int, block_r: int, per_sm: int = 1) -> int:
    """Persistent grid: one program per BLOCK_R-row tile, at most NUM_PROGRAMS * per_sm programs."""
    return max(1, min(triton.cdiv(rows, block_r), NUM_PROGRAMS * per_sm))


def _view(buf, offset, shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return buf[offset : offset + n * torch.empty((), dtype=dtype).element_size()].view(dtype).view(*shape)


def turbo_dispatch(*, x, x_scale, indices, probs, num_experts, group, is_token_in_rank=None, **_):
    from primus_turbo.triton.moe.ep_kernel import (
        ep_blocks,
        ep_dispatch_push_kernel,
        ep_layout_kernel,
        ep_recv_finalize_kernel,
    )

    group = group if group is not None else dist.group.WORLD
    world, rank = _group_info(group)
    t, hidden = x.shape
    k = indices.shape[1]
    epr = num_experts // world
    scale2d = None
    if x_scale is not None:  # columns from the shape: a 0-token rank has no -1 to infer
        scale2d = x_scale.reshape(t, math.prod(x_scale.shape[1:])).float().contiguous()
    scale_cols = scale2d.shape[1] if scale2d is not None else 0
    offs, nbytes, rows = _layout(world, hidden, x.element_size(), k, scale_cols)
    buf, hdl, ptrs = _workspace(group, nbytes, x.device)
    indices = indices.contiguous()
    in_rank = is_token_in_rank.contiguous().view(torch.uint8) if is_token_in_rank is not None else indices
    pos = torch.empty((t, world), dtype=torch.int32, device=x.device)
    row_id_map = torch.empty((t, world), dtype=torch.int32, device=x.device)
    ws_counts = _view(buf, offs["counts"], (world, world), torch.int64)
    block_r, block_h, block_k, block_w = ep_blocks(hidden, max(k, scale_cols), world)

    # Four kernels and three device-side barriers, no host sync: number the tokens per destination and
    # publish the counts row into every peer; push the rows (and their local expert ids, probs, scales) into
    # the peers' receive regions; copy the received rows out and count them per local expert.
    hdl.barrier(channel=0)  # peers are done reading the previous call's data
    layout_k = triton.next_power_of_2(max(k, 2))  # [BLOCK_T, K] index tiles of ~8K elements
    ep_layout_kernel[(world,)](
        indices, in_rank, pos, ptrs, offs["counts"], rank, t, world, k, epr,
        FROM_INDICES=is_token_in_rank is None, BLOCK_T=max(16, min(1024, 8192 // layout_k)), BLOCK_K=layout_k,
    )  # fmt: skip
    hdl.barrier(channel=0)
    ep_dispatch_push_kernel[(_programs(t, block_r),)](
        x, indices, probs if probs is not None else x, scale2d if scale2d is not None else x, pos, ws_counts,
        row_id_map, ptrs, rank, t, world, hidden, k, scale_cols, epr, offs["recv_x"], offs["recv_idx"],
        offs["recv_probs"], offs["recv_scale"], HAS_PROBS=probs is not None, HAS_SCALE=scale2d is not None,
        WRITE_MAP=True, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_W=block_w, num_warps=8,
    )  # fmt: skip
    hdl.barrier(channel=0)

    recv_x = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    recv_idx = torch.empty((rows, k), dtype=indices.dtype, device=x.device)
    recv_probs = torch.empty((rows, k), dtype=torch.float32, device=x.device) if probs is not None else None
    tokens_per_expert = torch.zeros(epr, dtype=torch.int32, device=x.device)
    ep_recv_finalize_kernel[(_programs(rows, block_r, 4),)](
        _view(buf, offs["recv_x"], (rows, hidden), x.dtype),
        _view(buf, offs["recv_idx"], (rows, k), torch.int32),
        _view(buf, offs["recv_probs"], (rows, k), torch.float32), recv_x, recv_idx,
        recv_probs if recv_probs is not None else recv_x, tokens_per_expert, ws_counts, rank, world, rows,
        hidden, k, HAS_PROBS=probs is not None, HAS_TPE=True, BLOCK_R=block_r, BLOCK_H=block_h,
        BLOCK_K=block_k, BLOCK_W=block_w, num_warps=8,
    )  # fmt: skip
    recv_scale = None
    if scale2d is not None:
        recv_scale = _view(buf, offs["recv_scale"], (rows, scale_cols), torch.float32).clone()
        recv_scale = recv_scale.reshape(rows, *x_scale.shape[1:]).to(x_scale.dtype)
    # combine (and backward) run after later dispatches have rewritten the workspace counts: keep a copy
    counts = ws_counts.clone()
    handle = DispatchHandle(
        BackendType.TURBO, group, t, num_experts, hidden, row_id_map, num_recv=rows,
        extra={"counts": counts, "pos": pos, "indices": indices, "offs": offs, "nbytes": nbytes, "rank": rank,
               "world": world, "comb_elem": max(x.element_size(), 2)},
    )  # fmt: skip
    return recv_x, recv_scale, recv_idx, recv_probs, tokens_per_expert, handle


def turbo_combine(*, x, handle, topk_weights=None, **_):
    from primus_turbo.triton.moe.ep_kernel import ep_blocks, ep_combine_push_kernel

    e = handle.extra
    world, rank, offs = e["world"], e["rank"], e["offs"]
    buf, hdl, ptrs = _workspace(handle.group, e["nbytes"], x.device)
    rows, hidden = x.shape
    k = e["indices"].shape[1]
    if x.element_size() > e["comb_elem"] or hidden != handle.hidden:
        raise ValueError(
            f"moe_combine (TURBO): x must be [{handle.num_recv}, {handle.hidden}] with <= {e['comb_elem']} "
            f"bytes per element, got {tuple(x.shape)} {x.dtype}"
        )
    w = topk_weights.float().contiguous() if topk_weights is not None else None
    block_r, block_h, block_k, block_w = ep_blocks(hidden, k, world)
    hdl.barrier(channel=0)
    ep_combine_push_kernel[(_programs(rows, block_r),)](
        x.contiguous(), w if w is not None else x, e["counts"], ptrs, rank, world, hidden, k, offs["comb_y"],
        offs["comb_w"], HAS_W=w is not None, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_K=block_k,
        BLOCK_W=block_w, num_warps=8,
    )  # fmt: skip
    hdl.barrier(channel=0)
    comb_y = _view(buf, offs["comb_y"], (rows, hidden), x.dtype)
    out = moe_unpermute_fwd(comb_y, handle.row_id_map, None, handle.num_tokens)
    weights = None
    if w is not None:
        comb_w = _view(buf, offs["comb_w"], (rows, k), torch.float32)
        weights = moe_unpermute_fwd(comb_w, handle.row_id_map, None, handle.num_tokens)
    return out, weights


def turbo_dispatch_cached(x, handle):
    """Dispatch x with an earlier dispatch's layout (combine's backward): no count exchange."""
    from primus_turbo.triton.moe.ep_kernel import ep_blocks, ep_dispatch_push_kernel, ep_recv_finalize_kernel

    e = handle.extra
    world, rank, offs = e["world"], e["rank"], e["offs"]
    buf, hdl, ptrs = _workspace(handle.group, e["nbytes"], x.device)
    t, hidden = x.shape
    indices = e["indices"]
    k = indices.shape[1]
    rows = handle.num_recv
    if x.element_size() > e["comb_elem"] or hidden != handle.hidden:
        raise ValueError(f"moe_combine backward (TURBO): grad must be [T, {handle.hidden}], got {x.dtype}")
    block_r, block_h, block_k, block_w = ep_blocks(hidden, k, world)
    x = x.contiguous()
    hdl.barrier(channel=0)
    ep_dispatch_push_kernel[(_programs(t, block_r),)](
        x, indices, x, x, e["pos"], e["counts"], e["pos"], ptrs, rank, t, world, hidden, k, 0,
        handle.num_experts // world, offs["comb_y"], offs["recv_idx"], offs["recv_probs"], offs["recv_scale"],
        HAS_PROBS=False, HAS_SCALE=False, WRITE_MAP=False, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_K=block_k,
        BLOCK_W=block_w, num_warps=8,
    )  # fmt: skip
    hdl.barrier(channel=0)
    recv_x = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    dummy_idx = torch.empty((rows, k), dtype=torch.int32, device=x.device)
    ep_recv_finalize_kernel[(_programs(rows, block_r, 4),)](
        _view(buf, offs["comb_y"], (rows, hidden), x.dtype),
        _view(buf, offs["recv_idx"], (rows, k), torch.int32),
        recv_x, recv_x, dummy_idx, recv_x, dummy_idx, e["counts"], rank, world, rows, hidden, k,
        HAS_PROBS=False, HAS_TPE=False, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_K=block_k, BLOCK_W=block_w,
        num_warps=8,
    )  # fmt: skip
    return recv_x
