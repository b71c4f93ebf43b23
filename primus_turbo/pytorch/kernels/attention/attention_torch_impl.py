"""TORCH backend: math attention in fp32 (the CPU default and the semantic reference).

Backward recomputes the probabilities and applies the analytic gradient; dropout masks are
regenerated from the seed drawn in forward. Varlen inputs are processed one sequence at a time
(``cu_seqlens.tolist()`` is a host sync: acceptable for a reference backend, never used on the GPU fast path).
"""

from __future__ import annotations

import torch


def window_mask(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, device) -> torch.Tensor:
    """[Sq, Sk] bool, True where query i may attend key j (bottom-right aligned, flash-attn)."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    off = seqlen_k - seqlen_q
    valid = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        valid &= j >= i + off - window_left
    if window_right >= 0:
        valid &= j <= i + off + window_right
    return valid


def _dense(q, k, v, sink, softmax_scale, window_left, window_right, dropout_p, generator, bwd=None):
    """One fixed-length batch in fp32: q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv].

    Forward (bwd None): (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]). Backward, ``bwd = (dout, out, lse)``:
    (dq, dk, dv, dsink [Hq]) from the analytic flash-attention gradient using the given out/lse (as
    the Triton kernels do, so ring attention can pass the merged global out/lse of a block).
    """
    hq, hk = q.shape[2], k.shape[2]
    group = hq // hk
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * softmax_scale
    valid = window_mask(q.shape[1], k.shape[1], window_left, window_right, q.device)
    scores = scores.masked_fill(~valid, float("-inf"))
    if sink is not None:
        sink_col = sink.float().view(1, hq, 1, 1).expand(q.shape[0], hq, q.shape[1], 1)
        lse = torch.logsumexp(torch.cat([scores, sink_col], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(scores, dim=-1)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    if bwd is not None:
        lse = bwd[2].float()
    probs = torch.exp(scores - lse.unsqueeze(-1))
    keep_scale = None
    if dropout_p > 0.0:
        keep = torch.rand(probs.shape, generator=generator, device=probs.device) >= dropout_p
        keep_scale = keep.float() / (1.0 - dropout_p)
    probs_d = probs * keep_scale if keep_scale is not None else probs
    out = torch.matmul(probs_d, vt)
    if bwd is None:
        return out.transpose(1, 2), lse
    dout_t = bwd[0].float().transpose(1, 2)
    delta = (dout_t * bwd[1].float().transpose(1, 2)).sum(-1, keepdim=True)
    dv = torch.matmul(probs_d.transpose(-1, -2), dout_t)
    dprobs = torch.matmul(dout_t, vt.transpose(-1, -2))
    if keep_scale is not None:
        dprobs = dprobs * keep_scale
    dscores = probs * (dprobs - delta) * softmax_scale
    dq = torch.matmul(dscores, kt)
    dk = torch.matmul(dscores.transpose(-1, -2), qt)
    b, sk = k.shape[0], k.shape[1]
    dk = dk.view(b, hk, group, sk, dk.shape[-1]).sum(2)  # not -1: Sk may be 0
    dv = dv.view(b, hk, group, sk, dv.shape[-1]).sum(2)
    dsink = None
    if sink is not None:
        dsink = -(torch.exp(sink.float().view(1, hq, 1) - lse) * delta.squeeze(-1)).sum(dim=(0, 2))
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), dsink


def _generator(device, dropout_p: float, seed: int):
    if dropout_p <= 0.0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, sink, args, bwd=None):
    """Run ``_dense`` on fixed-length or (one sequence at a time) packed inputs."""
    if cu_seqlens_q is None:
        return _dense(q.float(), k.float(), v.float(), sink, *args, bwd=bwd)
    parts = []
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(bq) - 1):
        qs, ks = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        seq_bwd = (bwd[0][qs][None], bwd[1][qs][None], bwd[2][:, qs][None]) if bwd is not None else None
        parts.append(
            _dense(q[qs].float()[None], k[ks].float()[None], v[ks].float()[None], sink, *args, bwd=seq_bwd)
        )
    if not parts:  # no sequence at all (cu_seqlens == [0]): empty results, zero gradients
        hq = q.shape[1]
        if bwd is None:
            empty = q.new_zeros((0, hq, v.shape[-1]), dtype=torch.float32)
            return empty, q.new_zeros((hq, 0), dtype=torch.float32)
        dsink = torch.zeros_like(sink, dtype=torch.float32) if sink is not None else None
        return (*(t.new_zeros(t.shape, dtype=torch.float32) for t in (q, k, v)), dsink)
    if bwd is None:
        return torch.cat([p[0][0] for p in parts], 0), torch.cat([p[1][0] for p in parts], 1)
    dq, dk, dv = (torch.cat([p[i][0] for p in parts], 0) for i in range(3))
    dsink = torch.stack([p[3] for p in parts]).sum(0) if sink is not None and parts else None
    if sink is not None and dsink is None:
        dsink = torch.zeros_like(sink, dtype=torch.float32)
    return dq, dk, dv, dsink


def torch_attn_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    sink,
    softmax_scale,
    window_left,
    window_right,
    dropout_p,
    dropout_seed,
):
    args = (
        softmax_scale,
        window_left,
        window_right,
        dropout_p,
        _generator(q.device, dropout_p, dropout_seed),
    )
    out, lse = _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, sink, args)
    return out.to(q.dtype).contiguous(), lse.contiguous()


def torch_attn_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    sink,
    softmax_scale,
    window_left,
    window_right,
    dropout_p,
    dropout_seed,
):
    """Dropout masks are regenerated from the forward's seed (the same generator sequence)."""
    args = (
        softmax_scale,
        window_left,
        window_right,
        dropout_p,
        _generator(q.device, dropout_p, dropout_seed),
    )
    dq, dk, dv, dsink = _per_sequence(q, k, v, cu_seqlens_q, cu_seqlens_k, sink, args, bwd=(dout, out, lse))
    dsink = dsink.to(sink.dtype) if dsink is not None else None
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous(), dsink
