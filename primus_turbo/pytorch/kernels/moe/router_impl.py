"""Router kernels as torch custom ops: Triton on GPU / interpreter (the backward: its C++ twin on CUDA when
the extension is built), eager reference otherwise."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION, cpp_ops
from primus_turbo.pytorch.core.utils import ceil_div, eager_direct, triton_can_run_on

SCORES = {"softmax": 0, "pre_softmax": 1, "sigmoid": 2}
NORM_FLAG = 4  # score code bit: renormalise the selected scores (pre_softmax, sigmoid)


def _score_code(score_function: str, use_pre_softmax: bool, norm_topk: bool = False) -> int:
    """The kernels' score code: the score function, plus NORM_FLAG when the selected scores are
    renormalised (a no-op for plain softmax, which is normalised over the selected logits already)."""
    pre = score_function == "softmax" and use_pre_softmax
    base = SCORES["pre_softmax"] if pre else SCORES[score_function]
    return base | (NORM_FLAG if norm_topk and base != SCORES["softmax"] else 0)


def _split(score: int) -> tuple[int, bool]:
    return score & ~NORM_FLAG, bool(score & NORM_FLAG)


def router_forward_eager(logits, topk, score, num_groups, topk_groups, scaling, expert_bias):
    """Eager twin of router_fwd_kernel (fp32 math), used off-GPU and as the test reference."""
    t, e = logits.shape
    lf = logits.float()
    score, norm = _split(score)
    if score == SCORES["pre_softmax"]:
        scores = torch.softmax(lf, dim=-1)
    elif score == SCORES["sigmoid"]:
        scores = torch.sigmoid(lf)
    else:
        scores = lf
    sel = scores + expert_bias.float() if expert_bias is not None else scores
    if num_groups > 1:
        per_group = sel.view(t, num_groups, e // num_groups)
        group_scores = per_group.topk(topk // topk_groups, dim=-1).values.sum(-1)
        group_idx = group_scores.topk(topk_groups, dim=-1).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
        sel = sel.masked_fill(keep == 0, float("-inf"))
    idx = sel.topk(topk, dim=-1).indices
    chosen = torch.zeros_like(lf, dtype=torch.bool).scatter_(1, idx, True)
    if score == SCORES["softmax"]:
        probs = torch.softmax(lf.masked_fill(~chosen, float("-inf")), dim=-1)
    else:
        probs = scores * chosen
        if norm:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    return (probs * scaling).to(logits.dtype), chosen, idx


@eager_direct
@torch.library.custom_op("primus_turbo::router_fwd", mutates_args=())
def router_fwd(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    topk: int,
    score: int,
    num_groups: int,
    topk_groups: int,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    if t == 0 or not triton_can_run_on(logits):
        probs, chosen, idx = router_forward_eager(
            logits, topk, score, num_groups, topk_groups, scaling, expert_bias
        )
        return probs, chosen, idx.to(torch.int64)
    import triton

    from primus_turbo.triton.moe.router_kernel import router_block_t, router_fwd_kernel

    probs = torch.empty_like(logits)
    routing_map = torch.empty((t, e), dtype=torch.bool, device=logits.device)
    idx = torch.empty((t, topk), dtype=torch.int64, device=logits.device)
    block_t = router_block_t(e)
    base, norm = _split(score)
    router_fwd_kernel[(ceil_div(t, block_t),)](
        logits,
        expert_bias if expert_bias is not None else logits,
        probs,
        routing_map.view(torch.int8),
        idx,
        t,
        e,
        float(scaling),
        SCORE=base,
        NORM=norm,
        HAS_BIAS=expert_bias is not None,
        K=topk,
        G=num_groups,
        KG=topk_groups,
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(e),
        BLOCK_G=triton.next_power_of_2(num_groups),
    )
    return probs, routing_map, idx


@router_fwd.register_fake
def _(logits, expert_bias, topk, score, num_groups, topk_groups, scaling):
    t, e = logits.shape
    return (
        torch.empty_like(logits),
        logits.new_empty((t, e), dtype=torch.bool),
        logits.new_empty((t, topk), dtype=torch.int64),
    )


@eager_direct
@torch.library.custom_op("primus_turbo::router_bwd", mutates_args=())
def router_bwd(
    grad_probs: torch.Tensor,
    logits: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    score: int,
    scaling: float,
) -> torch.Tensor:
    t, e = logits.shape
    base, norm = _split(score)
    if t > 0 and logits.is_cuda and e <= 1024 and HAS_CPP_EXTENSION:
        # the CUDA twin of router_bwd_kernel (csrc/kernels/moe/router.cu): the same math, launched from one
        # C++ op; the op is bound by its launch path (GPU 2-15 us, host ~100 us), and a Triton launch is the
        # larger share of that
        return cpp_ops().router_bwd(grad_probs.contiguous(), logits, routing_map, base, norm, float(scaling))
    if t == 0 or not triton_can_run_on(logits):
        return _router_bwd_eager(grad_probs, logits, routing_map, topk, score, scaling)
    import triton

    from primus_turbo.triton.moe.router_kernel import router_block_t, router_bwd_kernel

    grad_logits = torch.empty_like(logits)
    block_t = router_block_t(e)
    router_bwd_kernel[(ceil_div(t, block_t),)](
        grad_probs.contiguous(),
        logits,
        routing_map.view(torch.int8),
        grad_logits,
        t,
        e,
        float(scaling),
        SCORE=base,
        NORM=norm,
        K=topk,
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(e),
    )
    return grad_logits


def _router_bwd_eager(grad_probs, logits, routing_map, topk, score, scaling):
    # Explicit formulas: autograd is not available inside a custom op's implementation.
    lf = logits.float()
    dp = grad_probs.float() * routing_map * scaling
    score, norm = _split(score)
    if score == SCORES["softmax"]:
        p = torch.softmax(lf.masked_fill(~routing_map, float("-inf")), dim=-1).nan_to_num(0.0)
        return (p * (dp - (p * dp).sum(-1, keepdim=True))).to(logits.dtype)
    u = torch.softmax(lf, dim=-1) if score == SCORES["pre_softmax"] else torch.sigmoid(lf)
    if norm:
        u_sel = u * routing_map
        denom = u_sel.sum(-1, keepdim=True) + 1e-20
        dp = (dp - (dp * u_sel / denom).sum(-1, keepdim=True)) / denom * routing_map
    if score == SCORES["pre_softmax"]:
        grad = u * (dp - (u * dp).sum(-1, keepdim=True))
    else:
        grad = dp * u * (1.0 - u)
    return grad.to(logits.dtype)


@router_bwd.register_fake
def _(grad_probs, logits, routing_map, topk, score, scaling):
    return torch.empty_like(logits)


@eager_direct
@torch.library.custom_op("primus_turbo::router_zloss_lse", mutates_args=())
def zloss_lse(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp in fp32."""
    t, e = logits.shape
    if t == 0 or not triton_can_run_on(logits):
        return torch.logsumexp(logits.float(), dim=-1)
    import triton

    from primus_turbo.triton.moe.router_kernel import router_block_t, zloss_fwd_kernel

    lse = torch.empty(t, dtype=torch.float32, device=logits.device)
    block_t = router_block_t(e)
    zloss_fwd_kernel[(ceil_div(t, block_t),)](
        logits, lse, t, e, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(e)
    )
    return lse


@zloss_lse.register_fake
def _(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.float32)


@eager_direct
@torch.library.custom_op("primus_turbo::router_zloss_bwd", mutates_args=())
def zloss_bwd(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, coeff: float) -> torch.Tensor:
    t, e = logits.shape
    if t == 0 or not triton_can_run_on(logits):
        p = torch.softmax(logits.float(), dim=-1)
        return (p * (2.0 * coeff / max(t, 1)) * lse[:, None] * grad.float()).to(logits.dtype)
    import triton

    from primus_turbo.triton.moe.router_kernel import router_block_t, zloss_bwd_kernel

    grad_logits = torch.empty_like(logits)
    block_t = router_block_t(e)
    zloss_bwd_kernel[(ceil_div(t, block_t),)](
        logits,
        lse,
        grad.reshape(1).float().contiguous(),
        grad_logits,
        t,
        e,
        float(coeff),
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(e),
    )
    return grad_logits


@zloss_bwd.register_fake
def _(logits, lse, grad, coeff):
    return torch.empty_like(logits)
