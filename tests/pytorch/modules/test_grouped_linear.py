"""GroupedLinear: numerics against the reference and the Megatron / TorchTitan parameter layouts."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import grouped_gemm_grads_ref, grouped_gemm_ref, make_group_lens
from test_utils import assert_close, assert_snr

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import GlobalBackendManager
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.modules import GroupedLinear


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear_matches_reference(backend, bias, device):
    GlobalBackendManager.set_grouped_gemm_backend(backend)
    G, M, IN, OUT = 4, 96, 32, 48
    layer = GroupedLinear(G, IN, OUT, bias=bias, device=device, dtype=torch.float32)
    lens = make_group_lens(M, G, "empty", device)
    x = torch.randn(M, IN, device=device, requires_grad=True)
    grad = torch.randn(M, OUT, device=device)
    y = layer(x, lens)
    y.backward(grad)
    ref = grouped_gemm_ref(x, layer.weight, lens, trans_b=True)
    ref_dx, ref_dw = grouped_gemm_grads_ref(x, layer.weight, lens, grad, trans_b=True)
    if bias:
        expert = torch.repeat_interleave(torch.arange(G, device=device), lens)
        ref = ref + layer.bias.detach().double()[expert]
        ref_db = torch.zeros(G, OUT, dtype=torch.float64, device=device).index_add_(0, expert, grad.double())
        assert_close(layer.bias.grad, ref_db, torch.float32, msg="bias grad")
    assert_close(y, ref, torch.float32, msg="y")
    assert_close(x.grad, ref_dx, torch.float32, msg="dx")
    assert_close(layer.weight.grad, ref_dw, torch.float32, msg="dw")
    assert torch.count_nonzero(layer.weight.grad[lens == 0]) == 0


@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_linear_rows_past_the_groups_stay_zero_with_bias(groups, device):
    """An upper-bound buffer (sum(group_lens) < rows): the rows past the last group belong to no expert, so
    their output is zero (no expert's bias), their input gradient is zero and no bias gradient comes from
    them."""
    GlobalBackendManager.set_grouped_gemm_backend("TORCH" if device.type == "cpu" else "TRITON")
    M, IN, OUT = 40, 16, 24
    layer = GroupedLinear(groups, IN, OUT, bias=True, device=device, dtype=torch.float32)
    lens = torch.tensor([12, 0, 9][:groups], device=device)
    used = int(lens.sum())
    x = torch.randn(M, IN, device=device, requires_grad=True)
    y = layer(x, lens)
    assert torch.count_nonzero(y[used:]) == 0
    expert = torch.repeat_interleave(torch.arange(groups, device=device), lens)
    ref = grouped_gemm_ref(x[:used], layer.weight, lens, trans_b=True) + layer.bias.detach().double()[expert]
    assert_close(y[:used], ref, torch.float32, msg="y")
    grad = torch.randn(M, OUT, device=device)
    y.backward(grad)
    ref_db = torch.zeros(groups, OUT, dtype=torch.float64, device=device)
    ref_db.index_add_(0, expert, grad[:used].double())
    assert_close(layer.bias.grad, ref_db, torch.float32, msg="bias grad")
    assert torch.count_nonzero(x.grad[used:]) == 0


def test_grouped_linear_fp8(device):
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    G, M, IN, OUT = 3, 64, 128, 64
    cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
    layer = GroupedLinear(G, IN, OUT, device=device, dtype=torch.bfloat16, fp8_config=cfg)
    lens = make_group_lens(M, G, "skewed", device)
    x = torch.randn(M, IN, device=device, dtype=torch.bfloat16)
    assert_snr(layer(x, lens), grouped_gemm_ref(x, layer.weight, lens, trans_b=True), 25.0, "fp8 y")


def test_state_dict_megatron_per_expert_layout(device):
    """Keys and shapes of Megatron-Core TEGroupedMLP (TE GroupedLinear): weight{i} [out, in], bias{i}."""
    G, IN, OUT = 3, 8, 5
    layer = GroupedLinear(G, IN, OUT, bias=True, device=device)
    sd = layer.state_dict()
    assert sorted(sd) == sorted([f"weight{g}" for g in range(G)] + [f"bias{g}" for g in range(G)])
    for g in range(G):
        assert sd[f"weight{g}"].shape == (OUT, IN) and torch.equal(sd[f"weight{g}"], layer.weight[g])
    other = GroupedLinear(G, IN, OUT, bias=True, device=device)
    other.load_state_dict(sd)
    assert torch.equal(other.weight, layer.weight) and torch.equal(other.bias, layer.bias)
    # a stacked-layout module loads the per-expert checkpoint too (and vice versa)
    stacked = GroupedLinear(G, IN, OUT, bias=True, device=device, state_dict_layout="stacked")
    stacked.load_state_dict(sd)
    assert torch.equal(stacked.weight, layer.weight)
    assert sorted(stacked.state_dict()) == ["bias", "weight"]
    layer.load_state_dict({k: v + 1 for k, v in stacked.state_dict().items()})
    assert torch.equal(layer.weight, stacked.weight + 1)
    # a TE GroupedLinear checkpoint carries _extra_state (its FP8 metadata): dropped, strict load still works
    other.weight.data.add_(1.0)
    layer.load_state_dict({**other.state_dict(), "_extra_state": None})
    assert torch.equal(layer.weight, other.weight)


def test_torchtitan_stacked_helpers(device):
    """TorchTitan GroupedExperts w1/w3 are [G, hidden, dim], w2 [G, dim, hidden]: [G, out, in]."""
    G, dim, hidden = 4, 16, 24
    w1 = torch.randn(G, hidden, dim, device=device)
    fc1 = GroupedLinear(G, dim, hidden, device=device)
    fc1.from_stacked(w1)
    assert torch.equal(fc1.to_stacked()[0], w1) and torch.equal(fc1.expert_weight(2), w1[2])
    lens = make_group_lens(40, G, "balanced", device)
    x = torch.randn(40, dim, device=device)
    # TorchTitan computes x @ w1.transpose(-2, -1) per expert
    assert_close(fc1(x, lens), grouped_gemm_ref(x, w1, lens, trans_b=True), torch.float32, msg="titan")
    with pytest.raises(ValueError, match="from_stacked"):
        fc1.from_stacked(w1.transpose(1, 2))


def test_grouped_linear_bad_args(device):
    with pytest.raises(ValueError, match="num_groups"):
        GroupedLinear(0, 4, 4)
    with pytest.raises(TypeError, match="fp8_config"):
        GroupedLinear(2, 4, 4, fp8_config="fp8")
    with pytest.raises(ValueError, match="state_dict_layout"):
        GroupedLinear(2, 4, 4, state_dict_layout="fused")
    layer = GroupedLinear(2, 4, 4, device=device)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 4\]"):
        layer(torch.randn(3, 5, device=device), torch.tensor([1, 2], device=device))
    assert "num_groups=2" in repr(layer) and turbo.modules.GroupedLinear is GroupedLinear
