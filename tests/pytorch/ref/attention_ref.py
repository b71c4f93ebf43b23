"""fp64 attention reference: plain softmax(QK^T * scale + mask) V with autograd for gradients.

Semantics (flash-attn): bottom-right aligned causal/window masks, rows that see nothing output 0,
optional per-head sink logit in the denominator, GQA by repeating k/v heads.
"""

from __future__ import annotations

import torch


def _mask(sq: int, sk: int, causal: bool, window_size) -> torch.Tensor:
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    off = sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i + off - left
    if right >= 0:
        keep &= j <= i + off + right
    return keep


def attention_ref(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), sink=None):
    """q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] (any float dtype, computed in fp64).

    Returns (out [B, Sq, Hq, Dv] fp64, lse [B, Hq, Sq] fp64 with +inf for empty rows); differentiable
    w.r.t. q, k, v and sink.
    """
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    hq, hk = q.shape[2], k.shape[2]
    q64 = q.double().transpose(1, 2)
    k64 = k.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    v64 = v.double().transpose(1, 2).repeat_interleave(hq // hk, dim=1)
    logits = q64 @ k64.transpose(-1, -2) * scale
    keep = _mask(q.shape[1], k.shape[1], causal, window_size).to(q.device)
    logits = logits.masked_fill(~keep, float("-inf"))
    if sink is not None:
        extra = sink.double().view(1, hq, 1, 1).expand(logits.shape[0], hq, logits.shape[2], 1)
        full = torch.cat([logits, extra], dim=-1)
    else:
        full = logits
    lse = torch.logsumexp(full, dim=-1)
    empty = torch.isneginf(lse)
    probs = torch.exp(logits - lse.masked_fill(empty, 0.0).unsqueeze(-1)).masked_fill(
        empty.unsqueeze(-1), 0.0
    )
    out = (probs @ v64).transpose(1, 2)
    return out, lse.masked_fill(empty, float("inf"))


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
    """Packed [T, H, D] inputs: the dense reference per sequence; returns (out [Tq, Hq, Dv], lse [Hq, Tq])."""
    outs, lses = [], []
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bq) - 1):
        o, lse = attention_ref(
            q[bq[i] : bq[i + 1]][None], k[bk[i] : bk[i + 1]][None], v[bk[i] : bk[i + 1]][None], **kw
        )
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
