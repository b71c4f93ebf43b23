"""Context-parallel attention: Ulysses (all-to-all heads <-> sequence) and ring (KV rotation).

``flash_attn_usp_func(q, k, v, ..., ulysses_group=None, ring_group=None)`` takes this rank's BSHD
shard of the sequence and returns this rank's shard of the output.

* Ulysses: q/k/v [B, S/U, H, D] -> all-to-all -> [B, S, H/U, D], local attention, all-to-all
  back. Hq and Hk must be divisible by the Ulysses size U.
* Ring: each rank keeps its q and passes K/V around the ring with ``batch_isend_irecv``, started
  before the current block's compute so the transfer overlaps it. Partial outputs are merged with
  their LSE. Backward walks the ring again with the merged out/LSE (flash-attention style: the
  block backward only needs the final out and LSE) and sends the dK/dV accumulators along with
  K/V, so they arrive back at their owner after a full turn.
* Causal ring uses the zigzag split for load balance: with R ranks the sequence is cut into 2R
  chunks and ring rank r holds chunks (r, 2R-1-r), in that order. Then step 0 is causal on the
  local pair, a block from a lower rank is seen fully by all local queries against its first
  chunk only, and a block from a higher rank is seen fully by the local second chunk only: every
  step costs half a block per rank.
* With both groups the Ulysses all-to-all runs inside each ring rank: Ulysses rank u holds the u-th
  contiguous piece of its ring rank's (zigzag) local sequence. ``split_sequence_for_cp`` produces
  that layout from a full sequence; ``gather_sequence_for_cp`` inverts it.

Not supported under CP (clear errors): dropout, sliding windows, varlen, and causal ring attention
with seqlen_q != seqlen_k. Every rank must pass the same shapes and flags (a mismatch hangs, aborts a
rank or returns garbage); PRIMUS_TURBO_DEBUG_CHECKS=1 compares them (a collective per call) and makes
every rank raise instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.core.utils import check_ranks_agree, debug_checks_enabled
from primus_turbo.pytorch.kernels.attention.attention_impl import (
    SDPA_BACKENDS,
    AttentionDispatcher,
    attention_bwd,
    attention_fwd,
)
from primus_turbo.pytorch.ops.attention.attention import _softmax_scale, _validate, flash_attn_func

__all__ = ["flash_attn_usp_func", "split_sequence_for_cp", "gather_sequence_for_cp"]


# ---------------------------------------------------------------------------------------------
# sequence layout helpers
# ---------------------------------------------------------------------------------------------
def _ring_chunk_ids(ring_size: int, ring_rank: int, causal: bool) -> list[int]:
    return [ring_rank, 2 * ring_size - 1 - ring_rank] if causal else [ring_rank]


def _check_cp_layout(ring_size, ulysses_size) -> None:
    for name, size in (("ring_size", ring_size), ("ulysses_size", ulysses_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r}: expected a positive int")


def split_sequence_for_cp(x, seq_dim, ring_size=1, ring_rank=0, ulysses_size=1, ulysses_rank=0, causal=True):
    """This rank's shard of a full sequence, in the layout ``flash_attn_usp_func`` expects.

    ``ring_rank`` / ``ulysses_rank`` are ranks within the ring / Ulysses group (not global ranks)."""
    _check_cp_layout(ring_size, ulysses_size)
    for name, rank, size in (
        ("ring_rank", ring_rank, ring_size),
        ("ulysses_rank", ulysses_rank, ulysses_size),
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            # a rank past the size picked another rank's zigzag chunks (chunk ids wrap around) silently
            raise ValueError(f"split_sequence_for_cp: {name}={rank!r} must be an int in [0, {size})")
    n_chunks = 2 * ring_size if causal else ring_size
    if x.shape[seq_dim] % (n_chunks * ulysses_size):
        raise ValueError(
            f"split_sequence_for_cp: the sequence length {x.shape[seq_dim]} must be a multiple of "
            f"{n_chunks * ulysses_size} ({'2 x ' if causal else ''}ring_size {ring_size} x ulysses_size "
            f"{ulysses_size}) so that every rank gets an equal shard"
        )
    chunks = x.chunk(n_chunks, dim=seq_dim)
    local = torch.cat([chunks[i] for i in _ring_chunk_ids(ring_size, ring_rank, causal)], dim=seq_dim)
    return local.chunk(ulysses_size, dim=seq_dim)[ulysses_rank]


def gather_sequence_for_cp(shards, seq_dim, ring_size=1, ulysses_size=1, causal=True):
    """Inverse of ``split_sequence_for_cp``: shards[ring_rank * ulysses_size + ulysses_rank]."""
    _check_cp_layout(ring_size, ulysses_size)
    if len(shards) != ring_size * ulysses_size:  # extra shards were ignored silently
        raise ValueError(
            f"gather_sequence_for_cp: expected ring_size x ulysses_size = {ring_size * ulysses_size} shards, "
            f"got {len(shards)}"
        )
    n_chunks = 2 * ring_size if causal else ring_size
    chunks = [None] * n_chunks
    for r in range(ring_size):
        local = torch.cat(shards[r * ulysses_size : (r + 1) * ulysses_size], dim=seq_dim)
        ids = _ring_chunk_ids(ring_size, r, causal)
        for i, part in zip(ids, local.chunk(len(ids), dim=seq_dim)):
            chunks[i] = part
    return torch.cat(chunks, dim=seq_dim)


# ---------------------------------------------------------------------------------------------
# Ulysses all-to-all
# ---------------------------------------------------------------------------------------------
def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/U, H, D] -> [B, S, H/U, D]."""
    world = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[src] = src's sequence piece, my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, H/U, D] -> [B, S/U, H, D]."""
    world = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[src] = my sequence piece, src's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


# ---------------------------------------------------------------------------------------------
# ring
# ---------------------------------------------------------------------------------------------
def _start_exchange(tensors, group):
    """Send ``tensors`` to the next ring rank and receive the previous rank's into new buffers."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, group) for t in recv]
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _step_plan(step: int, rank: int, world: int, causal: bool, half_q: int, half_k: int):
    """(q rows slice, kv rows slice, causal) for the block of ring step ``step`` (see module doc)."""
    full = slice(None)
    if not causal:
        return full, full, False
    if step == 0:
        return full, full, True
    src = (rank - step) % world
    if src < rank:
        return full, slice(0, half_k), False
    return slice(half_q, None), full, False


def _block_fwd(backend, q, k, v, causal, sink, scale):
    right = 0 if causal else -1
    out, lse = attention_fwd(q, k, v, None, None, q.shape[1], k.shape[1], sink, scale, -1, right, 0.0, 0,
                             backend.value)  # fmt: skip
    return out.float(), lse.masked_fill(torch.isposinf(lse), float("-inf"))


def _merge(out, lse, block_out, block_lse, rows):
    """out [B, S, H, Dv] fp32 and lse [B, H, S] updated in place on ``rows`` with a partial result."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    safe = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(old_lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - safe).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * w_old + block_out * w_new
    lse[:, :, rows] = new_lse


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, scale, causal, group, backend):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        half_q, half_k = q.shape[1] // 2, k.shape[1] // 2
        out = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
        k_cur, v_cur = k, v
        for step in range(world):
            reqs, nxt = _start_exchange([k_cur, v_cur], group) if step < world - 1 else ([], None)
            rows, cols, blk_causal = _step_plan(step, rank, world, causal, half_q, half_k)
            blk_out, blk_lse = _block_fwd(backend, q[:, rows], k_cur[:, cols], v_cur[:, cols], blk_causal,
                                          sink if step == 0 else None, scale)  # fmt: skip
            _merge(out, lse, blk_out, blk_lse, rows)
            _wait(reqs)
            if nxt is not None:
                k_cur, v_cur = nxt
        out = out.to(q.dtype)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (scale, causal, group, backend)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        scale, causal, group, backend = ctx.args
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        half_q, half_k = q.shape[1] // 2, k.shape[1] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dsink = None
        k_cur, v_cur = k, v
        grad_reqs, grad_recv = [], None
        for step in range(world):
            kv_reqs, kv_next = _start_exchange([k_cur, v_cur], group) if step < world - 1 else ([], None)
            rows, cols, blk_causal = _step_plan(step, rank, world, causal, half_q, half_k)
            blk_sink = sink if step == 0 else None
            bdq, bdk, bdv, bdsink = attention_bwd(
                dout[:, rows], q[:, rows], k_cur[:, cols], v_cur[:, cols], out[:, rows],
                lse[:, :, rows].contiguous(), None, None, q[:, rows].shape[1], k_cur[:, cols].shape[1],
                blk_sink, scale, -1, 0 if blk_causal else -1, 0.0, 0, backend.value,
            )  # fmt: skip
            dq[:, rows] += bdq.float()
            if blk_sink is not None:
                dsink = bdsink
            dk_blk = torch.zeros_like(k, dtype=torch.float32)
            dv_blk = torch.zeros_like(v, dtype=torch.float32)
            dk_blk[:, cols] = bdk.float()
            dv_blk[:, cols] = bdv.float()
            _wait(grad_reqs)  # the accumulators for this K/V block, from the previous rank
            if grad_recv is not None:
                dk_blk += grad_recv[0]
                dv_blk += grad_recv[1]
            grad_reqs, grad_recv = _start_exchange([dk_blk, dv_blk], group)
            _wait(kv_reqs)
            if kv_next is not None:
                k_cur, v_cur = kv_next
        _wait(grad_reqs)  # after a full turn the accumulators of our own K/V are back
        dk, dv = grad_recv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None, None, None


def _ring_backend(q, k, v, sink, scale, causal, deterministic) -> BackendType:
    kw = dict(
        q=q, k=k, v=v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1],
        sink=sink, softmax_scale=scale, window_left=-1, window_right=0 if causal else -1, dropout_p=0.0,
        deterministic=deterministic, return_lse=True,
    )  # fmt: skip
    backend = AttentionDispatcher.resolve(**kw)
    if backend in SDPA_BACKENDS:  # cannot happen with return_lse=True; keep the invariant loud
        raise ValueError(f"flash_attn_usp: ring attention needs an LSE-returning backend, got {backend.name}")
    if not torch.compiler.is_compiling():
        AttentionDispatcher.last_backend = backend  # what the ring's blocks run on (reports, tests)
    return backend


def _cp_group_size(arg: str, group) -> int:
    """The size of a CP group argument (1 for None); a wrong one raises here, not deep in torch."""
    if group is None:
        return 1
    try:
        size = dist.get_world_size(group)
    except (AttributeError, TypeError) as err:  # not a group (str, int, list, ...)
        raise TypeError(
            f"flash_attn_usp: {arg} must be a ProcessGroup or None, got {type(group).__name__}"
        ) from err
    if size < 1:  # -1: dist.new_group's GroupMember.NON_GROUP_MEMBER, on the ranks left out of the group
        raise ValueError(
            f"flash_attn_usp: {arg}: this rank (global rank {dist.get_rank()}) is not a member of the group"
        )
    return size


def _check_cp_ranks_agree(q, k, v, sink, scale, causal, ulysses_group, ring_group, u_size, r_size):
    """PRIMUS_TURBO_DEBUG_CHECKS=1: every rank raises when the groups overlap beyond this rank or the ranks
    pass different shapes/flags (without it: a hang, an aborted rank or another rank's rows read wrongly)."""
    if u_size > 1 and r_size > 1:
        ranks = dist.get_process_group_ranks
        shared = set(ranks(ulysses_group)) & set(ranks(ring_group))
        if shared != {dist.get_rank()}:
            raise ValueError(
                f"flash_attn_usp: ulysses_group and ring_group share ranks {sorted(shared)}; they must be "
                "orthogonal (meet only in this rank)"
            )
    sig = dict(q=(tuple(q.shape), q.dtype), k=tuple(k.shape), v=tuple(v.shape), sink=sink is not None,
               scale=scale, causal=causal, ulysses_size=u_size, ring_size=r_size)  # fmt: skip
    for group, size in ((ulysses_group, u_size), (ring_group, r_size)):
        if size > 1:
            check_ranks_agree("flash_attn_usp", sig, group)


def flash_attn_usp_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        deterministic=False, sink=None, ulysses_group=None, ring_group=None):  # fmt: skip
    """Context-parallel flash_attn_func over this rank's BSHD shard (layout: module docstring)."""
    _validate(q, k, v, False, window_size, sink, dropout_p)
    if dropout_p > 0.0:
        raise ValueError(f"flash_attn_usp: dropout_p must be 0 under context parallelism, got {dropout_p}")
    if tuple(window_size) != (-1, -1):
        raise ValueError(
            f"flash_attn_usp: window_size must be (-1, -1) under context parallelism, got {window_size}"
        )
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    u_size, r_size = _cp_group_size("ulysses_group", ulysses_group), _cp_group_size("ring_group", ring_group)
    if u_size > 1 and r_size > 1 and ulysses_group is ring_group:
        raise ValueError(
            "flash_attn_usp: ulysses_group and ring_group are the same group; they must be orthogonal "
            "(each rank's Ulysses and ring peers meet only in itself), or pass one of them as None"
        )
    if not torch.compiler.is_compiling() and debug_checks_enabled():
        _check_cp_ranks_agree(q, k, v, sink, scale, causal, ulysses_group, ring_group, u_size, r_size)
    if r_size > 1 and causal and q.shape[1] != k.shape[1]:
        # the zigzag plan pairs query chunk i with key chunk i: right only for a square (diagonal) mask
        raise ValueError(
            "flash_attn_usp: causal ring attention needs seqlen_q == seqlen_k (the zigzag split follows "
            f"the diagonal, not flash-attn's bottom-right mask), got local q {q.shape[1]}, k {k.shape[1]}"
        )
    if u_size > 1:
        if q.shape[2] % u_size or k.shape[2] % u_size:
            raise ValueError(
                f"flash_attn_usp: Ulysses size {u_size} must divide q heads {q.shape[2]} "
                f"and k/v heads {k.shape[2]}"
            )
        u_rank = dist.get_rank(ulysses_group)
        q, k, v = (_SeqToHeads.apply(t.contiguous(), ulysses_group) for t in (q, k, v))
        if sink is not None:
            per = sink.shape[0] // u_size
            sink = sink[u_rank * per : (u_rank + 1) * per]
    if r_size > 1:
        if causal and (q.shape[1] % 2 or k.shape[1] % 2):
            raise ValueError(
                "flash_attn_usp: causal ring needs an even local sequence (2 zigzag chunks), "
                f"got {q.shape[1]}"
            )
        q, k, v = (t.contiguous() for t in (q, k, v))  # the ring sends K/V as given
        backend = _ring_backend(q, k, v, sink, scale, causal, deterministic)
        out = _RingAttention.apply(q, k, v, sink, scale, causal, ring_group, backend)
    else:
        out = flash_attn_func(
            q, k, v, softmax_scale=scale, causal=causal, deterministic=deterministic, sink=sink
        )
    if u_size > 1:
        out = _HeadsToSeq.apply(out.contiguous(), ulysses_group)
    return out
