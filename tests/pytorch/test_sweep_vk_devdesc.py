"""The device-descriptor variable-K candidate of benchmark/ops/sweep_grouped_vk_devdesc.py computes the wgrad:
fp64 reference over balanced, skewed and empty groups, a bf16 output and an fp32 accumulate=2 buffer (CPU:
interpreter; GPU: the real kernel), so a GPU sweep of it measures a correct kernel."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ref.grouped_gemm_ref import make_group_lens
from test_utils import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "ops"))
import sweep_grouped_vk_devdesc as sweep  # noqa: E402


def _reference(x, y, lens):
    out, start = [], 0
    for n in lens.tolist():
        out.append(x[start : start + n].double().t() @ y[start : start + n].double())
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_candidate_matches_the_reference(kind, device):
    G, M, P, Q = 4, 200, 64, 96
    lens = make_group_lens(M, G, kind, device)
    x = torch.randn(M, P, device=device, dtype=torch.bfloat16)
    y = torch.randn(M, Q, device=device, dtype=torch.bfloat16)
    want = _reference(x, y, lens)
    tile = (32, 64, 32, 4, 3, 1) if device.type == "cpu" else sweep.TILES[1]
    out = sweep.launch_vk_devdesc(x, y, torch.empty(G, P, Q, device=device, dtype=torch.bfloat16), lens, tile)
    scale = want.abs().max()
    assert_close(out.double() / scale, want / scale, torch.bfloat16)
    start = torch.randn(G, P, Q, device=device)
    acc = sweep.launch_vk_devdesc(x, y, start.clone(), lens, tile, accumulate=2)
    assert_close((acc.double() - start.double()) / scale, want / scale, torch.bfloat16)
    for g in torch.nonzero(lens == 0).flatten().tolist():
        assert torch.count_nonzero(out[g]) == 0 and torch.equal(acc[g], start[g])


def test_zipf_routing_is_uneven_and_sums_to_the_rows():
    lens = sweep.zipf_lens(49152, 64, "cpu")
    assert int(lens.sum()) == 49152 and lens.min() > 0 and lens.max() > 8 * lens.min()
