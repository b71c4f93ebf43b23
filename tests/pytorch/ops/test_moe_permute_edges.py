"""token_permute / token_unpermute / TokenDispatcher at the edges an audit found: repeated experts in an
indices row, num_out_tokens below the routed count, no permuted row at all, a non-contiguous row_id_map, the
capacity contract of tokens_per_expert, and -1 routes without EP."""

import pytest
import torch
from ref.moe_ref import indices_to_map
from test_utils import assert_close

from primus_turbo.pytorch.ops.moe.permute import token_permute, token_unpermute


def test_repeated_expert_in_an_indices_row_is_rejected(device, monkeypatch):
    x = torch.randn(3, 8, device=device)
    indices = torch.tensor([[0, 1], [1, 0], [1, 1]], device=device)  # token 2 names expert 1 twice
    run = device == "cpu"
    if not run:  # on CUDA the check syncs: only with PRIMUS_TURBO_DEBUG_CHECKS=1
        monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    with pytest.raises(ValueError, match=r"token 2 names an expert twice in its indices row \[1, 1\]"):
        token_permute(x, indices, num_experts=2)
    token_permute(x, torch.tensor([[0, 1], [1, 0], [1, -1]], device=device), num_experts=2)
    token_permute(x, torch.tensor([[0, -1], [-1, -1], [1, 0]], device=device), num_experts=2)  # -1 repeats


@pytest.mark.parametrize("form", ["indices", "map"])
def test_num_out_tokens_below_the_routes_is_rejected(form, device, monkeypatch):
    if device != "cpu":
        monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    indices = torch.tensor([[0, 1], [1, -1], [0, 1]], device=device)  # 5 routes
    routing = indices if form == "indices" else indices_to_map(indices, 2, torch.rand(3, 2, device=device))[0]
    x = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match=r"num_out_tokens=4 is below the 5 routed"):
        token_permute(x, routing, num_out_tokens=4, num_experts=2)
    out, _, _, tpe = token_permute(x, routing, num_out_tokens=6, num_experts=2, zero_fill=True)
    assert out.shape[0] == 6 and tpe.tolist() == [2, 3] and torch.equal(out[5], torch.zeros_like(out[5]))


@pytest.mark.parametrize("form", ["indices", "map", "capacity"])
def test_backward_with_no_permuted_row(form, device):
    """Every route dropped (all -1, an empty map, or capacity 0): the probs' gradient is zeros, not an
    IndexError from gathering the empty permuted probs."""
    x = torch.randn(4, 8, device=device, requires_grad=True)
    if form == "indices":
        routing, probs = torch.full((4, 2), -1, device=device), torch.rand(4, 2, device=device)
        kw = {"num_out_tokens": 0}
    else:
        routing, probs = torch.zeros(4, 3, dtype=torch.bool, device=device), torch.rand(4, 3, device=device)
        kw = {"capacity": 0} if form == "capacity" else {"num_out_tokens": 0}
    if form == "capacity":
        routing[:, 0] = True
    probs.requires_grad_(True)
    out, out_probs, row_id_map, _ = token_permute(x, routing, probs, num_experts=3, **kw)
    assert out.shape[0] == 0
    (out.sum() + out_probs.sum()).backward()
    assert torch.equal(probs.grad, torch.zeros_like(probs)) and torch.equal(x.grad, torch.zeros_like(x))


def test_unpermute_takes_a_non_contiguous_row_id_map(device):
    torch.manual_seed(0)
    t, e, k = 9, 4, 2
    indices = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
    x = torch.randn(t, 16, device=device)
    out, _, row_id_map, _ = token_permute(x, indices, num_experts=e)
    flipped = row_id_map.flip(1).t().contiguous().t()  # same values per route pair, column-major storage
    assert not flipped.is_contiguous()
    probs = torch.rand(t, k, device=device)
    got = token_unpermute(out, flipped, probs.flip(1))
    assert_close(got, x * probs.sum(1, keepdim=True), torch.float32)  # every route of token t holds x[t]


def test_capacity_groups_are_capacity_rows_and_tokens_per_expert_counts_kept_tokens(device):
    routing = torch.tensor([[1, 0], [1, 1], [0, 1], [0, 1], [0, 0]], dtype=torch.bool, device=device)
    x = torch.arange(1.0, 6.0, device=device)[:, None]
    out, _, row_id_map, tpe = token_permute(x, routing, capacity=3)
    assert tpe.tolist() == [2, 3]  # expert 0 has 2 tokens, expert 1 three
    assert out.flatten().tolist() == [1.0, 2.0, 0.0, 2.0, 3.0, 4.0]  # groups of capacity rows, zero padded


def test_token_dispatcher_without_ep_zeroes_rows_past_the_groups(device):
    """EP size 1 with -1 routes: the permuted buffer is sized T x topk (an upper bound), so the rows past the
    last group must be zeros (FP8 experts quantize the whole buffer), not whatever the allocation held."""
    from primus_turbo.pytorch.modules.token_dispatcher import TokenDispatcher

    disp = TokenDispatcher(4, 2, None)
    x = torch.randn(4, 8, device=device)
    del x  # leave NaN in freed memory of the permuted buffer's size, so unwritten rows show
    torch.full((8, 8), float("nan"), device=device)
    x = torch.randn(4, 8, device=device)
    indices = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 0]], device=device)
    probs = torch.rand(4, 2, device=device)
    expert_in, tpe, expert_probs = disp.token_dispatch(x, probs, indices)
    n = int(tpe.sum())
    assert expert_in.shape[0] == 8 and n == 5
    assert torch.equal(expert_in[n:], torch.zeros_like(expert_in[n:]))
    assert torch.equal(expert_probs[n:], torch.zeros_like(expert_probs[n:]))
