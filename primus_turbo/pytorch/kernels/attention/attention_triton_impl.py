"""Launchers for the Triton flash-attention kernels (primus_turbo/triton/attention).

Layouts: fixed-length q/k/v are [B, S, H, D]; packed (varlen) ones are [T, H, D] with ``cu_seqlens``.
The LSE (natural log, fp32) is [B, Hq, Sq] for fixed length and [Hq, T] for varlen, as in flash-attn.
Only the last dim must be contiguous; batch/seq/head strides are passed through.
"""

from __future__ import annotations

import torch
import triton

from primus_turbo.pytorch.core.utils import triton_interpret_enabled
from primus_turbo.triton.attention.attention_kernel import (
    LOG2E,
    attn_bwd_dkdv_kernel,
    attn_bwd_dq_kernel,
    attn_bwd_preprocess_kernel,
    attn_fwd_kernel,
)

MAX_HEAD_DIM = 256


def block_dim(d: int) -> int:
    """Padded (power-of-two, >= 16) register width for a head dim: 192 -> 256."""
    return max(16, triton.next_power_of_2(d))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) by padded head dims. Chosen from the FA2-Triton
# tutorial's sm_90 sweeps and the 227 KB shared-memory budget (d256: q 64 KB + 2 stages of 64-row
# K/V tiles = 192 KB); to be re-swept with benchmark/ops/bench_attention.py.
def fwd_config(d_qk: int, d_v: int, interpret: bool | None = None) -> tuple[int, int, int, int]:
    if triton_interpret_enabled() if interpret is None else interpret:
        return 16, 16, 4, 1  # small tiles: CPU tests at S <= 64 still cover every loop phase
    d = max(block_dim(d_qk), block_dim(d_v))
    if d <= 64:
        return 128, 64, 4, 3
    if d <= 128:
        return 128, 64, 8, 3
    return 128, 64, 8, 2


def bwd_dkdv_config(d_qk: int, d_v: int, interpret: bool | None = None) -> tuple[int, int, int, int]:
    """(inner BLOCK_M over queries, BLOCK_N keys owned by a program, warps, stages)."""
    if triton_interpret_enabled() if interpret is None else interpret:
        return 16, 16, 4, 1  # small tiles: CPU tests at S <= 64 still cover every loop phase
    d = max(block_dim(d_qk), block_dim(d_v))
    if d <= 128:
        return 32, 128, 8, 3
    return 32, 64, 8, 2


def bwd_dq_config(d_qk: int, d_v: int, interpret: bool | None = None) -> tuple[int, int, int, int]:
    if triton_interpret_enabled() if interpret is None else interpret:
        return 16, 16, 4, 1  # small tiles: CPU tests at S <= 64 still cover every loop phase
    d = max(block_dim(d_qk), block_dim(d_v))
    if d <= 128:
        return 128, 32, 8, 3
    return 64, 32, 4, 2


def _seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides in elements; batch stride 0 for packed tensors."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    if varlen:
        return 0, lse.stride(0)
    return lse.stride(0), lse.stride(1)


def _geometry(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        seqlen_q, seqlen_k = max_seqlen_q, max_seqlen_k
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    return varlen, batch, seqlen_q, seqlen_k


def _window_flags(window_left: int, window_right: int) -> tuple[bool, bool, int, int]:
    return window_left >= 0, window_right >= 0, max(window_left, 0), max(window_right, 0)


def triton_attn_fwd(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sink,
    softmax_scale,
    window_left,
    window_right,
):
    varlen, batch, seqlen_q, seqlen_k = _geometry(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    hq, hk = q.shape[-2], k.shape[-2]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    out = q.new_empty(q.shape[:-1] + (d_v,))
    if varlen:
        lse = torch.empty(hq, q.shape[0], device=q.device, dtype=torch.float32)
    else:
        lse = torch.empty(batch, hq, seqlen_q, device=q.device, dtype=torch.float32)
    if out.numel() == 0:
        return out, lse.fill_(float("inf"))
    has_left, has_right, left, right = _window_flags(window_left, window_right)
    block_m, block_n, warps, stages = fwd_config(d_qk, d_v)
    cu_q = cu_seqlens_q if varlen else lse  # dummy pointer when fixed-length
    cu_k = cu_seqlens_k if varlen else lse
    grid = (triton.cdiv(seqlen_q, block_m), batch * hq)
    attn_fwd_kernel[grid](
        q, k, v, out, lse, sink if sink is not None else lse, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(out, varlen), *_lse_strides(lse, varlen),
        seqlen_q, seqlen_k, hq, hq // hk, softmax_scale * LOG2E, left, right,
        D_QK=d_qk, D_V=d_v, BLOCK_DQK=block_dim(d_qk), BLOCK_DV=block_dim(d_v),
        BLOCK_M=block_m, BLOCK_N=block_n, IS_VARLEN=varlen,
        HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_SINK=sink is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


def triton_attn_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    sink,
    softmax_scale,
    window_left,
    window_right,
):
    """Returns (dq, dk, dv, dsink or None). Deterministic: no atomics anywhere."""
    varlen, batch, seqlen_q, seqlen_k = _geometry(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    hq, hk = q.shape[-2], k.shape[-2]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    if q.numel() == 0 or k.numel() == 0:
        dsink = torch.zeros_like(sink) if sink is not None else None
        return dq.zero_(), dk.zero_(), dv.zero_(), dsink
    has_left, has_right, left, right = _window_flags(window_left, window_right)
    cu_q = cu_seqlens_q if varlen else lse
    cu_k = cu_seqlens_k if varlen else lse
    lse_strides = _lse_strides(lse, varlen)
    pre_block = 64 if not triton_interpret_enabled() else 16
    attn_bwd_preprocess_kernel[(triton.cdiv(seqlen_q, pre_block), batch * hq)](
        out,
        dout,
        delta,
        cu_q,
        *_seq_strides(out, varlen),
        *_seq_strides(dout, varlen),
        *lse_strides,
        seqlen_q,
        hq,
        D_V=d_v,
        BLOCK_DV=block_dim(d_v),
        BLOCK_M=pre_block,
        IS_VARLEN=varlen,
    )
    common = dict(
        D_QK=d_qk,
        D_V=d_v,
        BLOCK_DQK=block_dim(d_qk),
        BLOCK_DV=block_dim(d_v),
        IS_VARLEN=varlen,
        HAS_LEFT=has_left,
        HAS_RIGHT=has_right,
    )
    qk_scale = softmax_scale * LOG2E
    block_m, block_n, warps, stages = bwd_dkdv_config(d_qk, d_v)
    attn_bwd_dkdv_kernel[(triton.cdiv(seqlen_k, block_n), batch * hk)](
        q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dk, varlen), *_seq_strides(dv, varlen), *lse_strides,
        seqlen_q, seqlen_k, hk, hq // hk, qk_scale, softmax_scale, left, right,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )  # fmt: skip
    block_m, block_n, warps, stages = bwd_dq_config(d_qk, d_v)
    attn_bwd_dq_kernel[(triton.cdiv(seqlen_q, block_m), batch * hq)](
        q, k, v, dout, lse, delta, dq, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dq, varlen), *lse_strides,
        seqlen_q, seqlen_k, hq, hq // hk, qk_scale, softmax_scale, left, right,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **common,
    )  # fmt: skip
    dsink = sink_grad(sink, lse, delta, varlen) if sink is not None else None
    return dq, dk, dv, dsink


def sink_grad(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, varlen: bool) -> torch.Tensor:
    """d sink[h] = -sum_rows exp(sink[h] - lse) * delta (the sink has no value row, so dP_sink = 0)."""
    if varlen:  # lse/delta [H, T]
        s = sink.float()[:, None]
        return -(torch.exp(s - lse) * delta).sum(dim=1).to(sink.dtype)
    s = sink.float()[None, :, None]  # lse/delta [B, H, S]
    return -(torch.exp(s - lse) * delta).sum(dim=(0, 2)).to(sink.dtype)


def triton_supports_head_dims(d_qk: int, d_v: int) -> bool:
    return 0 < d_qk <= MAX_HEAD_DIM and 0 < d_v <= MAX_HEAD_DIM
