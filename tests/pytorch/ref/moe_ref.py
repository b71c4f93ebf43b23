"""fp64 references for the MoE ops, written after Megatron-Core 0.16.1 moe_utils.py."""

from __future__ import annotations

import torch


def topk_routing_ref(
    logits,
    topk,
    score_function="softmax",
    use_pre_softmax=False,
    num_groups=1,
    topk_groups=1,
    scaling_factor=1.0,
    expert_bias=None,
    norm_topk=False,
):
    """Megatron's topk_routing_with_score_function in fp64 (expert bias also honoured for softmax), with the
    chosen scores renormalised when ``norm_topk`` (Megatron does that for sigmoid with topk > 1; TorchTitan
    for route_norm)."""
    t, e = logits.shape
    lf = logits.double()

    def compute_topk(scores, k):
        if num_groups > 1:
            group_scores = scores.view(t, num_groups, -1).topk(k // topk_groups, dim=-1)[0].sum(-1)
            group_idx = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            mask = group_mask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, -1)
            scores = scores.masked_fill(~mask.bool(), float("-inf"))
        return scores.topk(k, dim=-1)

    bias = expert_bias.double() if expert_bias is not None else 0.0
    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(lf, dim=-1)
            _, idx = compute_topk(scores + bias, topk)
            probs = scores.gather(1, idx)
        else:
            _, idx = compute_topk(lf + bias, topk)
            probs = torch.softmax(lf.gather(1, idx), dim=-1)
    else:
        scores = torch.sigmoid(lf)
        _, idx = compute_topk(scores + bias, topk)
        probs = scores.gather(1, idx)
    if norm_topk:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    probs = probs * scaling_factor
    dense = torch.zeros_like(lf).scatter(1, idx, probs)
    routing_map = torch.zeros_like(lf, dtype=torch.bool).scatter(1, idx, True)
    return dense, routing_map, idx


def z_loss_ref(logits, coeff):
    return torch.logsumexp(logits.double(), dim=-1).square().mean() * coeff


def switch_aux_loss_ref(probs, tokens_per_expert, total_num_tokens, topk, num_experts, coeff):
    agg = probs.double().sum(0)
    return (agg * tokens_per_expert.double()).sum() * (num_experts * coeff / (topk * total_num_tokens**2))


def seq_aux_loss_ref(scores, routing_map, seq_length, batch_size, topk, coeff):
    e = scores.shape[1]
    s2 = scores.double().reshape(seq_length, -1)
    tpe = routing_map.reshape(seq_length, -1).sum(0)
    return switch_aux_loss_ref(s2, tpe, seq_length, topk, e, coeff) / batch_size


def indices_to_map(indices, num_experts, probs=None):
    """[T, K] indices (-1 = none) -> bool routing map [T, E] and dense probs [T, E]."""
    t = indices.shape[0]
    valid = indices >= 0
    rmap = torch.zeros(t, num_experts, dtype=torch.bool, device=indices.device)
    rows = torch.arange(t, device=indices.device).unsqueeze(1).expand_as(indices)
    rmap[rows[valid], indices[valid]] = True
    dense = None
    if probs is not None:
        dense = torch.zeros(t, num_experts, dtype=torch.float64, device=indices.device)
        dense[rows[valid], indices[valid]] = probs[valid].double()
    return rmap, dense


def permute_ref(tokens, routing_map, probs=None, pad_multiple=0, capacity=None):
    """Expert-major permutation (Megatron order) in fp64, with zero padding rows.

    Returns (out [N, H], out_probs [N] or None, tokens_per_expert [E], src [N] token id or -1)."""
    routing_map = routing_map.cpu()  # the reference runs on the host whatever the inputs' device
    t, e = routing_map.shape
    rows, prow, srcs, tpe = [], [], [], []
    for ex in range(e):
        tok = torch.nonzero(routing_map[:, ex]).flatten()
        if capacity is not None:
            tok = tok[:capacity]
            n_slots = capacity
        elif pad_multiple > 1:
            n_slots = -(-len(tok) // pad_multiple) * pad_multiple
        else:
            n_slots = len(tok)
        pad = n_slots - len(tok)
        srcs.append(torch.cat([tok, tok.new_full((pad,), -1)]))
        tpe.append(len(tok) if capacity is not None else n_slots)
    src = torch.cat(srcs)
    out = torch.zeros(len(src), tokens.shape[1], dtype=torch.float64)
    ok = src >= 0
    out[ok] = tokens.double().cpu()[src[ok].cpu()]
    out_probs = None
    if probs is not None:
        out_probs = torch.zeros(len(src), dtype=torch.float64)
        ex_of_row = torch.repeat_interleave(torch.arange(e), torch.tensor([len(s) for s in srcs]))
        out_probs[ok] = probs.double().cpu()[src[ok].cpu(), ex_of_row[ok]]
    del rows, prow
    return out, out_probs, torch.tensor(tpe), src


def unpermute_ref(permuted, src, num_tokens, weights=None):
    """out[t] = sum over rows r with src[r] == t of permuted[r] (* weights[r]), fp64."""
    out = torch.zeros(num_tokens, permuted.shape[1], dtype=torch.float64)
    ok = src >= 0
    rows = permuted.double().cpu()[ok]
    if weights is not None:
        rows = rows * weights.double().cpu()[ok].unsqueeze(-1)
    out.index_add_(0, src[ok].cpu(), rows)
    return out
