"""Fused MoE router and router losses.

``fused_topk_routing`` is a drop-in for Megatron-Core's ``topk_routing_with_score_function``
(megatron/core/transformer/moe/moe_utils.py, 0.16.1): same score functions, group-limited top-k
and expert bias, same outputs (dense probs [T, E] with zeros off-route, bool routing_map [T, E]),
in one kernel forward and one kernel backward.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.kernels.moe.router_impl import (
    _score_code,
    router_bwd,
    router_fwd,
    zloss_bwd,
    zloss_lse,
)

__all__ = ["fused_topk_routing", "fused_switch_aux_loss", "fused_seq_aux_loss", "fused_z_loss"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_EXPERTS = 1024  # one [BLOCK_T, next_pow2(E)] tile per program


def _validate_routing(logits, topk, score_function, num_groups, topk_groups, expert_bias):
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"fused_topk_routing: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(
            f"fused_topk_routing: logits must be [num_tokens, num_experts], got {tuple(logits.shape)}"
        )
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fused_topk_routing: logits dtype {logits.dtype}; accepted float32/bfloat16/float16")
    num_experts = logits.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"fused_topk_routing: num_experts={num_experts}; accepted 1..{MAX_EXPERTS}")
    if score_function not in ("softmax", "sigmoid"):
        raise ValueError(
            f"fused_topk_routing: score_function={score_function!r}; accepted 'softmax', 'sigmoid'"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"fused_topk_routing: topk={topk} must be an int in [1, num_experts={num_experts}]")
    if not isinstance(num_groups, int) or num_groups < 1 or num_experts % num_groups != 0:
        raise ValueError(
            f"fused_topk_routing: num_groups={num_groups} must be >= 1 and divide num_experts={num_experts}"
        )
    if not isinstance(topk_groups, int) or not 1 <= topk_groups <= num_groups:
        raise ValueError(
            f"fused_topk_routing: topk_groups={topk_groups} must be in [1, num_groups={num_groups}]"
        )
    if num_groups > 1:
        if not topk_groups <= topk <= topk_groups * (num_experts // num_groups):
            raise ValueError(
                f"fused_topk_routing: topk={topk} must be in [topk_groups={topk_groups}, "
                f"topk_groups * experts per group = {topk_groups * (num_experts // num_groups)}]"
            )
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or tuple(expert_bias.shape) != (num_experts,):
            shape = tuple(expert_bias.shape) if isinstance(expert_bias, torch.Tensor) else type(expert_bias)
            raise ValueError(
                f"fused_topk_routing: expert_bias must be [num_experts={num_experts}], got {shape}"
            )
        if expert_bias.device != logits.device:
            raise ValueError(
                f"fused_topk_routing: expert_bias on {expert_bias.device}, logits on {logits.device}"
            )


class _TopkRouting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, expert_bias, topk, score, num_groups, topk_groups, scaling):
        probs, routing_map, idx = router_fwd(
            logits, expert_bias, topk, score, num_groups, topk_groups, scaling
        )
        ctx.save_for_backward(logits, routing_map)
        ctx.topk, ctx.score, ctx.scaling = topk, score, scaling
        ctx.mark_non_differentiable(routing_map, idx)
        return probs, routing_map, idx

    @staticmethod
    def backward(ctx, grad_probs, _grad_map, _grad_idx):
        logits, routing_map = ctx.saved_tensors
        grad = router_bwd(grad_probs, logits, routing_map, ctx.topk, ctx.score, ctx.scaling)
        return grad, None, None, None, None, None, None


def fused_topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    topk_groups: int | None = None,
    scaling_factor: float | None = 1.0,
    expert_bias: torch.Tensor | None = None,
    norm_topk: bool = False,
    return_indices: bool = False,
):
    """Top-k MoE routing in one kernel (forward and backward).

    Args:
        logits: [num_tokens, num_experts] router logits (fp32/bf16/fp16), num_experts <= 1024.
        topk: experts per token.
        score_function: "softmax" (top-k on logits, softmax over the chosen; with
            ``use_pre_softmax`` softmax over all experts first) or "sigmoid", as in Megatron-Core.
        num_groups / topk_groups: DeepSeek-V3 group-limited routing: experts form ``num_groups``
            contiguous groups; per token only the ``topk_groups`` groups with the largest sum of
            their top ``topk // topk_groups`` scores are eligible. As in Megatron-Core, routing is
            group-limited only when both are set (``num_groups`` without ``topk_groups`` routes over
            all experts).
        scaling_factor: multiplies the probs (DeepSeek-V3 routed_scaling_factor).
        expert_bias: [num_experts] aux-loss-free balancing bias; added to the selection scores only,
            the probs are computed from the unbiased scores.
        norm_topk: divide the chosen scores by their sum (+1e-20) before ``scaling_factor``
            (DeepSeek-V3 ``norm_topk_prob``, TorchTitan ``route_norm``; Megatron-Core does it for
            sigmoid with topk > 1). No effect on plain softmax, which sums to 1 over the chosen.
        return_indices: also return the [num_tokens, topk] int64 expert indices (descending score).

    Returns:
        (probs, routing_map) or (probs, routing_map, topk_indices): probs is [T, E] in the logits
        dtype with zeros off-route, routing_map is [T, E] bool.
    """
    if not topk_groups:  # Megatron's group_limited_topk runs only when group_topk is set
        num_groups, topk_groups = 1, 1
    elif num_groups is None:  # Megatron fails on it too (a view with a None size): never route ungrouped
        raise ValueError(
            f"fused_topk_routing: topk_groups={topk_groups} needs num_groups (the expert groups)"
        )
    scaling = 1.0 if scaling_factor is None else float(scaling_factor)
    _validate_routing(logits, topk, score_function, num_groups, topk_groups, expert_bias)
    if not isinstance(norm_topk, bool):
        raise TypeError(f"fused_topk_routing: norm_topk must be a bool, got {type(norm_topk).__name__}")
    logits = logits.contiguous()
    if expert_bias is not None:
        expert_bias = expert_bias.detach().float().contiguous()
    score = _score_code(score_function, use_pre_softmax, norm_topk)
    probs, routing_map, idx = _TopkRouting.apply(
        logits, expert_bias, topk, score, num_groups, topk_groups, scaling
    )
    return (probs, routing_map, idx) if return_indices else (probs, routing_map)


# -- losses ------------------------------------------------------------------------------------


class _ZLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, coeff):
        lse = zloss_lse(logits)
        ctx.save_for_backward(logits, lse)
        ctx.coeff = coeff
        return (lse.square().mean() * coeff) if lse.numel() else lse.sum()

    @staticmethod
    def backward(ctx, grad):
        logits, lse = ctx.saved_tensors
        return zloss_bwd(logits, lse, grad, ctx.coeff), None


def fused_z_loss(logits: torch.Tensor, z_loss_coeff: float) -> torch.Tensor:
    """ST-MoE z-loss ``coeff * mean(logsumexp(logits, -1)^2)`` (Megatron ``z_loss_func``), fp32 scalar."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("fused_z_loss: logits must be a [num_tokens, num_experts] tensor")
    if logits.dtype not in (*_FLOAT_DTYPES, torch.float64):
        raise TypeError(
            f"fused_z_loss: logits dtype {logits.dtype}; accepted float32/bfloat16/float16/float64"
        )
    return _ZLoss.apply(logits.contiguous(), float(z_loss_coeff))


class _SwitchAuxLoss(torch.autograd.Function):
    """sum_e(sum_t probs[t, e] * tokens_per_expert[e]) * c; its gradient is a broadcast of c * tpe."""

    @staticmethod
    def forward(ctx, probs, tokens_per_expert, scale):
        tpe = tokens_per_expert.float()
        ctx.save_for_backward(tpe)
        ctx.scale, ctx.probs_dtype, ctx.num_tokens = scale, probs.dtype, probs.shape[0]
        return (probs.float().sum(0) * tpe).sum() * scale

    @staticmethod
    def backward(ctx, grad):
        (tpe,) = ctx.saved_tensors
        row = (tpe * (ctx.scale * grad)).to(ctx.probs_dtype)
        return row.unsqueeze(0).expand(ctx.num_tokens, -1), None, None


def fused_switch_aux_loss(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, same formula and arguments as Megatron's
    ``switch_load_balancing_loss_func``: E * coeff / (topk * T^2) * sum_e(sum_t probs) * tpe."""
    if probs.dim() != 2 or probs.shape[1] != num_experts:
        raise ValueError(
            f"fused_switch_aux_loss: probs must be [T, num_experts={num_experts}], got {tuple(probs.shape)}"
        )
    if tuple(tokens_per_expert.shape) != (num_experts,):
        raise ValueError(
            f"fused_switch_aux_loss: tokens_per_expert must be [{num_experts}], "
            f"got {tuple(tokens_per_expert.shape)}"
        )
    scale = num_experts * coeff / (topk * max(total_num_tokens, 1) ** 2)
    return _SwitchAuxLoss.apply(probs, tokens_per_expert, scale)


def fused_seq_aux_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    seq_length: int,
    batch_size: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """DeepSeek-V3 sequence-level balance loss as Megatron computes it (``_apply_seq_aux_loss``,
    no TP/CP reduction): scores/routing_map [S * B, E] in [S, B] token order; the batch dimension
    is folded into the expert dimension, the switch loss is taken per sequence and averaged over B."""
    if scores.dim() != 2:
        raise ValueError(
            f"fused_seq_aux_loss: scores must be [seq_length * batch_size, E], got {tuple(scores.shape)}"
        )
    tokens, num_experts = scores.shape
    if tokens != seq_length * batch_size or tuple(routing_map.shape) != tuple(scores.shape):
        raise ValueError(
            f"fused_seq_aux_loss: scores {tuple(scores.shape)} / routing_map {tuple(routing_map.shape)} "
            f"must be "
            f"[seq_length * batch_size = {seq_length * batch_size}, E]"
        )
    folded_scores = scores.reshape(seq_length, batch_size * num_experts)
    folded_tpe = routing_map.reshape(seq_length, -1).sum(0)
    scale = num_experts * coeff / (topk * max(seq_length, 1) ** 2)
    return _SwitchAuxLoss.apply(folded_scores, folded_tpe, scale) / batch_size
