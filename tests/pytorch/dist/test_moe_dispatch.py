"""EP dispatch/combine on 2 processes: gloo on CPU (NCCL backend over gloo), 2 GPUs when present."""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_utils import assert_close

NUM_EXPERTS, TOPK, HIDDEN = 8, 3, 32


def _inputs(src_rank, device, skew=True):
    """Each rank's inputs, reproducible on every rank (so each rank can build the reference)."""
    g = torch.Generator().manual_seed(100 + src_rank)
    t = 13 + 7 * src_rank  # different token counts per rank
    if skew:  # skewed routing: low expert ids (rank 0) are much more popular
        w = torch.linspace(4.0, 0.5, NUM_EXPERTS)
        indices = torch.stack([torch.multinomial(w, TOPK, generator=g) for _ in range(t)])
    else:
        indices = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(t)])
    indices[0, 1:] = -1  # a token with a single route
    x = torch.randn(t, HIDDEN, generator=g)
    probs = torch.rand(t, TOPK, generator=g)
    return x.to(device), indices.to(device), probs.to(device)


def _expected_recv(rank, world, device):
    epr = NUM_EXPERTS // world
    xs, idxs, ps = [], [], []
    for s in range(world):
        x, ind, p = _inputs(s, "cpu")
        owner = torch.where(ind >= 0, ind // epr, -1)
        tok = (owner == rank).any(1)
        local = torch.where(owner == rank, ind - rank * epr, -1)[tok]
        xs.append(x[tok])
        idxs.append(local)
        ps.append(torch.where(owner == rank, p, 0.0)[tok])
    return torch.cat(xs), torch.cat(idxs), torch.cat(ps)


def _body_roundtrip(rank, world, device, backend_name):
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch

    GlobalBackendManager.set_moe_dispatch_combine_backend(backend_name)
    x, indices, probs = _inputs(rank, device)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    recv_x, recv_idx, recv_probs, tpe, handle = moe_dispatch(x, indices, probs, NUM_EXPERTS)
    ex, ei, ep = _expected_recv(rank, world, device)
    n = ex.shape[0]
    assert recv_x.shape[0] >= n
    assert torch.equal(recv_x[:n].detach().cpu(), ex), "dispatch must deliver exact rows"
    assert torch.equal(recv_idx[:n].cpu().long(), ei.long())
    assert torch.equal(recv_probs[:n].detach().cpu(), ep)
    assert (recv_idx[n:] == -1).all()
    epr = NUM_EXPERTS // world
    ref_tpe = torch.stack([(ei == e).sum() for e in range(epr)])
    assert torch.equal(tpe.cpu().long(), ref_tpe)

    # identity experts: combine(dispatch(x)) == x * number of destination ranks, exactly
    out = moe_combine(recv_x, None, handle)
    owners = torch.where(indices >= 0, indices // epr, -1)
    n_dest = torch.stack([(owners == w).any(1) for w in range(world)], 1).sum(1)
    assert torch.equal(out.detach(), x.detach() * n_dest.unsqueeze(1).to(x.dtype))

    # backward: rank-dependent expert scaling, grads checked analytically
    out = moe_combine(recv_x * (rank + 1), None, handle)
    g = torch.randn_like(out)
    loss = (out * g).sum() + (recv_probs * (rank + 1)).sum()
    loss.backward()
    dest_weight = sum(((owners == w).any(1).float() * (w + 1)) for w in range(world))
    assert_close(x.grad, g * dest_weight.unsqueeze(1), torch.float32)
    ref_pg = torch.where(indices >= 0, (owners + 1).float(), 0.0)
    assert_close(probs.grad, ref_pg, torch.float32)


def _body_fp8_dispatch(rank, world, device):
    """(x_fp8, x_scale) travel together; rows arrive bit-exact."""
    from primus_turbo.pytorch.ops.moe.dispatch import moe_dispatch

    x, indices, probs = _inputs(rank, device)
    scale = x.abs().amax(-1, keepdim=True) / 448.0
    x_fp8 = (x / scale).to(torch.float8_e4m3fn)
    (recv_x, recv_scale), recv_idx, _, _, _ = moe_dispatch((x_fp8, scale), indices, probs, NUM_EXPERTS)
    ex, ei, _ = _expected_recv(rank, world, device)
    n = ex.shape[0]
    assert recv_x.dtype == torch.float8_e4m3fn and recv_scale.shape == (recv_x.shape[0], 1)
    deq = recv_x[:n].float() * recv_scale[:n]
    # the reference quantizes on the same device as the senders: CUDA divides by a Python scalar as a
    # multiply by its reciprocal, so a CPU reference differs by an ulp in some scales (2x H200, session 15)
    ex = ex.to(device)
    ref_scale = ex.abs().amax(-1, keepdim=True) / 448.0
    ref = (ex / ref_scale).to(torch.float8_e4m3fn).float() * ref_scale
    assert torch.equal(deq, ref)


def _body_token_dispatcher(rank, world, device):
    from primus_turbo.pytorch.modules.token_dispatcher import TokenDispatcher

    x, indices, probs = _inputs(rank, device, skew=False)
    disp = TokenDispatcher(NUM_EXPERTS, TOPK, dist.group.WORLD, pad_multiple=4)
    expert_in, tpe, expert_probs = disp.token_dispatch(x, probs, indices)
    assert int(tpe.sum()) <= expert_in.shape[0] and int(tpe.sum()) % 4 == 0
    # expert e (local) scales by (global id + 1)
    epr = NUM_EXPERTS // world
    scale = torch.repeat_interleave(torch.arange(epr, dtype=torch.float32) + rank * epr + 1, tpe.cpu().long())
    pad = expert_in.shape[0] - scale.shape[0]
    scale = torch.cat([scale, torch.zeros(pad)]).to(device)
    out = disp.token_combine(expert_in * scale.unsqueeze(1))
    w = torch.where(indices >= 0, probs * (indices + 1).float(), 0.0).sum(1, keepdim=True)
    assert_close(out, x * w, torch.float32)
    # NCCL knows the received routes on the host: the expert buffer is exactly their size. TURBO (no host
    # sync) sizes it by an upper bound: rows after the last group must be zeros (and their probs 0),
    # since FP8 quantization of the whole buffer (tensorwise amax, column scales) reads them.
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    for backend in ("NCCL", "TURBO") if device.type == "cuda" else ("NCCL",):
        GlobalBackendManager.set_moe_dispatch_combine_backend(backend)
        try:
            disp = TokenDispatcher(NUM_EXPERTS, TOPK, dist.group.WORLD, probs_in_experts=True)
            for fill in (float("nan"), 3.0e38):  # pre-dirty freed memory the buffer may reuse
                torch.full((4096, x.shape[1]), fill, device=device)
            expert_in, tpe, expert_probs = disp.token_dispatch(x, probs, indices)
            routed = int(tpe.sum())
            if backend == "NCCL":
                assert routed == expert_in.shape[0], (routed, expert_in.shape)
            else:
                assert routed < expert_in.shape[0], "the case needs tail rows"
                assert torch.count_nonzero(expert_in[routed:]) == 0
                assert torch.count_nonzero(expert_probs[routed:]) == 0
            out = disp.token_combine(expert_in)
            assert_close(out, x * torch.where(indices >= 0, 1.0, 0.0).sum(1, keepdim=True), torch.float32)
        finally:
            GlobalBackendManager.set_moe_dispatch_combine_backend(None)


def _body_bad_sizes(rank, world, device):
    from primus_turbo.pytorch.ops.moe.dispatch import moe_dispatch

    hidden = 16 if rank == 0 else 24
    x = torch.randn(4, hidden, device=device)
    idx = torch.zeros(4, 2, dtype=torch.long, device=device)
    idx[:, 1] = 5
    with pytest.raises(ValueError, match="ranks"):
        moe_dispatch(x, idx, None, NUM_EXPERTS)


def _body_bad_input(rank, world, device):
    from primus_turbo.pytorch.ops.moe.dispatch import moe_dispatch

    x = torch.randn(4, 8, device=device)
    idx = torch.zeros(4, 2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="indices must be in"):
        moe_dispatch(x, idx + NUM_EXPERTS, None, NUM_EXPERTS)
    with pytest.raises(ValueError, match="probs shape"):
        moe_dispatch(x, idx, torch.rand(4, 3, device=device), NUM_EXPERTS)
    with pytest.raises(ValueError, match="multiple of the EP size"):
        moe_dispatch(x, idx, None, 7)
    with pytest.raises(ValueError, match="topk"):
        moe_dispatch(x, torch.zeros(4, 9, dtype=torch.long, device=device), None, NUM_EXPERTS)


def _body_deep_ep_megatron(rank, world, device):
    """Megatron-Core's fused_a2a (flex dispatcher path) running on our deep_ep.Buffer."""
    from primus_turbo.pytorch.deep_ep import install_as_deep_ep

    install_as_deep_ep(force=True)
    fused_a2a = pytest.importorskip("megatron.core.transformer.moe.fused_a2a")
    if not fused_a2a.HAVE_DEEP_EP:  # imported before the shim: reload with it
        import importlib

        fused_a2a = importlib.reload(fused_a2a)
    x, indices, probs = _inputs(rank, device)
    x.requires_grad_(True)
    probs.requires_grad_(True)
    group = dist.group.WORLD
    recv_x, recv_idx, recv_probs, tpe, handle = fused_a2a.fused_dispatch(
        x, indices, probs, NUM_EXPERTS, group
    )
    ex, ei, ep = _expected_recv(rank, world, device)
    n = ex.shape[0]  # TURBO's receive tensors are worst-case sized: rows past n carry index -1
    assert torch.equal(recv_x[:n].detach().cpu(), ex) and torch.equal(recv_idx[:n].cpu().long(), ei.long())
    assert (recv_idx[n:] == -1).all()
    assert torch.equal(tpe.cpu(), torch.stack([(ei == e).sum() for e in range(NUM_EXPERTS // world)]))
    out, _ = fused_a2a.fused_combine(recv_x * (rank + 1), group, handle)
    g = torch.randn_like(out)
    # DeepEP's combine sums topk_weights as given; downstream grads of non-local slots are zero in
    # Megatron (their probs are never used), so mask them here the same way.
    ((out * g).sum() + (recv_probs * (recv_idx >= 0) * (rank + 1)).sum()).backward()
    epr = NUM_EXPERTS // world
    owners = torch.where(indices >= 0, indices // epr, -1)
    dest_weight = sum(((owners == w).any(1).float() * (w + 1)) for w in range(world))
    assert_close(out, x.detach() * dest_weight.unsqueeze(1), torch.float32)
    assert_close(x.grad, g * dest_weight.unsqueeze(1), torch.float32)
    assert_close(probs.grad, torch.where(indices >= 0, (owners + 1).float(), 0.0), torch.float32)


def _body_deep_ep_cached_fp8(rank, world, device):
    """deep_ep.Buffer: a cached dispatch (handle=) of an FP8 (x, x_scale) pair raises (the cached layouts move
    one row tensor), instead of returning the rows without their scales."""
    from primus_turbo.pytorch.deep_ep import Buffer

    x, indices, probs = _inputs(rank, device)
    buf = Buffer(dist.group.WORLD, 0, 0)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(indices, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    *_, handle, _ = buf.dispatch(x, topk_idx=indices, topk_weights=probs, **layout)
    assert torch.equal(buf.dispatch(x, handle=handle)[0].cpu(), _expected_recv(rank, world, device)[0])
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 448
    xq = (x / scale).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"a cached dispatch \(handle=...\) takes a bf16/fp16/fp32 x"):
        buf.dispatch((xq, scale), handle=handle)


def _body_one_rank_receives_nothing(rank, world, device, backend_name):
    """Every route goes to rank 0's experts (collapsed early routing): rank 1 receives zero rows."""
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch

    GlobalBackendManager.set_moe_dispatch_combine_backend(backend_name)
    epr = NUM_EXPERTS // world
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(9 + rank, HIDDEN, generator=g).to(device).requires_grad_(True)
    indices = torch.stack([torch.randperm(epr, generator=g)[:TOPK] for _ in range(x.shape[0])]).to(device)
    probs = torch.rand(x.shape[0], TOPK, generator=g).to(device).requires_grad_(True)
    recv_x, recv_idx, recv_probs, tpe, handle = moe_dispatch(x, indices, probs, NUM_EXPERTS)
    if rank != 0:
        assert int(tpe.sum()) == 0 and (recv_idx == -1).all()
    out = moe_combine(recv_x * (rank + 1), None, handle)  # only rank 0 (weight 1) holds experts
    assert torch.equal(out.detach(), x.detach())
    (out.sum() + recv_probs.sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(probs.grad, torch.ones_like(probs))
    GlobalBackendManager.reset()


def _body_all(rank, world, device, backend_name):
    _body_one_rank_receives_nothing(rank, world, device, backend_name)
    _body_roundtrip(rank, world, device, backend_name)
    _body_token_dispatcher(rank, world, device)
    _body_fp8_dispatch(rank, world, device)
    _body_bad_sizes(rank, world, device)
    _body_bad_input(rank, world, device)
    _body_deep_ep_megatron(rank, world, device)
    _body_deep_ep_cached_fp8(rank, world, device)


def test_dispatch_combine_gloo():
    """Round trip exact, TokenDispatcher, bad input, rank mismatch: one spawn (spawning is ~30 s on CI)."""
    run_distributed(_body_all, world_size=2, backend="gloo", args=("NCCL",))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend_name", ["NCCL", "TURBO"])
def test_dispatch_combine_roundtrip_2gpu(backend_name):
    run_distributed(_body_roundtrip, world_size=2, backend="nccl", args=(backend_name,))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend_name", ["NCCL", "TURBO"])
def test_one_rank_receives_nothing_2gpu(backend_name):
    run_distributed(_body_one_rank_receives_nothing, world_size=2, backend="nccl", args=(backend_name,))


def _body_fp8_and_deep_ep(rank, world, device, backend_name):
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    GlobalBackendManager.set_moe_dispatch_combine_backend(backend_name)
    _body_fp8_dispatch(rank, world, device)  # TURBO: the scales ride in the workspace's scale region
    _body_deep_ep_megatron(rank, world, device)  # TURBO: is_token_in_rank from Buffer.get_dispatch_layout
    GlobalBackendManager.reset()


@pytest.mark.multigpu
@pytest.mark.parametrize("backend_name", ["NCCL", "TURBO"])
def test_fp8_dispatch_and_deep_ep_buffer_2gpu(backend_name):
    run_distributed(_body_fp8_and_deep_ep, world_size=2, backend="nccl", args=(backend_name,))


@pytest.mark.multigpu
def test_token_dispatcher_2gpu():
    run_distributed(_body_token_dispatcher, world_size=2, backend="nccl")


def _body_graph_capture(rank, world, device):
    """TURBO dispatch + combine has no host sync: it captures into a CUDA graph and replays exactly."""
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch

    GlobalBackendManager.set_moe_dispatch_combine_backend("TURBO")
    x, indices, probs = _inputs(rank, device)
    x = x.to(torch.bfloat16)

    def step():
        recv_x, recv_idx, recv_probs, tpe, handle = moe_dispatch(x, indices, probs, NUM_EXPERTS)
        return moe_combine(recv_x * 2, None, handle), tpe

    eager_out, eager_tpe = step()  # warm-up: allocates the workspace (collective) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, tpe = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_out) and torch.equal(tpe, eager_tpe)


def _body_bad_indices_debug_checks(rank, world, device, backend_name):
    """CUDA routing indices are range-checked only with PRIMUS_TURBO_DEBUG_CHECKS=1 (the check syncs)."""
    import os

    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    GlobalBackendManager.set_moe_dispatch_combine_backend(backend_name)
    os.environ["PRIMUS_TURBO_DEBUG_CHECKS"] = "1"
    try:
        _body_bad_input(rank, world, device)
    finally:
        os.environ.pop("PRIMUS_TURBO_DEBUG_CHECKS")
        GlobalBackendManager.reset()


@pytest.mark.multigpu
@pytest.mark.parametrize("backend_name", ["NCCL", "TURBO"])
def test_bad_indices_with_debug_checks_2gpu(backend_name):
    run_distributed(_body_bad_indices_debug_checks, world_size=2, backend="nccl", args=(backend_name,))


@pytest.mark.multigpu
def test_turbo_dispatch_graph_capture_2gpu():
    run_distributed(_body_graph_capture, world_size=2, backend="nccl")


def _body_turbo_size_mismatch_debug_checks(rank, world, device):
    """TURBO: after a wide dispatch sized the workspace, rank 0 dispatches a narrower hidden size (it fits the
    workspace, so no rank grows it). PRIMUS_TURBO_DEBUG_CHECKS=1 compares the sizes on every call: both ranks
    raise instead of reading each other's rows at a different layout (or hanging)."""
    import os

    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.ops.moe.dispatch import moe_dispatch

    GlobalBackendManager.set_moe_dispatch_combine_backend("TURBO")
    os.environ["PRIMUS_TURBO_DEBUG_CHECKS"] = "1"
    try:
        x, ind, p = _inputs(rank, device)
        moe_dispatch(x, ind, p, NUM_EXPERTS)  # same size on both ranks: creates the workspace
        narrow = x[:, : HIDDEN // 2].contiguous() if rank == 0 else x
        with pytest.raises(ValueError, match="ranks need different workspace sizes"):
            moe_dispatch(narrow, ind, p, NUM_EXPERTS)
        torch.cuda.synchronize()
    finally:
        os.environ.pop("PRIMUS_TURBO_DEBUG_CHECKS")
        GlobalBackendManager.reset()


@pytest.mark.multigpu
def test_turbo_size_mismatch_with_debug_checks_2gpu():
    run_distributed(_body_turbo_size_mismatch_debug_checks, world_size=2, backend="nccl")
