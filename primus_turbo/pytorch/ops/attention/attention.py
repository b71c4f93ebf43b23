"""flash_attn_func / flash_attn_varlen_func: flash-attn compatible attention with autograd.

Semantics follow flash-attn 2:

* Layouts: ``flash_attn_func`` takes q [B, Sq, Hq, D], k [B, Sk, Hk, D], v [B, Sk, Hk, Dv] (BSHD);
  ``flash_attn_varlen_func`` takes packed q [Tq, Hq, D], k/v [Tk, Hk, D|Dv] (THD) with int32
  ``cu_seqlens`` [B + 1] (monotone, starting at 0, ending at T).
* GQA/MQA: Hk must divide Hq. Dv may differ from D (MLA: 192/128).
* ``causal`` and ``window_size=(left, right)`` (-1 = unbounded) are aligned to the bottom-right
  corner when Sq != Sk: query i sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``
  (causal sets right = 0). A query row that sees no key outputs zeros.
* ``sink``: optional per-head fp32 logits [Hq] (gpt-oss attention sinks) added to every row's
  softmax denominator; it gets a gradient.
* ``return_lse``: also return the fp32 natural-log LSE, [B, Hq, Sq] (fixed) or [Hq, Tq] (varlen);
  rows that see nothing have LSE +inf (or the sink logit when a sink is given).
* ``dropout_p > 0`` runs only on backends that implement it (TORCH; SDPA backends); pinning a
  backend that cannot, raises ``ValueError``.
* ``deterministic=True`` restricts the choice to backends with bitwise-reproducible gradients
  (TRITON: no atomics; TORCH).
"""

from __future__ import annotations

import math

import torch

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.kernels.attention.attention_impl import (
    SDPA_BACKENDS,
    AttentionDispatcher,
    attention_bwd,
    attention_fwd,
)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "attention_with_lse"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"flash_attn: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"flash_attn: {name} must be {layout} ({ndim} dims), got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"flash_attn: {name} dtype {t.dtype} not supported; accepted: fp16, bf16, fp32")


def _validate(q, k, v, varlen: bool, window_size, sink, dropout_p) -> None:
    ndim, layout = (3, "[T, H, D]") if varlen else (4, "[B, S, H, D]")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, ndim, layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash_attn: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attn: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"flash_attn: batch mismatch: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            "flash_attn: k and v must agree on all dims but the last, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"flash_attn: q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"flash_attn: the number of k/v heads ({hk}) must divide the q heads ({hq})")
    if q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"flash_attn: head dims must be > 0, got q {q.shape[-1]}, v {v.shape[-1]}")
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2):
        raise ValueError(f"flash_attn: window_size must be a (left, right) pair, got {window_size!r}")
    if any((not isinstance(w, int)) or w < -1 for w in window_size):
        raise ValueError(f"flash_attn: window_size entries must be ints >= -1, got {window_size!r}")
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"flash_attn: dropout_p must be in [0, 1), got {dropout_p}")
    if sink is not None:
        if not isinstance(sink, torch.Tensor) or sink.shape != (hq,) or sink.dtype != torch.float32:
            got = (
                f"{tuple(sink.shape)} {sink.dtype}" if isinstance(sink, torch.Tensor) else type(sink).__name__
            )
            raise ValueError(f"flash_attn: sink must be an fp32 tensor of shape [{hq}] (Hq), got {got}")
        if sink.device != q.device:
            raise ValueError(f"flash_attn: sink is on {sink.device}, q on {q.device}")


def _validate_cu_seqlens(name: str, cu, total: int, batch: int | None, max_seqlen: int) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        got = f"{tuple(cu.shape)} {cu.dtype}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"flash_attn_varlen: {name} must be a 1-D int32 tensor [B + 1], got {got}")
    if batch is not None and cu.numel() != batch + 1:
        raise ValueError(
            f"flash_attn_varlen: cu_seqlens_q has {batch + 1} entries but {name} has {cu.numel()}"
        )
    # One host sync per call: a bad cu_seqlens would make the kernels read out of bounds.
    vals = cu.detach().cpu()
    if vals[0].item() != 0 or vals[-1].item() != total or bool((vals[1:] < vals[:-1]).any()):
        raise ValueError(
            f"flash_attn_varlen: {name} must start at 0, be non-decreasing and end at the token count "
            f"{total}; got {vals.tolist()[:8]}{'...' if vals.numel() > 8 else ''}"
        )
    longest = int((vals[1:] - vals[:-1]).max().item()) if vals.numel() > 1 else 0
    if longest > max_seqlen:
        raise ValueError(
            f"flash_attn_varlen: a sequence in {name} has {longest} tokens > max_seqlen {max_seqlen}"
        )


def _window(causal: bool, window_size, span: int) -> tuple[int, int]:
    """(left, right) for the kernels; a side that reaches past every key (>= Sq + Sk, ``span``) is unbounded
    (-1), as flash-attn does: the kernels add it to int32 row offsets, where a huge window overflowed."""
    left, right = (-1 if int(w) >= span else int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _softmax_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        scale = float("nan")
    if not math.isfinite(scale):
        raise ValueError(f"flash_attn: softmax_scale must be a finite number or None, got {softmax_scale!r}")
    return scale


class _FlashAttnFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, cu_q, cu_k, max_q, max_k, scale, left, right, dropout_p, seed, backend):
        out, lse = attention_fwd(q, k, v, cu_q, cu_k, max_q, max_k, sink, scale, left, right, dropout_p, seed,
                                 backend.value)  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, sink, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, left, right, dropout_p, seed, backend)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sink, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale, left, right, dropout_p, seed, backend = ctx.args
        args = (cu_q, cu_k, max_q, max_k, sink, scale, left, right, dropout_p, seed, backend.value)
        dq, dk, dv, dsink = attention_bwd(dout.contiguous(), q, k, v, out, lse, *args)
        return dq, dk, dv, (dsink if sink is not None else None), *([None] * 10)


def _run(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, deterministic,
         return_lse, sink):  # fmt: skip
    scale = _softmax_scale(softmax_scale, q.shape[-1])
    left, right = _window(causal, window_size, max_q + max_k)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # the Triton kernels index sink and cu_seqlens as contiguous arrays (a sliced sink read the wrong heads)
    sink = sink.contiguous() if sink is not None else None
    cu_q, cu_k = (c.contiguous() if c is not None else None for c in (cu_q, cu_k))
    kw = dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        sink=sink, softmax_scale=scale, window_left=left, window_right=right, dropout_p=float(dropout_p),
        deterministic=bool(deterministic), return_lse=bool(return_lse),
    )  # fmt: skip
    backend = AttentionDispatcher.resolve(**kw)
    if not torch.compiler.is_compiling():  # torch 2.11's dynamo cannot trace a class-attribute write
        AttentionDispatcher.last_backend = backend
    if backend in SDPA_BACKENDS:
        out, lse = AttentionDispatcher.backends[backend].execute(**kw)
    else:
        seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
        out, lse = _FlashAttnFunction.apply(q, k, v, sink, cu_q, cu_k, max_q, max_k, scale, left, right,
                                            float(dropout_p), seed, backend)  # fmt: skip
    return (out, lse) if return_lse else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    deterministic=False, return_lse=False, sink=None):  # fmt: skip
    """Attention over BSHD tensors; see the module docstring. Returns out [B, Sq, Hq, Dv] (and LSE)."""
    _validate(q, k, v, False, window_size, sink, dropout_p)
    return _run(q, k, v, None, None, q.shape[1], k.shape[1], dropout_p, softmax_scale, causal, window_size,
                deterministic, return_lse, sink)  # fmt: skip


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False,
                           return_lse=False, sink=None):  # fmt: skip
    """Attention over packed THD tensors with int32 cu_seqlens; returns out [Tq, Hq, Dv] (and LSE).

    cu_seqlens are checked on the host every call (start 0, non-decreasing, end at the token count, no
    sequence past max_seqlen): one device->host copy, since a bad one would make the kernels read out of
    bounds. So a varlen call syncs and cannot be captured in a CUDA graph; ``flash_attn_func`` does neither.
    """
    _validate(q, k, v, True, window_size, sink, dropout_p)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(m, int) or m < 0:
            raise ValueError(f"flash_attn_varlen: {name} must be an int >= 0, got {m!r}")
    _validate_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], None, max_seqlen_q)
    _validate_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], cu_seqlens_q.numel() - 1, max_seqlen_k)
    if cu_seqlens_q.device != q.device or cu_seqlens_k.device != q.device:
        raise ValueError(f"flash_attn_varlen: cu_seqlens must be on {q.device}")
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, deterministic, return_lse, sink)  # fmt: skip


def attention_with_lse(q, k, v, softmax_scale, causal, window_size=(-1, -1), sink=None):
    """(out, lse) for context parallelism: BSHD, LSE [B, Hq, Sq], on a backend that returns the LSE."""
    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           return_lse=True, sink=sink)  # fmt: skip


def backend_names() -> list[str]:
    return [b.name for b in BackendType if b in AttentionDispatcher.backends]
