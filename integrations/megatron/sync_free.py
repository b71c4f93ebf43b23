"""``turbo.sync_free_step`` (Megatron-Core): a training step that never waits for the GPU.

The stock loop drains the GPU queue at least four times a step: the gradient norm's ``.item()`` inside
Megatron's optimizer step (``get_grad_norm_fp32`` returns a Python float, and the clip branches on it), the
loss ``.item()``, the SIGTERM flag's ``.item()`` and the loop's ``torch.cuda.synchronize()`` that times the
step. After each drain the GPU idles while the host works through Python and launches the next kernels: the
optimizer's bookkeeping after the norm, and the next step's gradient-buffer zeroing, batch and first forward
kernels at the step boundary (H200 ``deepseek_moe_fp8`` turbo bf16, session 28 profile: 89.6 ms of GPU idle
per 345 ms profiled step, 15.2 ms of it ended by the optimizer's first launch, 13.6 ms by ``fill_``; most of
that idle is the profiler's own host cost: measured without it, this step saves 4.8 ms bf16 / 5.3 ms FP8 per
268.9 / 256.4 ms step). Here:

- the gradient norm stays on the GPU (``grad_norm_on_device`` replaces the name Megatron's optimizers call),
  and the clip multiplies by ``min(1, max_norm / (norm + 1e-6))`` computed there (``turbo_optimizer``'s clip:
  inside the turbo AdamW step with ``turbo.optimizer``, else one foreach multiply);
- each micro-batch is pinned and its copy queued without blocking;
- the trainer reduces the loss and the SIGTERM flag in one all-reduce and reads them (and the norm) back one
  step later (``DeferredMetrics``): a step's time is the GPU timeline between the end events of two steps, and
  its line prints during the next step. A SIGTERM is acted on one step later than in the stock loop (the step
  already queued completes and is the one saved).

The update is Megatron's: the same norm (an fp32 square root on the GPU instead of a float64 one on the host),
the same clip factor, the same AdamW. On a CPU the same code runs (nothing runs ahead).
"""

from __future__ import annotations

import math

import torch

ENABLED = False  # set by the turbo.sync_free_step registry entry (reset by apply_megatron_patches)
_STOCK_NORM = None  # Megatron's get_grad_norm_fp32, kept by install


def install() -> None:
    """Replace the gradient-norm function Megatron's optimizers call (``megatron.core.optimizer.optimizer``)
    and install ``turbo_optimizer``'s clip, which takes a device norm."""
    global _STOCK_NORM
    from megatron.core.optimizer import optimizer
    from primus_turbo.integrations.common.patch_registry import replace_attr
    from primus_turbo.integrations.megatron import turbo_optimizer

    if _STOCK_NORM is None:
        _STOCK_NORM = optimizer.get_grad_norm_fp32
    replace_attr(optimizer, "get_grad_norm_fp32", grad_norm_on_device)
    turbo_optimizer.install_clip()


def grad_norm_on_device(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
    """Megatron's ``get_grad_norm_fp32`` (same arguments, reductions and kernels) returning the norm as a
    0-dim fp32 tensor on the gradients' device instead of reading it back. Norm types other than 2 and inf
    run Megatron's function."""
    from megatron.core.optimizer import clip_grads

    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        return _STOCK_NORM(grads_for_norm, norm_type, grad_stats_parallel_group)
    grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
    data_parallel_group = None
    for grad in grads:
        data_parallel_group = clip_grads.get_data_parallel_group_if_dtensor(grad, data_parallel_group)
    grads = [clip_grads.to_local_if_dtensor(grad) for grad in grads]
    device = grads[0].device if grads else _default_device()
    if norm_type == math.inf:
        maxima = [g.abs().max().float() for g in grads if g.numel()]
        total = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        op = torch.distributed.ReduceOp.MAX
    else:
        if grads:  # the kernels Megatron's fallback runs (fix.grad_norm_no_sync: foreach norms, no host sync)
            dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=device)
            apply = clip_grads.multi_tensor_applier
            norm, _ = apply(clip_grads.l2_norm_impl, dummy_overflow_buf, [grads], False)
        else:
            norm = torch.zeros(1, dtype=torch.float, device=device)
        total = norm.reshape(()) ** 2.0
        op = torch.distributed.ReduceOp.SUM
    total = total.reshape(1).float()
    if data_parallel_group:
        torch.distributed.all_reduce(total, op=op, group=data_parallel_group)
    torch.distributed.all_reduce(total, op=op, group=grad_stats_parallel_group)
    return total.reshape(()) if norm_type == math.inf else total.reshape(()).sqrt()


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU batch on ``device`` without blocking the host: pinned, then copied asynchronously (on a CPU
    device: the tensor itself)."""
    if device.type != "cuda":
        return tokens.to(device)
    return tokens.pin_memory().to(device, non_blocking=True)
