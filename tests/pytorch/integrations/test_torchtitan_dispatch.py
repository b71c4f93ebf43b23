"""turbo.dispatch on TorchTitan, 2 EP ranks over gloo: a TorchTitan ``MoE`` layer whose experts are sharded by
TorchTitan's own ``ExpertParallel`` (as its parallelize functions do), three ways from the same weights and
inputs:

  stock      MoE + ExpertParallel (all_to_all_single_autograd + permute, the reference)
  turbo off  converter with turbo.dispatch=false: TurboMoE + TurboGroupedExperts, ExpertParallel's all-to-all
  turbo on   converter with turbo.dispatch=true: TurboEPMoE over TokenDispatcher (dispatch/permute/combine)

Forward outputs and every gradient (router gate, expert shards, shared experts) agree: turbo on vs off at
1e-5 (only the fp32 summation order of the expert outputs differs), vs stock at the project fp32 tolerance.
The turbo run must go through the dispatch op (NCCL backend on gloo; one call per forward) and TorchTitan's
all-to-all hooks must be absent from its experts, so a silently unused dispatcher fails the test.
"""

import os

import pytest
import torch
from dist_utils import run_distributed
from test_utils import assert_close

pytest.importorskip("torchtitan")

DIM, HIDDEN, NUM_EXPERTS, TOPK, TOKENS = 32, 16, 4, 2, (2, 12)


def _moe(score_before_experts: bool, use_grouped_mm: bool):
    from torchtitan.models.moe.moe import MoE, MoEArgs

    args = MoEArgs(num_experts=NUM_EXPERTS, num_shared_experts=1, score_func="softmax", route_norm=False,
                   score_before_experts=score_before_experts, top_k=TOPK, load_balance_coeff=1e-3,
                   use_grouped_mm=use_grouped_mm)  # fmt: skip
    torch.manual_seed(0)  # the same weights in every build and on every rank
    moe = MoE(args, dim=DIM, hidden_dim=HIDDEN)
    with torch.no_grad():
        moe.init_weights(init_std=0.02, buffer_device=torch.device("cpu"))
    return moe


def _build(kind: str, score_before_experts: bool, expert_bias, mesh):
    from primus_turbo.integrations.torchtitan import converter as conv
    from torch.distributed.tensor.parallel import parallelize_module
    from torchtitan.distributed.expert_parallel import ExpertParallel

    # stock: the fp32 per-expert loop (TorchTitan's grouped_mm path computes in bf16); turbo swaps the experts
    moe = _moe(score_before_experts, use_grouped_mm=kind != "stock")
    moe.expert_bias.copy_(expert_bias)
    if kind != "stock":
        options = conv.TurboOptions(dispatch=kind == "turbo_on", permute=True, ep=2)
        rows = {r.name: r.status for r in conv.convert_model(torch.nn.ModuleList([moe]), options)}
        assert rows["turbo.dispatch"] == ("active" if kind == "turbo_on" else "off"), rows
    parallelize_module(moe.experts, mesh, ExpertParallel())
    return moe


def _run(moe, x, grad_out):
    """{"out": ..., "dx": ..., "d<param>": local gradient (the rank's expert shard for DTensors)}."""
    x = x.clone().requires_grad_(True)
    out = moe(x)
    out.backward(grad_out)
    grads = {f"d{n}": getattr(p.grad, "_local_tensor", p.grad) for n, p in moe.named_parameters()}
    return {"out": out.detach(), "dx": x.grad, **grads}


def _assert_same(got: dict, ref: dict, tol: float | None, label: str) -> None:
    """Every tensor of ``got`` vs ``ref``: within ``tol`` (rtol = atol), or the project fp32 tolerance."""
    assert got.keys() == ref.keys(), (got.keys(), ref.keys())
    for key, value in ref.items():
        if tol is None:
            assert_close(got[key], value, msg=f"{key} {label}")
        else:
            where = f"{key} {label}"
            torch.testing.assert_close(got[key], value, rtol=tol, atol=tol, msg=lambda m, w=where: f"{w}:{m}")


def _body(rank, world, device):
    from primus_turbo.integrations.torchtitan import turbo_modules as tm
    from primus_turbo.integrations.torchtitan.cpu_shims import apply_cpu_shims
    from torch.distributed.device_mesh import init_device_mesh

    from primus_turbo.pytorch.core.backend import BackendType
    from primus_turbo.pytorch.kernels.moe.dispatch_impl import MoEDispatchCombineDispatcher as Dispatcher

    apply_cpu_shims()  # integer histc and TorchTitan's CPU permute indices for the stock path
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    import primus_turbo.pytorch.modules.token_dispatcher as td  # TurboEPMoE dispatches through it

    calls = []
    stock_dispatch = td.moe_dispatch
    td.moe_dispatch = lambda *a, **k: calls.append(1) or stock_dispatch(*a, **k)
    # balanced: the router's own choice; skewed: the expert bias sends every token to rank 0's experts, so
    # rank 1 receives no rows at all (empty expert groups, zero-row grouped GEMMs, empty combine)
    cases = [(False, torch.zeros(NUM_EXPERTS)), (True, torch.zeros(NUM_EXPERTS)),
             (False, torch.tensor([5.0, 5.0, -5.0, -5.0]))]  # fmt: skip
    for score_before, bias in cases:
        g = torch.Generator().manual_seed(10 + rank)  # different tokens on each rank
        x = torch.randn(*TOKENS, DIM, generator=g)
        grad_out = torch.randn(*TOKENS, DIM, generator=g)
        results, hooks = {}, {}
        for kind in ("stock", "turbo_off", "turbo_on"):
            moe = _build(kind, score_before, bias, mesh)
            Dispatcher.clear_cache()
            calls.clear()
            # turbo on: value checks make the grouped GEMMs verify that group_lens never claim more rows than
            # the buffer has (rows past the groups, e.g. TURBO's upper-bound tail, are allowed: zero outputs)
            os.environ["PRIMUS_TURBO_DEBUG_CHECKS"] = "1" if kind == "turbo_on" else "0"
            results[kind] = _run(moe, x, grad_out)
            hooks[kind] = len(moe.experts._forward_pre_hooks) + len(moe.experts._forward_hooks)
            used = Dispatcher.last_backend
            if kind == "turbo_on":
                assert type(moe) is tm.TurboEPMoE and moe.experts.ep_group is not None
                assert used is BackendType.NCCL and len(calls) == 1, (used, calls)
            else:
                assert used is None and not calls, (kind, used, calls)
        assert hooks == {"stock": 2, "turbo_off": 2, "turbo_on": 0}, hooks  # ExpertParallel's a2a hooks
        case = f"score_before={score_before} bias={bias.tolist()} rank {rank}"
        _assert_same(results["turbo_on"], results["turbo_off"], 1e-5, f"turbo on vs off, {case}")
        _assert_same(results["turbo_on"], results["stock"], None, f"turbo on vs stock, {case}")
        if bias[0] > 0 and rank == 1:  # nothing reached rank 1's experts: their gradients are exactly zero
            assert not results["turbo_on"]["dexperts.w1"].any()


def test_turbo_dispatch_matches_torchtitan_expert_parallel_on_two_ranks():
    run_distributed(_body, world_size=2, backend="gloo", timeout_s=240)
