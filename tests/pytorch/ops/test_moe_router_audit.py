"""fused_topk_routing and the router losses at the edges an audit probed: group arguments that Megatron-Core
rejects (and the router used to route around silently), non-float loss inputs, and the group-limited routing
at expert counts that are no power of two (DeepSeek-V2's 160), one token, and all groups kept."""

import pytest
import torch
from ref.moe_ref import topk_routing_ref
from test_utils import assert_close

from primus_turbo.pytorch.ops.moe.router import fused_seq_aux_loss, fused_topk_routing, fused_z_loss


def test_topk_groups_without_enough_groups_is_rejected(device):
    """topk_groups with no num_groups, or more than num_groups, used to route over all experts (Megatron's
    group_limited_topk fails on both); num_groups=0 was read as 1."""
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"topk_groups=2 needs num_groups"):
        fused_topk_routing(x, 2, topk_groups=2)
    with pytest.raises(ValueError, match=r"topk_groups=4 must be in \[1, num_groups=1\]"):
        fused_topk_routing(x, 2, num_groups=1, topk_groups=4)
    with pytest.raises(ValueError, match=r"num_groups=0 must be >= 1"):
        fused_topk_routing(x, 2, num_groups=0, topk_groups=1)
    with pytest.raises(ValueError, match=r"topk=True must be an int"):
        fused_topk_routing(x, True)
    # still accepted: one group of all experts, and num_groups without topk_groups (ungrouped, as Megatron)
    plain = fused_topk_routing(x, 2)[1]
    assert torch.equal(fused_topk_routing(x, 2, num_groups=1, topk_groups=1)[1], plain)
    assert torch.equal(fused_topk_routing(x, 2, num_groups=4)[1], plain)


def test_loss_inputs_are_checked(device):
    with pytest.raises(TypeError, match="fused_z_loss: logits dtype torch.int64"):
        fused_z_loss(torch.randint(0, 4, (4, 8), device=device), 1e-3)
    with pytest.raises(
        ValueError, match=r"fused_seq_aux_loss: scores must be \[seq_length \* batch_size, E\]"
    ):
        fused_seq_aux_loss(torch.rand(8, device=device), torch.ones(8, dtype=torch.bool), 4, 2, 2, 0.1)


@pytest.mark.parametrize(
    "t, e, k, groups, topk_groups",
    [
        (1, 6, 6, 3, 3),  # every group kept, topk = experts per group * topk_groups
        (9, 6, 2, 3, 2),
        (9, 60, 6, 6, 3),
        (5, 160, 6, 8, 3),  # DeepSeek-V2 expert count: BLOCK_E 256, 20 experts a group
    ],
)
@pytest.mark.parametrize("score, norm", [("sigmoid", True), ("softmax", False)])
def test_group_limited_routing_at_uneven_sizes(t, e, k, groups, topk_groups, score, norm, device):
    logits = torch.randn(t, e, device=device, requires_grad=True)
    kw = dict(
        score_function=score,
        num_groups=groups,
        topk_groups=topk_groups,
        scaling_factor=2.5,
        expert_bias=torch.randn(e, device=device) * 0.3,
        norm_topk=norm,
    )
    probs, routing_map = fused_topk_routing(logits, k, **kw)
    ref_probs, ref_map, _ = topk_routing_ref(logits.detach(), k, **kw)
    assert torch.equal(routing_map.cpu(), ref_map.cpu())
    assert_close(probs, ref_probs, torch.float32)
    grad = torch.randn_like(probs)
    probs.backward(grad)
    lr = logits.detach().double().requires_grad_(True)
    topk_routing_ref(lr, k, **kw)[0].backward(grad.double())
    assert_close(logits.grad, lr.grad, torch.float32)
