"""core.main_grad under bad inputs and cache churn: main_grads of the wrong shape or count, no weights, the
layout cache (it must neither keep a deleted model's buffers alive nor reuse a stride after a buffer moved),
integer main_grads, overlapping destinations; and bf16 gradients of several micro-batches summed into fp32
main_grads against torch's per-parameter ``add_``."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from primus_turbo.pytorch.core.main_grad import (
    accumulate_into_main_grads_,
    add_into_,
    check_main_grad,
    main_grad_block,
    wgrad_placeholders,
)


def _ddp_block(groups: int, shape: tuple, device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One fp32 buffer and its G views in Megatron DDP's reverse order."""
    numel = shape[0] * shape[1]
    buffer = torch.zeros(groups * numel, device=device)
    starts = [(groups - 1 - g) * numel for g in range(groups)]
    return buffer, [buffer[start : start + numel].view(shape) for start in starts]


def _weights(main_grads):
    return [SimpleNamespace(main_grad=m) for m in main_grads]


def test_accumulate_sums_bf16_microbatches_into_fp32_main_grads(device):
    """Three micro-batches of bf16 gradients into DDP-laid-out fp32 buffers: per-parameter ``add_``."""
    _, main_grads = _ddp_block(4, (8, 6), device)
    expected = [torch.zeros(8, 6, device=device) for _ in range(4)]
    for _ in range(3):
        grad = torch.randn(4, 8, 6, device=device).bfloat16()
        accumulate_into_main_grads_(_weights(main_grads), grad)
        for e, g in zip(expected, grad):
            e.add_(g)
    assert all(torch.equal(m, e) for m, e in zip(main_grads, expected))


@pytest.mark.parametrize(
    "main_shape, grad_shape",
    [((4, 4), (2, 4, 8)), ((4, 8), (2, 8)), ((4, 8), (2, 4, 4))],
    ids=["smaller-main-grad", "broadcastable-grad", "larger-main-grad"],
)
def test_accumulate_rejects_main_grads_of_another_shape(main_shape, grad_shape, device):
    """The kernel adds main_grad.numel() elements from each grad row: a larger main_grad read past grad
    (garbage added), a smaller one dropped elements, the fallback broadcast. All silent before."""
    main_grads = [torch.zeros(main_shape, device=device) for _ in range(2)]
    grad = torch.ones(grad_shape, device=device)
    with pytest.raises(ValueError, match=r"weights\[0\]\.main_grad is \(4, \d\), grad\[0\]"):
        accumulate_into_main_grads_(_weights(main_grads), grad)
    assert all(not m.any() for m in main_grads)


def test_accumulate_rejects_a_weight_count_other_than_g(device):
    """Three weights for a G=2 gradient: the third main_grad was silently left out."""
    main_grads = [torch.zeros(4, 4, device=device) for _ in range(3)]
    with pytest.raises(ValueError, match=r"3 weights, grad has G=2"):
        accumulate_into_main_grads_(_weights(main_grads), torch.ones(2, 4, 4, device=device))


def test_no_weights_is_a_no_op(device):
    """G=0 (IndexError before) for the accumulation and the DDP placeholders."""
    accumulate_into_main_grads_([], torch.ones(0, 4, 4, device=device))
    assert wgrad_placeholders([]) == []


def test_layout_cache_does_not_keep_a_deleted_models_buffers_alive(device):
    """The layout cache held the main_grad tensors (views: their whole gradient buffer) until 4096 entries."""
    buffer, main_grads = _ddp_block(3, (8, 8), device)
    accumulate_into_main_grads_(_weights(main_grads), torch.ones(3, 8, 8, device=device))
    assert main_grad_block(_weights(main_grads)) is not None
    alive = weakref.ref(buffer)
    del buffer, main_grads
    gc.collect()
    assert alive() is None


def test_layout_cache_sees_a_main_grad_moved_to_new_storage(device):
    """Same tensor object, new memory (``.data = ...``): the cached stride wrote its gradient into the old
    buffer and left the new one untouched."""
    buffer, main_grads = _ddp_block(3, (8, 8), device)
    weights = _weights(main_grads)
    accumulate_into_main_grads_(weights, torch.ones(3, 8, 8, device=device))
    main_grads[1].data = torch.zeros(8, 8, device=device)
    accumulate_into_main_grads_(weights, torch.ones(3, 8, 8, device=device))
    assert [m.sum().item() for m in main_grads] == [128.0, 64.0, 128.0]
    assert buffer.sum().item() == 2 * 128.0 + 64.0  # the moved-away slice got nothing more


def test_check_main_grad_rejects_an_integer_main_grad():
    """An int main_grad failed in the backward with 'no backend can handle these inputs' (naming nothing)."""
    weight = torch.zeros(4, 4, requires_grad=True)
    weight.main_grad = torch.zeros(4, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"gemm: b\.main_grad must be floating-point, got torch\.int32"):
        check_main_grad(weight)
    weight.main_grad = torch.zeros(4, 4, dtype=torch.bfloat16)
    check_main_grad(weight)


def test_add_into_refuses_an_overlapping_destination(device):
    """An expanded dst (every row the same memory): torch's add_ refuses it; the kernel summed every row into
    the one row silently (the result depended on launch order on a GPU)."""
    dst = torch.zeros(1, 8, device=device).expand(3, 8)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        add_into_(dst, torch.ones(3, 8, device=device))
