"""Launchers for the Triton flash-attention kernels (primus_turbo/triton/attention).

Layouts: fixed-length q/k/v are [B, S, H, D]; packed (varlen) ones are [T, H, D] with ``cu_seqlens``.
The LSE (natural log, fp32) is [B, Hq, Sq] for fixed length and [Hq, T] for varlen, as in flash-attn.
Only the last dim must be contiguous; batch/seq/head strides are passed through.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from primus_turbo.pytorch.core.utils import triton_interpret_enabled
from primus_turbo.triton.attention.attention_bwd_dkdv_kernel import attn_bwd_dkdv_kernel
from primus_turbo.triton.attention.attention_bwd_dq_kernel import (
    attn_bwd_dq_kernel,
    attn_bwd_preprocess_kernel,
)
from primus_turbo.triton.attention.attention_kernel import LOG2E, attn_fwd_kernel
from primus_turbo.triton.autotune_cache import configure as configure_autotune_cache

MAX_HEAD_DIM = 256


def block_dim(d: int) -> int:
    """Padded (power-of-two, >= 16) register width for a head dim: 192 -> 256."""
    return max(16, triton.next_power_of_2(d))


def qk_dim_split(d: int) -> tuple[int, int]:
    """(BLOCK_DQK, BLOCK_DQK1): 192 -> (128, 64) as two unpadded slices; 128 -> (128, 0); 80 -> (64,
    16); dims that are not a sum of two powers of two >= 16 -> (padded, 0)."""
    low = 1 << (d.bit_length() - 1)
    rest = d - low
    if rest == 0 and d >= 16:
        return d, 0
    if low >= 16 and rest >= 16 and rest & (rest - 1) == 0:
        return low, rest
    return block_dim(d), 0


# Candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim; the first one is the
# default (used when autotune is off, and what the sm_90 compile test checks). Chosen from the
# FA2-Triton tutorial's sm_90 sweeps and the 227 KB shared-memory budget (d256 fwd: q 64 KB + 2
# stages of 64-row K/V tiles = 192 KB; MLA 192/128 fwd: 48 KB + 3 stages of 40 KB = 168 KB). On
# the GPU the kernels autotune over the list once per
# (head dims, varlen, window flags): PRIMUS_TURBO_ATTENTION_TRITON_AUTOTUNE=0 pins the default.
# Configs that overflow shared memory are skipped by Triton's autotuner (OutOfResources).
FWD_CONFIGS = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 4)],
    192: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2), (64, 64, 4, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
}
# dK/dV: BLOCK_M is the inner step over queries, BLOCK_N the keys owned by one program
DKDV_CONFIGS = {
    64: [(32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3)],
    128: [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (16, 128, 8, 3)],
    192: [(32, 128, 8, 2), (32, 64, 8, 3), (64, 64, 8, 2), (16, 128, 8, 2)],
    256: [(32, 64, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2)],
}
DQ_CONFIGS = {
    64: [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3)],
    128: [(128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
    192: [(128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2), (64, 64, 8, 2)],
    256: [(64, 32, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2)],
}
_INTERPRETER_CONFIG = (16, 16, 4, 1)  # small tiles: CPU tests at S <= 64 still cover every loop phase
_TUNE_KEY = ["D_QK", "D_V", "IS_VARLEN", "HAS_LEFT", "HAS_RIGHT"]


def _dim_class(d_qk: int, d_v: int) -> int:
    """64, 128, 192 (MLA: q/k 128 + 64 slices, v <= 128: smaller tiles than 256 allow more stages), 256."""
    d = max(block_dim(d_qk), block_dim(d_v))
    if d <= 128:
        return 64 if d <= 64 else 128
    if sum(qk_dim_split(d_qk)) <= 192 and d_v <= 128:
        return 192
    return 256


def _default(table, d_qk, d_v, interpret):
    if triton_interpret_enabled() if interpret is None else interpret:
        return _INTERPRETER_CONFIG
    return table[_dim_class(d_qk, d_v)][0]


def fwd_config(d_qk: int, d_v: int, interpret: bool | None = None) -> tuple[int, int, int, int]:
    return _default(FWD_CONFIGS, d_qk, d_v, interpret)


def bwd_dkdv_config(d_qk: int, d_v: int, interpret: bool | None = None) -> tuple[int, int, int, int]:
    return _default(DKDV_CONFIGS, d_qk, d_v, interpret)


def bwd_dq_config(d_qk: int, d_v: int, interpret: bool | None = None) -> tuple[int, int, int, int]:
    return _default(DQ_CONFIGS, d_qk, d_v, interpret)


def _autotune_enabled() -> bool:
    if triton_interpret_enabled():
        return False
    return os.environ.get("PRIMUS_TURBO_ATTENTION_TRITON_AUTOTUNE", "1").strip().lower() not in (
        "0",
        "false",
        "off",
    )


_KERNELS = {"fwd": (attn_fwd_kernel, FWD_CONFIGS), "dkdv": (attn_bwd_dkdv_kernel, DKDV_CONFIGS),
            "dq": (attn_bwd_dq_kernel, DQ_CONFIGS)}  # fmt: skip


@functools.cache
def _tuned_kernel(which: str, dim_class: int):
    kernel, table = _KERNELS[which]
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
               for bm, bn, w, st in table[dim_class]]  # fmt: skip
    return configure_autotune_cache(triton.autotune(configs=configs, key=_TUNE_KEY)(kernel))


def _launch(which: str, d_qk: int, d_v: int, grid_fn, args: tuple, consts: dict) -> None:
    """Run kernel ``which``; ``grid_fn(BLOCK_M, BLOCK_N)`` gives the grid."""
    kernel, table = _KERNELS[which]
    if _autotune_enabled():
        tuned = _tuned_kernel(which, _dim_class(d_qk, d_v))
        tuned[lambda meta: grid_fn(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **consts)
        return
    bm, bn, warps, stages = _default(table, d_qk, d_v, None)
    kernel[grid_fn(bm, bn)](*args, **consts, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)


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
    cu_q = cu_seqlens_q if varlen else lse  # dummy pointer when fixed-length
    cu_k = cu_seqlens_k if varlen else lse
    args = (
        q, k, v, out, lse, sink if sink is not None else lse, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(out, varlen), *_lse_strides(lse, varlen),
        seqlen_q, seqlen_k, hq, hq // hk, softmax_scale * LOG2E, left, right,
    )  # fmt: skip
    consts = dict(D_QK=d_qk, D_V=d_v, BLOCK_DQK=qk_dim_split(d_qk)[0],
                  BLOCK_DQK1=qk_dim_split(d_qk)[1], BLOCK_DV=block_dim(d_v), IS_VARLEN=varlen,
                  HAS_LEFT=has_left, HAS_RIGHT=has_right, HAS_SINK=sink is not None)  # fmt: skip
    _launch("fwd", d_qk, d_v, lambda bm, bn: (triton.cdiv(seqlen_q, bm), batch * hq), args, consts)
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
        BLOCK_DQK=qk_dim_split(d_qk)[0],
        BLOCK_DQK1=qk_dim_split(d_qk)[1],
        BLOCK_DV=block_dim(d_v),
        IS_VARLEN=varlen,
        HAS_LEFT=has_left,
        HAS_RIGHT=has_right,
    )
    qk_scale = softmax_scale * LOG2E
    args = (
        q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dk, varlen), *_seq_strides(dv, varlen), *lse_strides,
        seqlen_q, seqlen_k, hk, hq // hk, qk_scale, softmax_scale, left, right,
    )  # fmt: skip
    _launch("dkdv", d_qk, d_v, lambda bm, bn: (triton.cdiv(seqlen_k, bn), batch * hk), args, common)
    args = (
        q, k, v, dout, lse, delta, dq, cu_q, cu_k,
        *_seq_strides(q, varlen), *_seq_strides(k, varlen), *_seq_strides(v, varlen),
        *_seq_strides(dout, varlen), *_seq_strides(dq, varlen), *lse_strides,
        seqlen_q, seqlen_k, hq, hq // hk, qk_scale, softmax_scale, left, right,
    )  # fmt: skip
    _launch("dq", d_qk, d_v, lambda bm, bn: (triton.cdiv(seqlen_q, bm), batch * hq), args, common)
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
