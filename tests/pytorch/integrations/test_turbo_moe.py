"""The sync-free ep=1 MoE path (integrations/megatron/turbo_moe.py) against Megatron's own modules:
TurboLocalTokenDispatcher vs MoEAlltoAllTokenDispatcher (same expert rows, counts, probs, combine and
gradients), TurboGroupedMLP vs TEGroupedMLP over the same turbo grouped linears (fused SwiGLU x probs vs the
eager chunk/silu/mul), both fp32 on CPU against an fp64 reference."""

import pytest
import torch
from megatron_utils import transformer_config as _config

megatron = pytest.importorskip("megatron.core")

E, K, H, FFN, T = 8, 3, 32, 24, 40


def _moe_config(**extra):
    kwargs = dict(num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FFN, hidden_size=H,
                  gated_linear_unit=True, activation_func=torch.nn.functional.silu, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="alltoall", bias_activation_fusion=False)  # fmt: skip
    kwargs.update(extra)
    return _config(**kwargs)


def _pg():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep", "tp"])


def _routing(seed=0, tokens=T, empty_expert=True):
    """A dropless top-K routing map [T, E] with dense probs; expert 1 gets no token when empty_expert."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, E, generator=g)
    if empty_expert:
        scores[:, 1] = -1.0
    idx = scores.topk(K, dim=-1).indices
    routing_map = torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.softmax(torch.randn(tokens, E, generator=g), -1) * routing_map
    return routing_map, probs


def _dispatch_combine(dispatcher, hidden, routing_map, probs, expert_fn):
    """Megatron MoELayer's call order; returns (out, tokens_per_expert)."""
    x, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    x, p = dispatcher.token_dispatch(x, p)
    x, counts, p = dispatcher.dispatch_postprocess(x, p)
    y = dispatcher.combine_preprocess(expert_fn(x, counts, p))
    return dispatcher.combine_postprocess(dispatcher.token_combine(y)), counts


def test_local_dispatcher_matches_megatron_alltoall_dispatcher(megatron_world):
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from primus_turbo.integrations.megatron.turbo_moe import TurboLocalTokenDispatcher

    config = _moe_config()
    routing_map, probs = _routing()
    w = torch.randn(H, H, dtype=torch.float64)
    seen = {}

    def run(cls):
        dispatcher = cls(E, list(range(E)), config=config, pg_collection=_pg())
        hidden = torch.randn(T // 2, 2, H, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        p = probs.clone().requires_grad_(True)

        def experts(x, counts, rows_probs):  # a per-row op that depends on the expert order and the probs
            seen[cls] = (x.detach().clone(), torch.as_tensor(counts).clone(), rows_probs.detach().clone())
            return (x.double() @ w * rows_probs.double().unsqueeze(-1)).to(x.dtype)

        out, _ = _dispatch_combine(dispatcher, hidden, routing_map, p, experts)
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        return out.detach(), hidden.grad, p.grad

    got, want = run(TurboLocalTokenDispatcher), run(MoEAlltoAllTokenDispatcher)
    (x_t, c_t, p_t), (x_s, c_s, p_s) = seen[TurboLocalTokenDispatcher], seen[MoEAlltoAllTokenDispatcher]
    assert torch.equal(x_t, x_s) and torch.equal(p_t, p_s), "expert rows or their probs differ"
    assert c_t.dtype == torch.int64 and torch.equal(c_t.cpu(), c_s.cpu()) and c_t[1] == 0
    for g, s, name in zip(got, want, ("out", "d hidden", "d probs")):
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-6, msg=name)


def _experts_pair(config):
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from primus_turbo.integrations.megatron.turbo_layers import (
        TurboColumnParallelGroupedLinear,
        TurboRowParallelGroupedLinear,
    )
    from primus_turbo.integrations.megatron.turbo_moe import TurboGroupedMLP

    subs = MLPSubmodules(
        linear_fc1=TurboColumnParallelGroupedLinear, linear_fc2=TurboRowParallelGroupedLinear
    )
    torch.manual_seed(0)
    turbo = TurboGroupedMLP(E, config, subs, pg_collection=_pg())
    stock = TEGroupedMLP(E, config, subs, pg_collection=_pg())
    stock.load_state_dict(turbo.state_dict())
    return turbo, stock


def _run_experts(module, x, counts, probs):
    x, probs = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    out, bias = module(x, counts, probs)
    assert bias is None
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    wgrads = [p.grad.clone() for p in module.parameters()]
    return out.detach(), x.grad, probs.grad, wgrads


def _reference(module, x, counts, probs):
    """fp64 per-expert SwiGLU MLP, rows scaled by their probs after the activation."""
    g = module.num_local_experts
    w1 = [getattr(module.linear_fc1, f"weight{i}").detach().double().requires_grad_(True) for i in range(g)]
    w2 = [getattr(module.linear_fc2, f"weight{i}").detach().double().requires_grad_(True) for i in range(g)]
    xr, pr = x.double().requires_grad_(True), probs.double().requires_grad_(True)
    outs = []
    for i, (xc, pc) in enumerate(zip(xr.split(counts.tolist()), pr.split(counts.tolist()))):
        gate, up = (xc @ w1[i].t()).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up * pc.unsqueeze(-1)) @ w2[i].t())
    out = torch.cat(outs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out))
    return out.detach(), xr.grad, pr.grad, [w.grad for w in (*w1, *w2)]


def test_turbo_grouped_mlp_matches_te_grouped_mlp_and_fp64(megatron_world):
    """Counts as a tensor (the local dispatcher's, kept on the device on GPU) and as Megatron's CPU tensor:
    same result as TEGroupedMLP's eager activation, and as an fp64 per-expert reference."""
    turbo, stock = _experts_pair(_moe_config())
    assert turbo.fused_reason is None
    counts = torch.tensor([7, 0, 5, 9, 1, 6, 8, 4])
    x, probs = torch.randn(int(counts.sum()), H), torch.rand(int(counts.sum()))
    got = _run_experts(turbo, x, counts, probs)
    want = _run_experts(stock, x, counts, probs)
    ref = _reference(turbo, x, counts, probs)
    names = ("out", "dx", "dprobs")
    for g, s, r, name in zip(got[:3], want[:3], ref[:3], names):
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-5, msg=f"{name} vs TEGroupedMLP")
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=f"{name} vs fp64")
    for i, (g, s) in enumerate(zip(got[3], want[3])):
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-5, msg=f"weight grad {i}")
    # weights are registered fc1 weight0..7 then fc2 weight0..7, as the reference lists them
    for i, (g, r) in enumerate(zip(got[3], ref[3])):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=f"weight grad {i} vs fp64")


@pytest.mark.parametrize(
    "extra, reason",
    [({"gated_linear_unit": False}, "activation is not SwiGLU"),
     ({"activation_func_clamp_value": 7.0}, "clamped/offset GLU")],
)  # fmt: skip
def test_turbo_grouped_mlp_keeps_the_stock_forward_where_it_does_not_fuse(megatron_world, extra, reason):
    turbo, stock = _experts_pair(_moe_config(**extra))
    assert turbo.fused_reason == reason
    counts = torch.tensor([3, 4, 0, 2, 5, 1, 1, 4])
    x, probs = torch.randn(int(counts.sum()), H), torch.rand(int(counts.sum()))
    for g, s in zip(_run_experts(turbo, x, counts, probs)[:3], _run_experts(stock, x, counts, probs)[:3]):
        assert torch.equal(g, s)


@pytest.mark.parametrize(
    "extra, needle",
    [({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}, "token dropping"),
     ({"moe_shared_expert_overlap": True, "moe_shared_expert_intermediate_size": 16},
      "shared_expert_overlap")],
)  # fmt: skip
def test_local_dispatcher_rejects_what_it_cannot_serve(megatron_world, extra, needle):
    from primus_turbo.integrations.megatron.turbo_moe import TurboLocalTokenDispatcher

    with pytest.raises(ValueError, match=f"{needle}.*turbo.dispatch=false"):
        TurboLocalTokenDispatcher(E, list(range(E)), config=_moe_config(**extra), pg_collection=_pg())
