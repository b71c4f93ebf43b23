"""AdamW's update in one pass per element, the gradient scaled on the fly (gradient clipping's factor), for a
list of parameters in one launch.

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

One launch serves any number of parameters (as torch's multi-tensor apply): a device table holds, per tensor,
the addresses of p, grad, exp_avg, exp_avg_sq and copy, its size and its first block; each program finds its
tensor by a binary search over the first blocks (a per-block tensor index read instead measured 2-4% slower:
session 37, ``bench_adamw --variants``). A model's hundreds of parameters cost one launch per dtype
combination instead of one per parameter (Megatron's DeepSeek proxy: 426 Python launches, ~27 ms of host
time per step under the profiler, against 18 ms of optimizer GPU time).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# elements per program: 2048 moves the deepseek_moe_fp8 recipe's 2.25B elements at 97% of copy (16.58 ms)
# where 4096 reached 89% (17.96) and 8192 83% (H200, bench_adamw --variants, 3 rounds each, session 37)
BLOCK = 2048
ROW = 7  # table columns: p, grad, exp_avg, exp_avg_sq, copy (addresses), numel, first block


@triton.jit
def _adamw_block(
    p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, numel, scale_ptr, lr, beta1, beta2, eps, weight_decay,
    bias_correction1, bias_correction2_sqrt, P_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One block; MASKED False: a whole block inside the tensor, loads and stores without a mask (which the
    compiler can vectorize: the mask of a tensor size read from memory has no known divisibility)."""
    mask = offs < numel if MASKED else None
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
    tl.store(p_ptr + offs, p.to(P_DTYPE), mask=mask)
    tl.store(m_ptr + offs, m.to(M_DTYPE), mask=mask)
    tl.store(v_ptr + offs, v.to(M_DTYPE), mask=mask)
    if HAS_COPY:
        tl.store(c_ptr + offs, p.to(P_DTYPE).to(COPY_DTYPE), mask=mask)


@triton.jit
def adamw_kernel(
    table_ptr, num_tensors, search_steps, scale_ptr, lr, beta1, beta2, eps, weight_decay, bias_correction1,
    bias_correction2_sqrt, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr,
    COPY_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    lo = tl.zeros((), tl.int64)  # the last tensor whose first block is <= pid (empty tensors own no block)
    hi = lo + num_tensors  # (num_tensors == 1 arrives as a constant)
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = tl.load(table_ptr + mid * ROW + 6) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = table_ptr + lo * ROW
    p_ptr = tl.load(row).to(tl.pointer_type(P_DTYPE))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DTYPE))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(M_DTYPE))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(M_DTYPE))
    c_ptr = tl.load(row + 4).to(tl.pointer_type(COPY_DTYPE))
    if ALIGNED:  # every address of the table 16-byte aligned (checked on the host): vector accesses
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        c_ptr = tl.multiple_of(c_ptr, 16)
    start = (pid - tl.load(row + 6)) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    numel = tl.load(row + 5)
    if start + BLOCK <= numel:
        _adamw_block(
            p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, numel, scale_ptr, lr, beta1, beta2, eps, weight_decay,
            bias_correction1, bias_correction2_sqrt, P_DTYPE, M_DTYPE, COPY_DTYPE, HAS_SCALE, HAS_COPY, False,
        )  # fmt: skip
    else:
        _adamw_block(
            p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, numel, scale_ptr, lr, beta1, beta2, eps, weight_decay,
            bias_correction1, bias_correction2_sqrt, P_DTYPE, M_DTYPE, COPY_DTYPE, HAS_SCALE, HAS_COPY, True,
        )  # fmt: skip


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def adamw_table(
    params, grads, exp_avgs, exp_avg_sqs, copies, block: int = BLOCK
) -> tuple[list[int], int, bool]:
    """The kernel's table (flat list of int64, ROW per tensor), its block count and whether every address is
    16-byte aligned. ``copies``: None or one tensor per parameter; ``block``: elements per program (the
    launch's ``block``)."""
    rows: list[int] = []
    first = 0
    bits = 0
    for i, p in enumerate(params):
        n = p.numel()
        addresses = (p.data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                     copies[i].data_ptr() if copies is not None else 0)  # fmt: skip
        for a in addresses:
            bits |= a
        rows += (*addresses, n, first)
        first += (n + block - 1) // block  # (triton.cdiv is a jit function: ~4 us a call from Python)
    return rows, first, bits % 16 == 0


def launch_adamw(
    table: torch.Tensor, num_tensors: int, num_blocks: int, dtypes, scale, *, lr: float, beta1: float,
    beta2: float, eps: float, weight_decay: float, step: int, aligned: bool = False, block: int = BLOCK,
) -> None:  # fmt: skip
    """AdamW in place over the ``num_tensors`` tensors of ``table`` (from ``adamw_table``, on their device):
    contiguous same-size p, exp_avg, exp_avg_sq, grad (and copy; an empty tensor owns no block); ``dtypes``:
    (p, grad, moments, copy or None) torch dtypes, the same for every tensor; ``scale``: a one-element tensor
    the gradients are multiplied by, or None; ``step``: the count after this update, the same for all;
    ``aligned``: every address in the table is a multiple of 16 bytes (``adamw_table`` says); ``block``: the
    table's elements per program (``adamw_table``'s)."""
    if num_tensors == 0 or num_blocks == 0:
        return
    p_dtype, g_dtype, m_dtype, copy_dtype = dtypes
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = (1.0 - beta2**step) ** 0.5
    on_device = torch.cuda.device(table.device) if table.is_cuda else contextlib.nullcontext()
    with on_device:  # Triton launches on the current device: the tensors' one
        adamw_kernel[(num_blocks,)](
            table, num_tensors, max(num_tensors - 1, 0).bit_length(), scale if scale is not None else table,
            lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt,
            P_DTYPE=_TL[p_dtype], G_DTYPE=_TL[g_dtype], M_DTYPE=_TL[m_dtype],
            COPY_DTYPE=_TL[copy_dtype or p_dtype], HAS_SCALE=scale is not None,
            HAS_COPY=copy_dtype is not None, ALIGNED=aligned, BLOCK=block, ROW=ROW, num_warps=8,
        )  # fmt: skip
