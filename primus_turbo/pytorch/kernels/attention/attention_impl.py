"""Attention backends and their dispatcher (op name "attention", env PRIMUS_TURBO_ATTENTION_BACKEND).

Backends (all take the same keyword arguments, see ``AttentionDispatcher``):

* ``TRITON``: our flash-attention-2 kernels. Fixed length and varlen, GQA/MQA, head dims up to 256
  and d_v != d_qk (MLA 192/128), sliding window, attention sink, LSE output. Deterministic (no
  atomics). No dropout.
* ``CUDNN`` / ``FLASH``: ``F.scaled_dot_product_attention`` with that SDPA backend forced. They take
  only what SDPA serves: fixed length, no sink/window, causal only when Sq == Sk (SDPA's causal
  mask is top-left aligned), no LSE output, not deterministic mode; torch's own
  ``can_use_{cudnn,flash}_attention`` decides head dims, dtypes and GQA. When d_v < d_qk (MLA) and
  SDPA only takes equal dims, v is zero-padded to d_qk and the output sliced (autograd flows
  through the pad/slice). Autograd runs natively
  through SDPA, so the backward is the same SDPA backend as the forward.
* ``TORCH``: fp32 math reference; every feature incl. dropout; the CPU default.

``TRITON`` and ``TORCH`` run through the ``primus_turbo::attention_fwd/bwd`` custom ops (with fake
kernels, so torch.compile traces them); the backend name chosen in forward is an argument of both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.utils import triton_can_run_on, triton_interpret_enabled
from primus_turbo.pytorch.kernels.attention.attention_torch_impl import torch_attn_bwd, torch_attn_fwd
from primus_turbo.pytorch.kernels.attention.attention_triton_impl import (
    MAX_HEAD_DIM,
    triton_attn_bwd,
    triton_attn_fwd,
    triton_supports_head_dims,
)

_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# custom ops (TRITON, TORCH)
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("primus_turbo::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sink: torch.Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    dropout_p: float,
    dropout_seed: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == BackendType.TRITON.value:
        return triton_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
                               softmax_scale, window_left, window_right)  # fmt: skip
    if backend == BackendType.TORCH.value:
        return torch_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, sink, softmax_scale, window_left,
                              window_right, dropout_p, dropout_seed)  # fmt: skip
    raise ValueError(f"attention_fwd: backend {backend!r} does not run through this op (TRITON, TORCH)")


@attention_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, softmax_scale, window_left,
      window_right, dropout_p, dropout_seed, backend):  # fmt: skip
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("primus_turbo::attention_bwd", mutates_args=())
def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sink: torch.Tensor | None,
    softmax_scale: float,
    window_left: int,
    window_right: int,
    dropout_p: float,
    dropout_seed: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink); dsink is an empty tensor when there is no sink."""
    if backend == BackendType.TRITON.value:
        dq, dk, dv, dsink = triton_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, sink, softmax_scale,
                                            window_left, window_right)  # fmt: skip
    elif backend == BackendType.TORCH.value:
        dq, dk, dv, dsink = torch_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sink,
                                           softmax_scale, window_left, window_right, dropout_p,
                                           dropout_seed)  # fmt: skip
    else:
        raise ValueError(f"attention_bwd: backend {backend!r} does not run through this op (TRITON, TORCH)")
    if dsink is None:
        dsink = q.new_empty(0, dtype=torch.float32)
    return dq, dk, dv, dsink


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink, softmax_scale,
      window_left, window_right, dropout_p, dropout_seed, backend):  # fmt: skip
    dsink = torch.empty_like(sink) if sink is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


# ---------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------
class TorchAttentionBackend(KernelBackend):
    syncs_host = True  # varlen reads cu_seqlens on the host: the reference, never autotuned on CUDA

    @staticmethod
    def refusal(**kw: Any) -> str | None:
        """Why these inputs are not served (None: they are); ``can_handle`` is ``refusal() is None``."""
        dtype = kw["q"].dtype
        return None if dtype in (*_HALF, torch.float32) else f"dtype {dtype} (accepted: fp16, bf16, fp32)"

    @staticmethod
    def can_handle(**kw: Any) -> bool:
        return TorchAttentionBackend.refusal(**kw) is None

    @staticmethod
    def execute(**kw: Any):
        return _custom_op_fwd(BackendType.TORCH, **kw)


class TritonAttentionBackend(KernelBackend):
    @staticmethod
    def refusal(**kw: Any) -> str | None:
        """Why these inputs are not served (None: they are); ``can_handle`` is ``refusal() is None``."""
        q, k, v = kw["q"], kw["k"], kw["v"]
        interpret = triton_interpret_enabled()
        if not triton_can_run_on(q, k, v):
            return (
                f"q, k, v on {q.device.type} (accepted: CUDA tensors; CPU ones only with TRITON_INTERPRET=1)"
            )
        if q.dtype not in ((*_HALF, torch.float32) if interpret else _HALF):
            return f"dtype {q.dtype} (accepted: fp16, bf16{'; fp32 in the interpreter' if interpret else ''})"
        if kw["dropout_p"] != 0.0:
            return f"dropout_p={kw['dropout_p']} (accepted: 0.0; TORCH, CUDNN and FLASH implement dropout)"
        if not triton_supports_head_dims(q.shape[-1], v.shape[-1]):
            return f"head dims q/k {q.shape[-1]}, v {v.shape[-1]} (accepted: 1..{MAX_HEAD_DIM} each)"
        if _triton_grid_rows(kw) > _MAX_GRID_Y:
            return f"{_triton_grid_rows(kw)} (sequence, head) pairs (accepted: <= {_MAX_GRID_Y}, a grid axis)"
        span = _sequence_span(kw)
        if span > _INT32_MAX:
            return (
                f"a sequence spanning {span} elements of q/k/v/out (accepted: < 2^31: the kernels offset "
                "rows within a sequence in int32; split it with context parallelism)"
            )
        return None

    @staticmethod
    def can_handle(**kw: Any) -> bool:
        return TritonAttentionBackend.refusal(**kw) is None

    @staticmethod
    def execute(**kw: Any):
        return _custom_op_fwd(BackendType.TRITON, **kw)


# The kernels' grids put (sequence, head) pairs on CUDA's y axis, which holds at most 65535 blocks
_MAX_GRID_Y = 65535


_INT32_MAX = 2**31 - 1


def _sequence_span(kw: dict) -> int:
    """The largest element offset the Triton kernels form in int32 inside one sequence of q, k, v or the
    outputs and gradients (contiguous, [.., S, H, D]): row * seq stride + head * head stride + dim. Only each
    sequence's base is int64 (audit, session 35: S * H * D >= 2^31, e.g. 128 MLA heads of 192 at S ~ 87k)."""
    q, k, v, cu = kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"]
    # varlen: the longest sequence (at most every token when max_seqlen is not given)
    len_q = (kw.get("max_seqlen_q") or q.shape[0]) if cu is not None else q.shape[1]
    len_k = (kw.get("max_seqlen_k") or k.shape[0]) if cu is not None else k.shape[1]
    span = 0
    for t, length in ((q, len_q), (k, len_k), (v, len_k)):
        seq_stride, head_stride = abs(t.stride(-3)), abs(t.stride(-2))
        span = max(span, length * seq_stride + t.shape[-2] * head_stride, length * t.shape[-2] * t.shape[-1])
    return max(span, len_q * q.shape[-2] * v.shape[-1])  # out / dout: [.., S, Hq, Dv]


def _triton_grid_rows(kw: dict) -> int:
    cu = kw["cu_seqlens_q"]
    batch = kw["q"].shape[0] if cu is None else cu.numel() - 1
    return batch * kw["q"].shape[-2]


def _sdpa_common_refusal(kw: dict) -> str | None:
    """Why SDPA (either backend) cannot take these inputs, before asking torch's own checker."""
    q, k = kw["q"], kw["k"]
    if not q.is_cuda:
        return f"q on {q.device.type} (accepted: CUDA tensors)"
    if q.dtype not in _HALF:
        return f"dtype {q.dtype} (accepted: fp16, bf16)"
    if kw["cu_seqlens_q"] is not None:
        return "varlen cu_seqlens (accepted: fixed-length BSHD only)"
    if kw["sink"] is not None:
        return "sink (accepted: None)"
    if kw["return_lse"]:
        return "return_lse=True (SDPA returns no LSE)"
    if kw["deterministic"]:
        return "deterministic=True (SDPA gradients are not bitwise reproducible; use TRITON or TORCH)"
    if kw["window_left"] >= 0 or kw["window_right"] > 0:
        return "a sliding window_size (accepted: (-1, -1), or causal)"
    if kw["window_right"] == 0 and q.shape[1] != k.shape[1]:
        return (
            f"causal with seqlen_q {q.shape[1]} != seqlen_k {k.shape[1]} "
            "(SDPA's causal mask is top-left aligned, flash-attn's bottom-right)"
        )
    if q.numel() == 0 or k.numel() == 0:
        return "empty q or k"
    return None


def _sdpa_common_ok(kw: dict) -> bool:
    return _sdpa_common_refusal(kw) is None


def _sdpa_refusal(kw: dict, checker_name: str) -> str | None:
    if _sdpa_plan(kw, checker_name) is not None:
        return None
    common = _sdpa_common_refusal(kw)
    if common is not None:
        return common
    shapes = ", ".join(f"{n} {tuple(kw[n].shape)}" for n in ("q", "k", "v"))
    return f"torch.backends.cuda.{checker_name} refuses {shapes} (head dims, head counts or strides)"


def _sdpa_plan(kw: dict, checker_name: str) -> str | None:
    """'native', 'pad_v' (d_v < d_qk: run with v zero-padded to d_qk, slice the output; this is how
    the MLA 192/128 shape reaches SDPA's fast kernels) or None when SDPA cannot serve the inputs.
    Memoized per layout: SDPA's checks cost host time on every call otherwise."""
    if not _sdpa_common_ok(kw):
        return None
    q, k, v = kw["q"], kw["k"], kw["v"]
    causal, dropout = kw["window_right"] == 0, float(kw["dropout_p"])
    grad = q.requires_grad or k.requires_grad or v.requires_grad  # some SDPA checks differ for training
    if torch.compiler.is_compiling():
        return _sdpa_plan_for(
            checker_name, _plan_layout(q, k, v), q.dtype, q.device.index, causal, dropout, grad
        )
    layout = tuple((tuple(t.shape), tuple(t.stride())) for t in (q, k, v))
    key = ("eager", checker_name, layout, q.dtype, q.device, causal, dropout, grad)
    if key not in _SDPA_PLANS:
        _remember(key, _sdpa_probe(checker_name, q, k, v, causal, dropout))
    return _SDPA_PLANS[key]


def _sdpa_probe(checker_name: str, q, k, v, causal: bool, dropout: float) -> str | None:
    """Ask SDPA's checker about q, k, v [B, S, H, D] (only their metadata is read)."""
    try:
        checker = getattr(torch.backends.cuda, checker_name)

        def params(v_):
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v_.transpose(1, 2)
            return torch.backends.cuda.SDPAParams(
                qt, kt, vt, None, dropout, causal, qt.shape[1] != kt.shape[1]
            )

        if checker(params(v)):
            return "native"
        if v.shape[-1] < q.shape[-1]:
            padded = v.new_empty(v.shape[:-1] + (q.shape[-1],)).requires_grad_(v.requires_grad)
            return "pad_v" if checker(params(padded)) else None
        return None
    except Exception:  # can_handle never raises
        return None


_REPRESENTATIVE_LEN = 128


def _specialize(d) -> int:
    """A head count or head dim as a python int. Under torch.compile a symbolic one (dynamic=True) is
    specialized by a binary search of guarded comparisons (~12 guards, implying d == the result)."""
    if not torch.compiler.is_compiling():
        return int(d)
    lo, hi = 1, 1 << 16
    while lo < hi:
        mid = (lo + hi) // 2
        if d <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _plan_layout(q, k, v) -> tuple:
    """The layout torch.compile judges the plan on, as python ints (batch and sequence may be symbolic
    there): contiguous tensors of the real head counts and dims at batch 1 and length 128. Should SDPA
    refuse the real tensors at run time, its call under ``sdpa_kernel([backend])`` raises (no silent
    fallback); ``_sdpa_run`` makes q, k, v contiguous under compile to match."""
    out = []
    for t in (q, k, v):
        h, d = _specialize(t.shape[2]), _specialize(t.shape[3])
        out.append(((1, _REPRESENTATIVE_LEN, h, d), (_REPRESENTATIVE_LEN * h * d, h * d, d, 1)))
    return tuple(out)


# memoized plans (eager: per real layout; compile: per representative layout), bounded
_SDPA_PLANS: dict[tuple, str | None] = {}
_SDPA_PLANS_MAX = 1024


def _remember(key: tuple, plan: str | None) -> None:
    if len(_SDPA_PLANS) >= _SDPA_PLANS_MAX:
        _SDPA_PLANS.clear()
    _SDPA_PLANS[key] = plan


@torch.compiler.assume_constant_result
def _sdpa_plan_for(checker_name, layout, dtype, device_index, causal, dropout, requires_grad=False):
    """The plan from python constants only: torch.compile evaluates it once at trace time (SDPA's checker
    takes a pybind ``SDPAParams`` that dynamo cannot build). The checker sees small empty tensors of
    ``layout`` (``_plan_layout``) with the real dtype and device."""
    key = ("compile", checker_name, layout, dtype, device_index, causal, dropout, requires_grad)
    if key not in _SDPA_PLANS:
        try:
            device = torch.device("cuda", device_index)
            q, k, v = (
                torch.empty_strided(shape, stride, dtype=dtype, device=device, requires_grad=requires_grad)
                for shape, stride in layout
            )
            plan = _sdpa_probe(checker_name, q, k, v, causal, dropout)
        except Exception:  # no CUDA device: nothing SDPA-on-GPU can serve
            plan = None
        _remember(key, plan)
    return _SDPA_PLANS[key]


def _sdpa_run(sdpa_backend, checker_name: str, **kw: Any):
    from torch.nn.attention import sdpa_kernel

    d_v = kw["v"].shape[-1]
    q, k, v = kw["q"], kw["k"], kw["v"]
    if torch.compiler.is_compiling():  # the layout the compile-time plan was judged on (_plan_layout)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if _sdpa_plan(kw, checker_name) == "pad_v":
        v = F.pad(v, (0, q.shape[-1] - d_v))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel([sdpa_backend]):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=kw["dropout_p"], is_causal=kw["window_right"] == 0,
            scale=kw["softmax_scale"], enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
    return out.transpose(1, 2)[..., :d_v], None


class CudnnAttentionBackend(KernelBackend):
    @staticmethod
    def refusal(**kw: Any) -> str | None:
        return _sdpa_refusal(kw, "can_use_cudnn_attention")

    @staticmethod
    def can_handle(**kw: Any) -> bool:
        return _sdpa_plan(kw, "can_use_cudnn_attention") is not None

    @staticmethod
    def execute(**kw: Any):
        from torch.nn.attention import SDPBackend

        return _sdpa_run(SDPBackend.CUDNN_ATTENTION, "can_use_cudnn_attention", **kw)


class FlashAttentionBackend(KernelBackend):
    @staticmethod
    def refusal(**kw: Any) -> str | None:
        return _sdpa_refusal(kw, "can_use_flash_attention")

    @staticmethod
    def can_handle(**kw: Any) -> bool:
        return _sdpa_plan(kw, "can_use_flash_attention") is not None

    @staticmethod
    def execute(**kw: Any):
        from torch.nn.attention import SDPBackend

        return _sdpa_run(SDPBackend.FLASH_ATTENTION, "can_use_flash_attention", **kw)


SDPA_BACKENDS = (BackendType.CUDNN, BackendType.FLASH)


class AttentionDispatcher(AutoKernelDispatcher):
    """Keyword arguments: q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sink,
    softmax_scale, window_left, window_right (-1: unbounded; causal is window_right=0),
    dropout_p, deterministic, return_lse.

    ``execute`` returns (out, lse or None). SDPA backends return an autograd-tracked ``out`` and
    ``None``; TRITON/TORCH are called through ``flash_attn`` ops' autograd Function instead (the
    dispatcher's ``execute`` is only used by autotune timing for them).
    """

    op_name = "attention"
    backends = {
        BackendType.CUDNN: CudnnAttentionBackend,
        BackendType.TRITON: TritonAttentionBackend,
        BackendType.FLASH: FlashAttentionBackend,
        BackendType.TORCH: TorchAttentionBackend,
    }

    @classmethod
    def make_key(cls, **kw: Any) -> tuple:
        q, k, v = kw["q"], kw["k"], kw["v"]
        varlen = kw["cu_seqlens_q"] is not None
        seq = (kw["max_seqlen_q"], kw["max_seqlen_k"]) if varlen else (q.shape[1], k.shape[1])
        batch = kw["cu_seqlens_q"].numel() - 1 if varlen else q.shape[0]
        return (
            q.device.type, q.dtype, batch, *seq, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], varlen,
            kw["window_left"], kw["window_right"], kw["sink"] is not None, kw["dropout_p"] > 0,
            kw["deterministic"], kw["return_lse"],
        )  # fmt: skip

    @classmethod
    def default_backend(cls, **kw: Any) -> BackendType | None:
        # cuDNN is the fastest measured SDPA path on H200 (538/460 TFLOP/s d128 causal); our kernel
        # takes everything it cannot serve (window, sink, varlen, LSE, determinism; MLA 192/128 only where
        # cuDNN's own check refuses it: on H200 cuDNN serves it natively, 531.8 / 419.0 TFLOP/s, session 21).
        if kw["q"].is_cuda:
            return BackendType.CUDNN if CudnnAttentionBackend.can_handle(**kw) else BackendType.TRITON
        return BackendType.TORCH


def _custom_op_fwd(backend: BackendType, **kw: Any):
    return attention_fwd(
        kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"],
        kw["max_seqlen_k"], kw["sink"], kw["softmax_scale"], kw["window_left"], kw["window_right"],
        kw["dropout_p"], kw.get("dropout_seed", 0), backend.value,
    )  # fmt: skip
