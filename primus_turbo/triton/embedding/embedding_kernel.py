"""Embedding weight gradient added straight into an fp32 ``main_grad``: ``main_grad[id] += sum of the
output-gradient rows of the tokens with that id``, deterministically (no atomics).

The token ids arrive sorted (a stable sort, so equal ids keep token order) with ``perm`` giving each sorted
position's token row. Program (i, h) owns sorted position i and hidden block h: it returns at once unless i
starts a run of equal ids; otherwise it sums that run's gradient rows in fp32, in token order, and adds the
sum into the id's row of ``main_grad`` (one read-modify-write per touched row and block: the fixed order makes
the result bitwise reproducible, unlike ``index_add_``'s atomics on CUDA).

Traffic: the [T, H] gradient once and 2 x 4 bytes per touched ``main_grad`` element, instead of a dense
[V, H] gradient (zero-fill + scatter) and DDP's [V, H] fp32 += bf16 pass (10 bytes per vocabulary element).
BLOCK_H = 256 (4 warps, 2 elements per thread): a run of r equal ids is r dependent loads per program, so
narrower blocks spread a long run (a padding id repeated through a sequence) over more programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 256


@triton.jit
def embedding_accumulate_kernel(
    main_grad_ptr, grad_ptr, sorted_ids_ptr, perm_ptr, num_tokens, hidden, stride_mg, stride_g,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    row = tl.load(sorted_ids_ptr + i)
    prev = tl.load(sorted_ids_ptr + i - 1, mask=i > 0, other=-1)
    if prev != row:  # i starts the run of `row`
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        j = i
        cur = row
        while cur == row:
            token = tl.load(perm_ptr + j)
            acc += tl.load(grad_ptr + token * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
            j += 1
            cur = tl.load(sorted_ids_ptr + j, mask=j < num_tokens, other=-1)
        dst = main_grad_ptr + row.to(tl.int64) * stride_mg + offs
        total = tl.load(dst, mask=mask, other=0.0) + acc
        tl.store(dst, total.to(main_grad_ptr.dtype.element_ty), mask=mask)


def launch_embedding_accumulate(
    main_grad: torch.Tensor, grad: torch.Tensor, sorted_ids: torch.Tensor, perm: torch.Tensor
) -> None:
    """main_grad [V, H] and grad [T, H], both with unit stride along H; sorted_ids / perm [T] int64."""
    tokens, hidden = grad.shape
    if tokens == 0 or hidden == 0:
        return
    grid = (tokens, triton.cdiv(hidden, BLOCK_H))
    embedding_accumulate_kernel[grid](
        main_grad, grad, sorted_ids, perm, tokens, hidden, main_grad.stride(0), grad.stride(0),
        BLOCK_H=BLOCK_H, num_warps=4,
    )  # fmt: skip
