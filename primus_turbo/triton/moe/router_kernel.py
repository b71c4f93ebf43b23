"""Fused MoE router: score function + (group-limited) top-k + probs + routing map, and backward.

One program handles BLOCK_T tokens x all experts (BLOCK_E = next_pow2(E) <= 1024 columns): the
whole [T, E] logits row stays in registers, so the router reads logits once and writes probs,
the routing map and the top-k indices once (eager Megatron does ~10 passes over [T, E]).

Top-k is K rounds of row argmax (K <= 16 in practice); the order of the indices is descending
score, like torch.topk(sorted=True). Group-limited routing (DeepSeek-V3): experts are split in G
contiguous groups; a group's score is the sum of its top (K / KG) expert scores; the top KG groups
stay eligible. The expert bias (aux-loss-free balancing) is added to the selection scores only;
probs come from the unbiased scores.

Score functions (SCORE): 0 softmax over the selected logits (Megatron default: top-k on logits,
then softmax), 1 softmax over all experts before top-k (use_pre_softmax), 2 sigmoid. NORM (scores 1
and 2; score 0 sums to 1 already) divides the selected scores by their sum (+1e-20) before the
scaling: norm_topk / TorchTitan's route_norm / Megatron's sigmoid with K > 1. No @triton.jit helpers
(see activation_kernel.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

SCORE_SOFTMAX = 0
SCORE_PRE_SOFTMAX = 1
SCORE_SIGMOID = 2


@triton.jit
def router_fwd_kernel(
    logits_ptr,
    bias_ptr,
    probs_ptr,
    map_ptr,
    idx_ptr,
    T,
    E,
    scaling,
    SCORE: tl.constexpr,
    NORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    KG: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    neg_inf = float("-inf")
    logits = tl.load(logits_ptr + offs, mask=mask, other=neg_inf).to(tl.float32)
    logits = tl.where(col_ok[None, :], logits, neg_inf)

    if SCORE == 1:
        ex = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = ex / tl.sum(ex, axis=1)[:, None]
    elif SCORE == 2:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        scores = logits
    sel = scores
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        sel = sel + bias[None, :]
    sel = tl.where(col_ok[None, :], sel, neg_inf)

    if G > 1:
        group_size = E // G
        gid = cols // group_size
        gcols = tl.arange(0, BLOCK_G)
        group_scores = (
            tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.float32) + tl.where(gcols < G, 0.0, neg_inf)[None, :]
        )
        for g in tl.static_range(G):
            work = tl.where((gid == g)[None, :], sel, neg_inf)
            total = tl.zeros([BLOCK_T], dtype=tl.float32)
            for _ in tl.static_range(K // KG):
                best = tl.argmax(work, axis=1)
                total += tl.max(work, axis=1)
                work = tl.where(cols[None, :] == best[:, None], neg_inf, work)
            group_scores = tl.where((gcols == g)[None, :], total[:, None], group_scores)
        keep_group = tl.zeros([BLOCK_T, BLOCK_G], dtype=tl.int32)
        for _ in tl.static_range(KG):
            best_g = tl.argmax(group_scores, axis=1)
            hit = gcols[None, :] == best_g[:, None]
            keep_group = tl.where(hit, 1, keep_group)
            group_scores = tl.where(hit, neg_inf, group_scores)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for g in tl.static_range(G):
            kept = tl.sum(tl.where((gcols == g)[None, :], keep_group, 0), axis=1)
            keep = tl.where((gid == g)[None, :], kept[:, None], keep)
        sel = tl.where(keep > 0, sel, neg_inf)
    # Valid columns stay above -inf (chosen ones drop to -inf), so every round picks a new column also where
    # fewer than K scores are finite (-inf logits, groups ruled out): K distinct experts, as torch.topk.
    sel = tl.where(col_ok[None, :], tl.maximum(sel, -3.4028234663852886e38), neg_inf)

    chosen = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(sel, axis=1)
        hit = cols[None, :] == best[:, None]
        chosen = tl.where(hit, 1, chosen)
        sel = tl.where(hit, neg_inf, sel)
        tl.store(idx_ptr + rows.to(tl.int64) * K + j, best.to(idx_ptr.dtype.element_ty), mask=row_ok)
    is_chosen = chosen > 0

    if SCORE == 0:
        z = tl.where(is_chosen, logits, neg_inf)
        ez = tl.exp(z - tl.max(z, axis=1)[:, None])
        probs = ez / tl.sum(ez, axis=1)[:, None]
    else:
        probs = tl.where(is_chosen, scores, 0.0)
        if NORM:
            probs = probs / (tl.sum(probs, axis=1)[:, None] + 1e-20)
    probs = probs * scaling
    tl.store(probs_ptr + offs, probs.to(probs_ptr.dtype.element_ty), mask=mask)
    tl.store(map_ptr + offs, chosen.to(map_ptr.dtype.element_ty), mask=mask)


@triton.jit
def router_bwd_kernel(
    grad_probs_ptr,
    logits_ptr,
    map_ptr,
    grad_logits_ptr,
    T,
    E,
    scaling,
    SCORE: tl.constexpr,
    NORM: tl.constexpr,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    neg_inf = float("-inf")
    logits = tl.load(logits_ptr + offs, mask=mask, other=neg_inf).to(tl.float32)
    is_chosen = tl.load(map_ptr + offs, mask=mask, other=0) != 0
    # Only the selected entries of probs depend on logits; gradients elsewhere are ignored.
    dp = tl.where(is_chosen, tl.load(grad_probs_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    dp = dp * scaling
    if SCORE == 0:
        z = tl.where(is_chosen, logits, neg_inf)
        ez = tl.exp(z - tl.max(z, axis=1)[:, None])
        p = ez / tl.sum(ez, axis=1)[:, None]
        dl = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    else:
        if SCORE == 1:
            ex = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            u = ex / tl.sum(ex, axis=1)[:, None]
        else:
            u = 1.0 / (1.0 + tl.exp(-logits))
        u = tl.where(mask, u, 0.0)  # the unnormalised score of every expert
        if NORM:  # probs = u_sel / (sum(u_sel) + eps): back through the normalisation first
            u_sel = tl.where(is_chosen, u, 0.0)
            denom = tl.sum(u_sel, axis=1)[:, None] + 1e-20
            q = u_sel / denom
            dp = tl.where(is_chosen, (dp - tl.sum(dp * q, axis=1)[:, None]) / denom, 0.0)
        if SCORE == 1:
            dl = u * (dp - tl.sum(u * dp, axis=1)[:, None])
        else:
            dl = dp * u * (1.0 - u)
    tl.store(grad_logits_ptr + offs, dl.to(grad_logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def zloss_fwd_kernel(logits_ptr, lse_ptr, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    m = tl.max(x, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    lse = m + tl.log(tl.sum(tl.exp(x - m[:, None]), axis=1))
    tl.store(lse_ptr + rows, lse, mask=rows < T)


@triton.jit
def zloss_bwd_kernel(
    logits_ptr, lse_ptr, grad_ptr, grad_logits_ptr, T, E, coeff, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr
):
    """d/dlogits of coeff * mean(lse^2) = coeff * 2 * lse / T * softmax(logits) * grad."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    offs = rows.to(tl.int64)[:, None] * E + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    lse = tl.load(lse_ptr + rows, mask=rows < T, other=0.0)
    g = tl.load(grad_ptr).to(tl.float32)
    p = tl.exp(x - lse[:, None])
    dl = p * (2.0 * coeff * g / T) * lse[:, None]
    tl.store(grad_logits_ptr + offs, dl.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def router_block_t(num_experts: int) -> int:
    # Keep a tile at <= 2048 fp32 values (~16 registers/thread at 4 warps for each live tile).
    return max(1, min(64, 2048 // triton.next_power_of_2(num_experts)))
