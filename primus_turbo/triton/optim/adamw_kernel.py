"""AdamW's update of one parameter in one pass, the gradient scaled on the fly (gradient clipping's factor).

Per element, in fp32 (torch's fused AdamW, ``FusedAdamMathFunctor`` in ADAMW mode, in the same order):

    g = grad * scale                         (scale: a device scalar, e.g. min(1, max_norm / (norm + 1e-6)))
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / bias_correction1) * m / (sqrt(v) / sqrt(bias_correction2) + eps)

Reads p, g, m, v and writes p, m, v (28 bytes per fp32 element); the gradient is never written, where clipping
then torch's fused AdamW read and write it once more (8 bytes) and the optimizer reads it again. With a copy
(mixed-precision training's model weight next to its fp32 master), the updated p is also stored in the copy's
dtype: 2 more bytes per element for bf16, where a separate cast pass reads p again (4 + 2 bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, scale_ptr, copy_ptr, numel, lr, beta1, beta2, eps, weight_decay,
    bias_correction1, bias_correction2_sqrt, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr).to(tl.float32)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(p_ptr.dtype.element_ty).to(copy_ptr.dtype.element_ty), mask=mask)


def launch_adamw(
    param, grad, exp_avg, exp_avg_sq, scale, *, lr: float, beta1: float, beta2: float, eps: float,
    weight_decay: float, step: int, copy=None,
) -> None:  # fmt: skip
    """In place on contiguous same-shape ``param``, ``exp_avg``, ``exp_avg_sq``; ``grad`` contiguous;
    ``scale``: a one-element tensor the gradient is multiplied by, or None; ``step``: the count after this
    update; ``copy``: None, or a contiguous tensor of ``param``'s size that receives the updated ``param``
    cast to its dtype (the value ``copy.copy_(param)`` would give)."""
    numel = param.numel()
    if numel == 0:
        return
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    adamw_kernel[(triton.cdiv(numel, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, scale if scale is not None else param,
        copy if copy is not None else param, numel, lr, beta1, beta2, eps, weight_decay, bias_correction1,
        bias_correction2_sqrt, HAS_SCALE=scale is not None, HAS_COPY=copy is not None, BLOCK=BLOCK,
        num_warps=8,
    )  # fmt: skip
