"""core.main_grad.accumulate_into_main_grads_: bitwise what Megatron DDP's per-parameter ``main_grad.add_``
gives, for every layout of the G buffers (one launch per equally spaced run), and its torch fallback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.core import main_grad as main_grad_module
from primus_turbo.pytorch.core.main_grad import _equally_spaced_runs, accumulate_into_main_grads_, add_into_


def _layout(kind, groups, shape, dtype, device):
    numel = shape[0] * shape[1]
    if kind == "separate":
        return [torch.randn(shape, device=device).to(dtype) for _ in range(groups)]
    gap = 128 if kind == "gapped" else 0
    buffer = torch.randn(groups * numel + gap, device=device).to(dtype)
    if kind == "ascending":
        starts = [g * numel for g in range(groups)]
    else:  # DDP: parameters in reverse order; "gapped": a bucket boundary before weight0
        starts = [(groups - 1 - g) * numel + (gap if g == 0 else 0) for g in range(groups)]
    return [buffer[s : s + numel].view(shape) for s in starts]


@pytest.mark.parametrize("kind, runs", [("ddp", 1), ("ascending", 1), ("gapped", 2), ("separate", None)])
# bf16 buffers: GPU only (the CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest)
@pytest.mark.parametrize("main_dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_accumulate_matches_per_parameter_add(kind, runs, main_dtype, device):
    groups, shape = 5, (48, 40)
    main_grads = _layout(kind, groups, shape, main_dtype, device)
    if runs is not None:
        assert len(list(_equally_spaced_runs(main_grads))) == runs
    weights = [SimpleNamespace(main_grad=m) for m in main_grads]
    grad = torch.randn(groups, *shape, device=device).bfloat16()
    expected = [m.clone().add_(g) for m, g in zip(main_grads, grad)]
    accumulate_into_main_grads_(weights, grad)
    for g, (got, want) in enumerate(zip(main_grads, expected)):
        assert torch.equal(got, want), f"{kind}: main_grad {g}"


def test_accumulate_falls_back_to_foreach(device, monkeypatch):
    """Non-contiguous buffers, or no Triton (CPU without the interpreter): torch._foreach_add_."""
    main_grads = [torch.randn(40, 48, device=device).t() for _ in range(3)]  # transposed views
    grad = torch.randn(3, 48, 40, device=device).bfloat16()
    expected = [m.clone().add_(g) for m, g in zip(main_grads, grad)]
    accumulate_into_main_grads_([SimpleNamespace(main_grad=m) for m in main_grads], grad)
    assert all(torch.equal(m, e) for m, e in zip(main_grads, expected))
    monkeypatch.setattr(main_grad_module, "triton_can_run_on", lambda *t: False)
    main_grads = _layout("ddp", 3, (48, 40), torch.float32, device)
    expected = [m.clone().add_(g) for m, g in zip(main_grads, grad)]
    accumulate_into_main_grads_([SimpleNamespace(main_grad=m) for m in main_grads], grad)
    assert all(torch.equal(m, e) for m, e in zip(main_grads, expected))


@pytest.mark.parametrize("shape", [(3, 7, 5), (4099,), (64, 2048)])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_add_into_matches_add(shape, src_dtype, device, monkeypatch):
    """One tensor pair (TorchTitan's fp32 .grad += a bf16 weight gradient): bitwise ``add_``, and the
    ``add_`` fallback for a non-contiguous destination or without Triton."""
    dst = torch.randn(shape, device=device)
    src = torch.randn(shape, device=device).to(src_dtype)
    expected = dst.clone().add_(src)
    add_into_(dst, src)
    assert torch.equal(dst, expected)
    if len(shape) == 2:
        dst_t = torch.randn(shape[::-1], device=device).t()
        expected = dst_t.clone().add_(src)
        add_into_(dst_t, src)
        assert torch.equal(dst_t, expected)
    monkeypatch.setattr(main_grad_module, "triton_can_run_on", lambda *t: False)
    expected = dst.clone().add_(src)
    add_into_(dst, src)
    assert torch.equal(dst, expected)


def test_add_into_reads_a_half_of_a_gate_up_gradient_in_place(device, monkeypatch):
    """src strided along dim 0 (w1's half of a [G, 2F, K] gradient): no contiguous copy, same sums."""
    grad = torch.randn(4, 2 * 24, 40, device=device).bfloat16()
    for half in grad.split(24, dim=1):
        dst = torch.randn(4, 24, 40, device=device)
        expected = dst.clone().add_(half)
        monkeypatch.setattr(torch.Tensor, "contiguous", lambda t, *a, **k: pytest.fail("copied src"))
        add_into_(dst, half)
        monkeypatch.undo()
        assert torch.equal(dst, expected)


def test_add_into_rejects_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"add_into_: dst is \(4, 5\), src \(5, 4\)"):
        add_into_(torch.zeros(4, 5), torch.zeros(5, 4))


def test_layout_is_cached_per_buffer_set_and_recomputed_when_one_changes(device, monkeypatch):
    """The runs are computed once per set of main_grad tensors; swapping any one (same first buffer)
    recomputes, so a changed layout never reuses a stale stride."""
    calls = []
    monkeypatch.setattr(main_grad_module, "_equally_spaced_runs",
                        lambda m: calls.append(1) or _equally_spaced_runs(m))  # fmt: skip
    main_grads = _layout("ddp", 3, (16, 8), torch.float32, device)
    grad = torch.randn(3, 16, 8, device=device).bfloat16()
    for _ in range(2):
        accumulate_into_main_grads_([SimpleNamespace(main_grad=m) for m in main_grads], grad)
    assert len(calls) == 1
    swapped = [main_grads[0], torch.randn(16, 8, device=device), main_grads[2]]  # not equally spaced any more
    expected = [m.clone().add_(g) for m, g in zip(swapped, grad)]
    accumulate_into_main_grads_([SimpleNamespace(main_grad=m) for m in swapped], grad)
    assert len(calls) == 2 and all(torch.equal(m, e) for m, e in zip(swapped, expected))


def test_overlapping_buffers_are_never_one_run():
    base = torch.zeros(100)
    assert list(_equally_spaced_runs([base[0:40], base[20:60], base[40:80]])) == [
        (0, 1, 0),
        (1, 2, 0),
        (2, 3, 0),
    ]


@pytest.mark.gpu
def test_accumulate_at_deepseek_expert_shape(device):
    """64 experts x [2816, 2048] (DeepSeek-V2-Lite fc1) in DDP's layout: one launch, bitwise exact."""
    main_grads = _layout("ddp", 64, (2816, 2048), torch.float32, device)
    grad = torch.randn(64, 2816, 2048, device=device, dtype=torch.bfloat16)
    expected = [m.clone().add_(g) for m, g in zip(main_grads, grad)]
    accumulate_into_main_grads_([SimpleNamespace(main_grad=m) for m in main_grads], grad)
    assert all(torch.equal(m, e) for m, e in zip(main_grads, expected))


def _compile_all():
    from primus_turbo.triton.main_grad import accumulate_kernel as ak

    for dst, src in (("*fp32", "*bf16"), ("*fp32", "*fp32"), ("*bf16", "*bf16")):
        sig = {"dst_ptr": dst, "src_ptr": src, "numel": "i64", "dst_stride_g": "i64", "src_stride_g": "i64",
               "BLOCK": "constexpr"}  # fmt: skip
        compile_for_sm90(ak.accumulate_grouped_kernel, sig, {"BLOCK": ak.BLOCK}, num_warps=4)


def test_accumulate_kernel_compiles_for_sm90():
    run_compile_check("test_main_grad")


if __name__ == "__main__":
    _compile_all()
