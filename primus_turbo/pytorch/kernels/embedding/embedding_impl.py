"""Embedding backward into ``main_grad`` as a torch custom op (mutates ``main_grad``): the deterministic
Triton kernel on GPU / interpreter, ``index_add_`` in fp32 otherwise (CPU: sequential, so also
deterministic). Inputs are validated already (primus_turbo.pytorch.ops.embedding)."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.utils import eager_direct, triton_can_run_on

__all__ = ["embedding_accumulate_"]


@eager_direct
@torch.library.custom_op("primus_turbo::embedding_accumulate_", mutates_args=("main_grad",))
def embedding_accumulate_(main_grad: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad[ids[t]] += grad[t] for every token t, summed in fp32. ids [T] int, grad [T, H]."""
    if not triton_can_run_on(main_grad, ids, grad):
        main_grad.index_add_(0, ids.long(), grad.to(main_grad.dtype))
        return
    from primus_turbo.triton.embedding.embedding_kernel import launch_embedding_accumulate

    sorted_ids, perm = torch.sort(ids.long(), stable=True)
    launch_embedding_accumulate(main_grad, grad, sorted_ids, perm)


@embedding_accumulate_.register_fake
def _(main_grad, ids, grad) -> None:
    return None
