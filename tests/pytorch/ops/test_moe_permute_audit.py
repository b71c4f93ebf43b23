"""token_permute / token_unpermute bad inputs an audit found accepted: probs of a non-float dtype or on
another device, float sizes, and a row_id_map naming rows past the permuted buffer (read out of bounds)."""

import pytest
import torch

from primus_turbo.pytorch.ops.moe.permute import token_permute, token_unpermute


def _inputs(device):
    x = torch.randn(4, 8, device=device)
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], device=device)
    return x, indices, torch.rand(4, 2, device=device)


def test_permute_probs_must_be_float_on_the_tokens_device(device):
    x, indices, probs = _inputs(device)
    with pytest.raises(TypeError, match=r"token_permute: probs dtype torch.int64"):
        token_permute(x, indices, probs.long(), num_experts=4)
    with pytest.raises(TypeError, match=r"token_permute: probs dtype torch.bool"):
        token_permute(x, indices, probs > 0.5, num_experts=4)
    with pytest.raises(ValueError, match=r"token_permute: probs on meta, tokens on"):
        token_permute(x, indices, probs.to("meta"), num_experts=4)


@pytest.mark.parametrize("arg, value", [("pad_multiple", 16.0), ("capacity", 2.5), ("num_out_tokens", 8.0)])
def test_permute_sizes_must_be_ints(arg, value, device):
    x, indices, _ = _inputs(device)
    with pytest.raises(TypeError, match=rf"token_permute: {arg}={value} must be an int"):
        token_permute(x, indices, num_experts=4, **{arg: value})


def test_unpermute_checks_its_buffer_probs_and_devices(device, monkeypatch):
    if device != "cpu":  # the row bound reads the map on the host: a sync on CUDA, so only with debug checks
        monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    x, indices, probs = _inputs(device)
    out, _, row_id_map, _ = token_permute(x, indices, num_experts=4)
    with pytest.raises(ValueError, match=r"row_id_map names rows \[0, 7\] but permuted_tokens has 3 rows"):
        token_unpermute(out[:3], row_id_map)
    with pytest.raises(TypeError, match=r"token_unpermute: merging_probs dtype torch.int64"):
        token_unpermute(out, row_id_map, probs.long())
    with pytest.raises(ValueError, match=r"token_unpermute: merging_probs on meta, permuted_tokens on"):
        token_unpermute(out, row_id_map, probs.to("meta"))
    with pytest.raises(ValueError, match=r"token_unpermute: row_id_map on .*, permuted_tokens on meta"):
        token_unpermute(out.to("meta"), row_id_map)
    # a larger buffer (an upper-bound permute) stays fine: rows past the map are not read
    bigger = torch.cat([out, torch.randn(5, 8, device=device)])
    torch.testing.assert_close(
        token_unpermute(bigger, row_id_map, probs), token_unpermute(out, row_id_map, probs)
    )


def test_eager_unpermute_masks_dropped_routes_by_selection():
    """The eager (torch) unpermute gathered row 0 for dropped (-1) routes and multiplied it by 0: an inf
    there made the token NaN; with no row at all (every route dropped) it raised an IndexError."""
    from primus_turbo.pytorch.kernels.moe.permute_impl import _unpermute_eager

    y = torch.randn(3, 4)
    y[0] = float("inf")
    row_id_map = torch.tensor([[1, -1], [2, 0]], dtype=torch.int32)
    out = _unpermute_eager(y, row_id_map, None, 2)
    torch.testing.assert_close(out[0], y[1])
    empty = _unpermute_eager(torch.empty(0, 4), torch.full((2, 2), -1, dtype=torch.int32), None, 2)
    assert torch.equal(empty, torch.zeros(2, 4))
