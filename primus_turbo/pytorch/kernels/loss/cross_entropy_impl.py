"""Cross-entropy kernels as torch custom ops: the Triton kernels on GPU / interpreter, fp32 eager math
otherwise (and as the test reference). Inputs here are validated already (primus_turbo.pytorch.ops.
cross_entropy): logits [rows, V] with unit stride along V, target [rows] int32/int64, contiguous.

``vocab_start`` / ``vocab_total``: this shard holds vocabulary ids [vocab_start, vocab_start + V) of
``vocab_total`` (tensor parallel); ``final=False`` returns the per-row partials [4, rows] (max, sum of
exp(x - max), target logit or 0 off-shard, sum of x) for the caller to combine across ranks.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.utils import ceil_div, eager_direct, triton_can_run_on

__all__ = ["cross_entropy_fwd", "cross_entropy_bwd", "cross_entropy_fwd_eager", "cross_entropy_bwd_eager"]

_NEG_INF = float("-inf")


def _block(v: int) -> int:
    import triton

    from primus_turbo.triton.loss.cross_entropy_kernel import BLOCK_V

    return min(BLOCK_V, triton.next_power_of_2(max(v, 1)))


def cross_entropy_fwd_eager(logits, target, smoothing, ignore_index, vocab_start, vocab_total, final):
    """fp32 twin of cross_entropy_fwd_kernel: the same max shift, the same NaN / ignore rules."""
    x = logits.float()
    v = x.shape[1]
    m = x.max(dim=1).values if v else x.new_full((x.shape[0],), _NEG_INF)
    m_safe = torch.where(m == _NEG_INF, torch.zeros_like(m), m)
    s = torch.exp(x - m_safe[:, None]).sum(1)
    t = target.long()
    local = t - vocab_start
    is_local = (local >= 0) & (local < v)
    x_t = x.gather(1, local.clamp(0, max(v - 1, 0))[:, None]).squeeze(1) if v else torch.zeros_like(m)
    x_t = torch.where(is_local, x_t, torch.zeros_like(x_t))
    sx = x.sum(1)
    if not final:
        return torch.stack([m, s, x_t, sx]), x.new_empty(0)
    lse = m_safe + torch.log(s)
    loss = lse - x_t
    if smoothing:
        loss = (1.0 - smoothing) * loss - smoothing * (sx / vocab_total - lse)
    valid = (t >= 0) & (t < vocab_total)
    loss = torch.where(valid, loss, torch.full_like(loss, float("nan")))
    return torch.where(t == ignore_index, torch.zeros_like(loss), loss), lse


def cross_entropy_bwd_eager(
    logits, target, lse, grad_loss, smoothing, ignore_index, vocab_start, vocab_total
):
    x = logits.float()
    t = target.long()
    g = torch.where(t == ignore_index, torch.zeros_like(grad_loss.float()), grad_loss.float())
    d = torch.exp(x - lse[:, None]) - smoothing / vocab_total
    cols = torch.arange(x.shape[1], device=x.device)
    d = d - (1.0 - smoothing) * (cols[None, :] == (t - vocab_start)[:, None])
    used_invalid = ((t < 0) | (t >= vocab_total)) & (g != 0)  # NaN loss -> NaN gradient, as the kernel
    return torch.where(used_invalid[:, None], float("nan"), d * g[:, None]).to(logits.dtype)


@eager_direct
@torch.library.custom_op("primus_turbo::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    smoothing: float,
    ignore_index: int,
    vocab_start: int,
    vocab_total: int,
    final: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """final: (loss [rows] fp32, lse [rows] fp32); else (partials [4, rows] fp32, an empty tensor)."""
    rows, v = logits.shape
    if rows == 0 or v == 0 or not triton_can_run_on(logits, target):
        return cross_entropy_fwd_eager(
            logits, target, smoothing, ignore_index, vocab_start, vocab_total, final
        )
    from primus_turbo.triton.loss.cross_entropy_kernel import NUM_WARPS, cross_entropy_fwd_kernel

    if final:
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    else:
        out = torch.empty(4, rows, dtype=torch.float32, device=logits.device)
        lse = out  # unused by the kernel without FINAL
    cross_entropy_fwd_kernel[(rows,)](
        logits,
        target,
        out,
        lse,
        rows,
        v,
        logits.stride(0),
        vocab_start,
        vocab_total,
        ignore_index,
        float(smoothing),
        FINAL=final,
        SMOOTH=smoothing != 0.0,
        BLOCK=_block(v),
        num_warps=NUM_WARPS,
    )
    return out, (lse if final else logits.new_empty(0, dtype=torch.float32))


@cross_entropy_fwd.register_fake
def _(logits, target, smoothing, ignore_index, vocab_start, vocab_total, final):
    rows = logits.shape[0]
    if final:
        return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)
    return logits.new_empty(4, rows, dtype=torch.float32), logits.new_empty(0, dtype=torch.float32)


@eager_direct
@torch.library.custom_op("primus_turbo::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd(
    logits: torch.Tensor,
    target: torch.Tensor,
    lse: torch.Tensor,
    grad_loss: torch.Tensor,
    smoothing: float,
    ignore_index: int,
    vocab_start: int,
    vocab_total: int,
) -> torch.Tensor:
    """d(loss)/d(logits) in the logits dtype: (softmax - (1 - eps) onehot - eps / V) * grad_loss."""
    rows, v = logits.shape
    grad_loss = grad_loss.contiguous()
    if rows == 0 or v == 0 or not triton_can_run_on(logits, target):
        return cross_entropy_bwd_eager(
            logits, target, lse, grad_loss, smoothing, ignore_index, vocab_start, vocab_total
        )
    from primus_turbo.triton.loss.cross_entropy_kernel import NUM_WARPS, cross_entropy_bwd_kernel

    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    block = _block(v)
    cross_entropy_bwd_kernel[(rows, ceil_div(v, block))](
        logits,
        target,
        lse,
        grad_loss,
        grad,
        v,
        logits.stride(0),
        grad.stride(0),
        vocab_start,
        vocab_total,
        ignore_index,
        float(smoothing),
        BLOCK=block,
        num_warps=NUM_WARPS,
    )
    return grad


@cross_entropy_bwd.register_fake
def _(logits, target, lse, grad_loss, smoothing, ignore_index, vocab_start, vocab_total):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)
