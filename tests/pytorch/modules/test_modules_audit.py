"""Module-layer audit: meta-device init of DELAYED scaling state, nn.* parity and bad-argument errors.

References are fp64 autograd (nn.Linear, TorchTitan GroupedExperts); shapes are tiny (CPU interpreter).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingStrategy
from primus_turbo.pytorch.modules import ColumnParallelLinear, Float8Linear, GroupedLinear, Linear

DELAYED = Float8QuantConfig(strategy=ScalingStrategy.DELAYED)


def _histories(layer):
    state = layer.delayed_state if isinstance(layer, Float8Linear) else layer.fp8_delayed_state
    return (state.a, state.b, state.grad)


def _fp8_rel_err(layer, x):
    y = layer(x)
    y.backward(torch.randn_like(y))  # the output-gradient history too
    ref = x.double() @ layer.weight.detach().double().T + layer.bias.detach().double()
    return ((y.detach().double() - ref).norm() / ref.norm()).item()


def _materialize_with_garbage(layer):
    """``to_empty`` leaves uninitialized memory in the amax histories: made deterministic here."""
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    for h in _histories(layer):
        h.history.fill_(1e6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Float8Linear(64, 32, config=DELAYED, device="meta"),
        lambda: Float8Linear.from_float(nn.Linear(64, 32, device="meta"), DELAYED),
    ],
    ids=["ctor", "from_float"],
)
def test_delayed_history_built_on_meta_starts_clean_after_to_empty(make):
    # The meta-init flow (build on meta, to_empty, init): the first push used to keep the uninitialized
    # rest of the window; its huge "amax" set the scale for 16 steps and the output collapsed to ~0.
    torch.manual_seed(0)
    layer = make()
    _materialize_with_garbage(layer)
    errs = [_fp8_rel_err(layer, torch.randn(16, 64)) for _ in range(3)]
    assert max(errs) < 0.1, errs
    for h in _histories(layer):
        assert torch.count_nonzero(h.history[3:]) == 0, h.history


@pytest.mark.parametrize(
    "make",
    [lambda: Float8Linear(64, 32, config=DELAYED), lambda: Linear(64, 32, fp8_config=DELAYED)],
    ids=["Float8Linear", "Linear"],
)
def test_delayed_history_moved_to_meta_restarts(make):
    torch.manual_seed(0)
    layer = make()
    layer(torch.randn(16, 64))  # a used history: initialized
    layer.to("meta")
    _materialize_with_garbage(layer)
    errs = [_fp8_rel_err(layer, torch.randn(16, 64)) for _ in range(2)]
    assert max(errs) < 0.1, errs


def test_delayed_history_survives_moves_between_real_devices():
    layer = Float8Linear(64, 32, config=DELAYED)
    layer(torch.randn(16, 64)).sum().backward()
    before = [h.history.clone() for h in _histories(layer)]
    layer.to("cpu").float()
    for h, want in zip(_histories(layer), before):
        assert h.initialized and torch.equal(h.history, want)


@pytest.mark.parametrize("in_features,out_features", [(1, 1), (1, 7), (5, 1), (3, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_nn_linear_fp64(in_features, out_features, bias):
    torch.manual_seed(1)
    ref = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    torch.manual_seed(1)
    layer = Linear(in_features, out_features, bias=bias, dtype=torch.float64)
    assert list(layer.state_dict()) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(layer.state_dict()[k], v), f"init of {k} differs from nn.Linear's"
    assert layer.extra_repr() == ref.extra_repr()
    x = torch.randn(2, 3, in_features, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = layer(x), ref(x_ref)
    g = torch.randn_like(y_ref)
    y.backward(g), y_ref.backward(g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad)
    nn.Linear(in_features, out_features, bias=bias).load_state_dict(layer.state_dict(), strict=True)


def test_linear_rejects_a_0d_input_naming_in_features():
    with pytest.raises(ValueError, match=r"in_features=1, got shape \(\)"):
        Linear(1, 4)(torch.tensor(1.0))


@pytest.mark.parametrize("arg", [0, 1, 2])
def test_grouped_linear_rejects_bool_sizes(arg):
    sizes = [2, 4, 4]
    sizes[arg] = True
    name = ("num_groups", "in_features", "out_features")[arg]
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got True"):
        GroupedLinear(*sizes)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_zero_size_groups_fwd_bwd(bias):
    G, K, N, lens = 3, 8, 5, [0, 4, 0]
    torch.manual_seed(0)
    layer = GroupedLinear(G, K, N, bias=bias)
    x = torch.randn(sum(lens), K, requires_grad=True)
    y = layer(x, torch.tensor(lens))
    g = torch.randn_like(y)
    y.backward(g)
    w = layer.weight.detach().double().requires_grad_(True)
    b = layer.bias.detach().double().requires_grad_(True) if bias else None
    x64 = x.detach().double().requires_grad_(True)
    ref = x64 @ w[1].T + (b[1] if bias else 0)
    ref.backward(g.double())
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.weight.grad.double(), w.grad, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(layer.weight.grad[0]) == 0 and torch.count_nonzero(layer.weight.grad[2]) == 0
    if bias:
        torch.testing.assert_close(layer.bias.grad.double(), b.grad, atol=1e-5, rtol=1e-5)


def test_grouped_linear_round_trips_torchtitan_grouped_experts():
    GroupedExperts = pytest.importorskip("torchtitan.models.moe.moe").GroupedExperts

    G, dim, hidden = 3, 8, 6
    torch.manual_seed(0)
    experts = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=G, use_grouped_mm=False)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    fc1, fc3 = GroupedLinear(G, dim, hidden), GroupedLinear(G, dim, hidden)
    fc2 = GroupedLinear(G, hidden, dim)
    fc1.from_stacked(experts.w1), fc3.from_stacked(experts.w3), fc2.from_stacked(experts.w2)
    lens, x = torch.tensor([2, 0, 3]), torch.randn(5, dim)
    y = fc2(nn.functional.silu(fc1(x, lens)) * fc3(x, lens), lens)
    torch.testing.assert_close(y, experts(x, lens), atol=1e-5, rtol=1e-5)
    back = GroupedExperts(dim=dim, hidden_dim=hidden, num_experts=G, use_grouped_mm=False)
    back.load_state_dict({"w1": fc1.to_stacked()[0], "w2": fc2.to_stacked()[0], "w3": fc3.to_stacked()[0]})
    assert all(torch.equal(a, b) for a, b in zip(back.parameters(), experts.parameters()))


@pytest.mark.parametrize(
    "cfg",
    [
        Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE),
        Float8QuantConfig(strategy=ScalingStrategy.DELAYED),
    ],
    ids=["blockwise", "delayed"],
)
def test_parallel_linear_rejects_unsupported_fp8_config_when_built(cfg):
    # used to be accepted and fail only at the first forward; checked before any process group is needed
    with pytest.raises(ValueError, match="fp8_config: the parallel linears run TENSORWISE or ROWWISE"):
        ColumnParallelLinear(16, 16, fp8_config=cfg)


def test_linear_under_another_delayed_autocast_config_gets_its_histories():
    """Linear kept the histories of the first DELAYED fp8_autocast config it ran under: a later config's
    amax_history_len / amax_compute_algo were silently ignored."""
    from primus_turbo.pytorch.core.fp8_autocast import fp8_autocast

    layer = Linear(64, 32)
    for n, algo in ((16, "max"), (4, "most_recent"), (4, "most_recent")):
        config = Float8QuantConfig(
            strategy=ScalingStrategy.DELAYED, amax_history_len=n, amax_compute_algo=algo
        )
        with fp8_autocast(config=config):
            layer(torch.randn(16, 64))
        assert layer.fp8_delayed_state.a.history.numel() == n and layer.fp8_delayed_state.a.algo == algo
    assert torch.count_nonzero(layer.fp8_delayed_state.a.history) == 2  # kept across the two same configs
