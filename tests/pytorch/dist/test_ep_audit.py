"""EP dispatch/combine (NCCL path over gloo) and deep_ep.Buffer against an all-gather reference, 3 CPU ranks.

The reference: every rank all-gathers every rank's (x, indices, probs); rank r receives, source rank by source
rank and token by token, each token once if any of its experts lives on r (expert e on rank e // (E / W)),
with its local expert ids (-1 elsewhere) and probs (0 elsewhere), as DeepEP's normal-mode dispatch does.
"""

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_utils import assert_close

WORLD = 3


def _routing(case, rank, num_experts, topk, gen):
    """Skewed routings. ``tokens`` is per rank; rank 1 has none in the skewed cases."""
    epr = num_experts // WORLD
    tokens = {"skewed": [6, 0, 9], "dropped_sender": [5, 4, 7], "plain": [4, 6, 5]}[case][rank]
    idx = torch.empty((tokens, topk), dtype=torch.long)
    for t in range(tokens):
        idx[t] = torch.randperm(num_experts, generator=gen)[:topk]
    if case == "skewed":
        # nothing for the last rank's experts; expert 0 gets every token; with topk >= 2 every token also
        # reaches expert 1 (rank 0 again): sent once, with both local ids
        idx = idx % ((WORLD - 1) * epr)
        if topk >= 2:
            idx[:, 0], idx[:, 1] = 0, 1
            idx[:, 2:] = torch.where(idx[:, 2:] < 2, -1, idx[:, 2:])
    if case == "dropped_sender" and rank == 0:
        idx[:] = -1  # this rank sends nothing at all
    if tokens:
        idx[0, -1] = -1
    return idx


def _gathered_inputs(case, rank, num_experts, topk, hidden, dtype, with_probs):
    gen = torch.Generator().manual_seed(len(case) + 1000 * rank + 100 * num_experts + 10 * topk + hidden)
    idx = _routing(case, rank, num_experts, topk, gen)
    x = torch.randn(idx.shape[0], hidden, generator=gen).to(dtype)
    probs = torch.rand(idx.shape, generator=gen) if with_probs else None
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, (x, idx, probs))
    return everyone


def _reference_dispatch(everyone, rank, num_experts):
    epr = num_experts // WORLD
    xs, ids, ps = [], [], []
    for x, idx, probs in everyone:
        owner = torch.where(idx >= 0, idx // epr, -1)
        sent = (owner == rank).any(1)
        xs.append(x[sent])
        ids.append(torch.where(owner == rank, idx - rank * epr, -1)[sent])
        if probs is not None:
            ps.append(torch.where(owner == rank, probs, 0.0)[sent])
    return torch.cat(xs), torch.cat(ids), torch.cat(ps) if ps else None


def _check_dispatch_combine(rank, case, num_experts, topk, hidden, dtype, with_probs, idx_dtype):
    from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch

    tag = f"{case} E={num_experts} topk={topk} hidden={hidden} {dtype} probs={with_probs} {idx_dtype}"
    tag += f" TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}"
    everyone = _gathered_inputs(case, rank, num_experts, topk, hidden, dtype, with_probs)
    x0, idx, probs0 = everyone[rank]
    idx = idx.to(idx_dtype)
    x = x0.clone().requires_grad_(True)
    probs = probs0.clone().requires_grad_(True) if with_probs else None
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = moe_dispatch(x, idx, probs, num_experts)

    ref_x, ref_idx, ref_probs = _reference_dispatch(everyone, rank, num_experts)
    assert torch.equal(recv_x.detach(), ref_x), tag
    assert recv_idx.dtype == idx_dtype and torch.equal(recv_idx.long(), ref_idx), tag
    assert (recv_probs is None) if not with_probs else torch.equal(recv_probs.detach(), ref_probs), tag
    epr = num_experts // WORLD
    ref_counts = torch.stack([(ref_idx == e).sum() for e in range(epr)]).int()
    assert torch.equal(tokens_per_expert, ref_counts), tag

    owner = torch.where(idx >= 0, idx // epr, -1)
    num_dest = sum((owner == w).any(1).to(dtype) for w in range(WORLD)).unsqueeze(1)
    # identity experts: combine(dispatch(x)) == x * number of destination ranks, exactly in fp32 (at most 3
    # terms); bf16 within tolerance: the Triton interpreter (CPU tests) truncates fp32 -> bf16, GPUs round
    round_trip = moe_combine(recv_x.detach(), None, handle)
    if dtype == torch.float32:
        assert torch.equal(round_trip, x0 * num_dest), tag
    assert_close(round_trip, x0 * num_dest, msg=tag)

    # experts scale by (rank + 1): combine returns sum over destination ranks w of (w + 1) * x; the handle
    # serves a second combine unchanged; grads against the reference's autograd
    out = moe_combine(recv_x * (rank + 1), None, handle)
    assert torch.equal(moe_combine(recv_x.detach() * (rank + 1), None, handle), out.detach()), tag
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
    loss = (out.float() * grad_out.float()).sum()
    if with_probs:
        loss = loss + (recv_probs * (recv_idx >= 0) * (rank + 1)).sum()
    loss.backward()

    ref_x_leaf = x0.clone().requires_grad_(True)
    dest_weight = sum((owner == w).any(1).float() * (w + 1) for w in range(WORLD)).unsqueeze(1)
    ref_out = (ref_x_leaf.float() * dest_weight).to(dtype)
    ref_loss = (ref_out.float() * grad_out.float()).sum()
    if with_probs:
        ref_probs_leaf = probs0.clone().requires_grad_(True)
        ref_loss = ref_loss + (ref_probs_leaf * torch.where(owner >= 0, owner + 1.0, 0.0)).sum()
    ref_loss.backward()
    assert_close(out, ref_out, msg=tag)
    assert_close(x.grad, ref_x_leaf.grad, msg=tag)
    if with_probs:
        assert torch.equal(probs.grad, ref_probs_leaf.grad), tag

    if dtype == torch.float32:  # the (x_fp8, x_scale) form: rows and their scales travel together
        scale = x0.abs().amax(-1, keepdim=True).clamp(min=1e-3) / 448.0
        x_fp8 = (x0 / scale).to(torch.float8_e4m3fn)
        (recv_fp8, recv_scale), recv_idx8, _, _, _ = moe_dispatch((x_fp8, scale), idx, probs0, num_experts)
        deq = []  # every source's dequantized rows, dispatched by the reference
        for src_x, src_idx, _ in everyone:
            src_scale = src_x.abs().amax(-1, keepdim=True).clamp(min=1e-3) / 448.0
            deq.append(((src_x / src_scale).to(torch.float8_e4m3fn).float() * src_scale, src_idx, None))
        ref_deq, _, _ = _reference_dispatch(deq, rank, num_experts)
        assert torch.equal(recv_fp8.float() * recv_scale, ref_deq) and torch.equal(recv_idx8, recv_idx), tag


CASES = [  # (routing, num_experts, topk, hidden, dtype, probs, indices dtype)
    ("skewed", 6, 3, 5, torch.float32, True, torch.int64),
    ("skewed", 6, 1, 1, torch.bfloat16, False, torch.int64),
    ("skewed", 12, 8, 7, torch.float32, True, torch.int32),
    ("dropped_sender", 6, 2, 3, torch.float32, True, torch.int64),
    ("dropped_sender", 12, 8, 1, torch.bfloat16, True, torch.int32),
    ("plain", 9, 4, 4, torch.float32, False, torch.int32),
]


def _body_reference(rank, world, device):
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    # both CPU paths of the permute kernels under dispatch/combine: the Triton interpreter (tests/conftest.py
    # sets it) and the eager torch fallback that a CPU run without TRITON_INTERPRET takes
    saved = os.environ.get("TRITON_INTERPRET")
    # only where the interpreter was on when Triton was imported (CPU CI): switched on later (a GPU machine),
    # Triton's own @jit helpers (tl.zeros in 3.6) stay compiled functions and the interpreter cannot call them
    modes = ("1", "0") if saved not in (None, "", "0") else ("0",)
    try:
        for interpret in modes:
            os.environ["TRITON_INTERPRET"] = interpret
            GlobalBackendManager.reset()  # drops the cached automatic backend choices
            for case in CASES:
                _check_dispatch_combine(rank, *case)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved
        GlobalBackendManager.reset()


def _body_buffer(rank, world, device):
    """deep_ep.Buffer: layout meanings, round trip, cached dispatch, and its bad inputs."""
    from primus_turbo.pytorch.deep_ep import Buffer

    num_experts, epr = 6, 2
    x, idx, probs = _gathered_inputs("plain", rank, num_experts, 3, 4, torch.float32, True)[rank]
    buf = Buffer(dist.group.WORLD, 0, 0)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    owner = torch.where(idx >= 0, idx // epr, -1)
    ref_in_rank = torch.stack([(owner == w).any(1) for w in range(WORLD)], 1)
    assert per_rdma_rank is None and in_rank.dtype == torch.bool and torch.equal(in_rank, ref_in_rank)
    assert torch.equal(per_rank, ref_in_rank.sum(0).int())
    assert torch.equal(per_expert, torch.stack([(idx == e).sum() for e in range(num_experts)]).int())
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
        x, topk_idx=idx, topk_weights=probs, **layout
    )
    event.current_stream_wait()
    assert counts == [int((recv_idx == e).sum()) for e in range(epr)]
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    assert torch.equal(out, x * ref_in_rank.sum(1, keepdim=True).float())
    assert torch.equal(out_w, torch.where(idx >= 0, probs, 0.0))  # a dropped slot reaches no rank: 0
    assert torch.equal(buf.dispatch(x, handle=handle)[0], recv_x)

    # an expert id == num_experts was dropped silently by the layout; larger ids raised an IndexError
    for bad in (num_experts, num_experts + epr + 1):
        with pytest.raises(ValueError, match=r"Buffer.get_dispatch_layout: indices must be in \[-1, 6\)"):
            buf.get_dispatch_layout(torch.full_like(idx, bad), num_experts)
        with pytest.raises(ValueError, match=r"Buffer.dispatch: indices must be in \[-1, 6\)"):
            buf.dispatch(x, topk_idx=torch.full_like(idx, bad), topk_weights=probs, **layout)
    with pytest.raises(ValueError, match="Buffer.dispatch: probs shape"):
        buf.dispatch(x, topk_idx=idx, topk_weights=probs[:, :2], **layout)
    with pytest.raises(ValueError, match="Buffer.dispatch: is_token_in_rank must be"):
        buf.dispatch(x, topk_idx=idx, topk_weights=probs, **{**layout, "is_token_in_rank": in_rank[:, :2]})


def _body_bad_inputs(rank, world, device):
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.ops.moe.dispatch import moe_dispatch

    x, idx = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        moe_dispatch(x, idx, None, 6.0)
    # scales of different widths per rank: an error naming the ranks, not a mis-sized exchange
    scale = torch.ones(4, 1 + rank)
    with pytest.raises(ValueError, match="ranks .* called with"):
        moe_dispatch((x.to(torch.float8_e4m3fn), scale), idx, None, 6)
    GlobalBackendManager.set_moe_dispatch_combine_backend("TURBO")
    try:
        with pytest.raises(ValueError, match="backend TURBO .* cannot handle"):
            moe_dispatch(x, idx, None, 6)
    finally:
        GlobalBackendManager.reset()


def _body_all(rank, world, device):
    _body_reference(rank, world, device)
    _body_buffer(rank, world, device)
    _body_bad_inputs(rank, world, device)


def test_ep_dispatch_combine_reference_3_ranks():
    """One spawn (process start dominates): a hang fails after timeout_s + 30 s instead of blocking."""
    run_distributed(_body_all, world_size=WORLD, backend="gloo", timeout_s=60)
