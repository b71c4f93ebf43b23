"""``turbo.ops.cross_entropy``: fused softmax cross-entropy over the vocabulary, optionally vocab-parallel.

    loss[i] = logsumexp(logits[i]) - logits[i, target[i]]
    with label smoothing eps:  (1 - eps) * loss[i] - eps * mean_j log_softmax(logits[i])_j

``logits`` is [..., V] (bf16, fp16 or fp32; the vocabulary dim must have unit stride), ``target`` the
matching [...] of int32/int64 class ids. The loss is fp32 (the math is fp32 whatever the logits dtype), the
gradient has the logits dtype. One kernel reads the logits forward and one reads them again backward and
writes the gradient; the saved state is the logits and one fp32 per row (Megatron's eager path keeps an
fp32 softmax: twice the bf16 logits).

``tp_group``: the logits are this rank's vocabulary shard (Megatron's vocab-parallel output layer: rank r
holds ids [r * V, (r + 1) * V)) and ``target`` holds global ids; two all-reduces of [rows] tensors
combine the shards (max, then the sums). ``ignore_index`` rows get loss 0 and a zero gradient. A target
outside [0, vocab) that is not ``ignore_index`` gives a NaN loss, and a NaN gradient row wherever that loss
is used, rather than a host-synchronizing check (``PRIMUS_TURBO_DEBUG_CHECKS=1`` raises instead).
``reduction``: "none" (per-token, target's shape), "sum", or "mean" over the rows not ignored (NaN when
every row is ignored, as torch's cross_entropy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.core.utils import debug_checks_enabled
from primus_turbo.pytorch.kernels.loss.cross_entropy_impl import cross_entropy_bwd, cross_entropy_fwd

__all__ = ["cross_entropy"]

_LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TARGET_DTYPES = (torch.int32, torch.int64)
_REDUCTIONS = ("none", "sum", "mean")


def _validate(logits, target, label_smoothing, ignore_index, reduction, tp_group) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"cross_entropy: logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"cross_entropy: target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"cross_entropy: logits dtype {logits.dtype}; accepted: bfloat16, float16, float32")
    if target.dtype not in _TARGET_DTYPES:
        raise TypeError(f"cross_entropy: target dtype {target.dtype}; accepted: int64, int32 (class ids)")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"cross_entropy: logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}"
        )
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: target shape {tuple(target.shape)} must equal logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])}"
        )
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but logits on {logits.device}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"cross_entropy: label_smoothing must be a float in [0, 1), got {label_smoothing!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1), got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r}")
    if not -(2**63) <= ignore_index < 2**63:
        raise ValueError(
            f"cross_entropy: ignore_index must fit in int64 (as target does), got {ignore_index}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction {reduction!r}; accepted: {', '.join(_REDUCTIONS)}")
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise TypeError(
            f"cross_entropy: tp_group must be a ProcessGroup or None, got {type(tp_group).__name__}"
        )


def _shard(v: int, tp_group) -> tuple[int, int, int]:
    """(vocab_start, vocab_total, world) of this rank's shard."""
    if tp_group is None:
        return 0, v, 1
    world = dist.get_world_size(tp_group)
    return dist.get_rank(tp_group) * v, v * world, world


def _combine(partials, target, smoothing, ignore_index, vocab_total, tp_group):
    """Per-row loss and lse from every shard's [max, sum exp(x - max), target logit, sum x]."""
    m, s, x_t, sx = partials
    global_max = m.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    zero = torch.zeros_like(m)
    m_safe = torch.where(m == float("-inf"), zero, m)  # the shift s was computed with
    g_safe = torch.where(global_max == float("-inf"), zero, global_max)
    sums = torch.stack([s * torch.exp(m_safe - g_safe), x_t, sx])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    lse = g_safe + torch.log(sums[0])
    loss = lse - sums[1]
    if smoothing:
        loss = (1.0 - smoothing) * loss - smoothing * (sums[2] / vocab_total - lse)
    t = target.long()
    loss = torch.where((t >= 0) & (t < vocab_total), loss, torch.full_like(loss, float("nan")))
    return torch.where(t == ignore_index, zero, loss), lse


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, smoothing, ignore_index, tp_group):
        v = logits.shape[1]
        vocab_start, vocab_total, world = _shard(v, tp_group)
        if world == 1:
            loss, lse = cross_entropy_fwd(logits, target, smoothing, ignore_index, 0, v, True)
        else:
            partials, _ = cross_entropy_fwd(
                logits, target, smoothing, ignore_index, vocab_start, vocab_total, False
            )
            loss, lse = _combine(partials, target, smoothing, ignore_index, vocab_total, tp_group)
        ctx.save_for_backward(logits, target, lse)
        ctx.smoothing, ctx.ignore_index, ctx.vocab_start, ctx.vocab_total = (
            smoothing,
            ignore_index,
            vocab_start,
            vocab_total,
        )
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        grad = cross_entropy_bwd(
            logits, target, lse, grad_loss, ctx.smoothing, ctx.ignore_index, ctx.vocab_start, ctx.vocab_total
        )
        return grad, None, None, None, None


def _check_targets(target, ignore_index, vocab_total) -> None:
    """PRIMUS_TURBO_DEBUG_CHECKS=1: out-of-range targets raise (one host sync)."""
    t = target.long()
    bad = ((t < 0) | (t >= vocab_total)) & (t != ignore_index)
    if bool(bad.any()):
        first = int(t[bad][0])
        raise ValueError(
            f"cross_entropy: target holds {int(bad.sum())} ids outside [0, {vocab_total}) that are not "
            f"ignore_index={ignore_index} (first: {first})"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "none",
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Fused softmax cross-entropy (see the module docstring). Returns fp32: per-token loss with the
    shape of ``target`` for reduction="none", else a scalar."""
    _validate(logits, target, label_smoothing, ignore_index, reduction, tp_group)
    v = logits.shape[-1]
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    if debug_checks_enabled():
        _check_targets(target, ignore_index, _shard(v, tp_group)[1])
    logits2d = logits.reshape(-1, v)
    if logits2d.stride(1) != 1:
        logits2d = logits2d.contiguous()
    target1d = target.reshape(-1).contiguous()
    loss = _CrossEntropy.apply(logits2d, target1d, float(label_smoothing), ignore_index, tp_group)
    if reduction == "none":
        return loss.view(target.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target1d != ignore_index).sum()
