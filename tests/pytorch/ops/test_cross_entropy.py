"""turbo.ops.cross_entropy against torch's cross_entropy in float64 (loss and logits gradient), the
vocab-parallel combine over 2 gloo ranks, the NaN / ignore rules, torch.compile, bad input, and the
sm_90 compile of both kernels. GPU: real vocabulary sizes (bf16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from test_utils import assert_close
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.ops.cross_entropy import cross_entropy

SHAPES = [(7, 1), (13, 100), (33, 257), (5, 4097)]  # V = 1, odd, one past a power of two, > one block


def _reference(logits, target, grad, label_smoothing=0.0, ignore_index=-100, reduction="none"):
    x = logits.detach().double().requires_grad_(True)
    loss = F.cross_entropy(
        x.reshape(-1, x.shape[-1]), target.reshape(-1).long(), reduction=reduction,
        label_smoothing=label_smoothing, ignore_index=ignore_index,
    )  # fmt: skip
    loss = loss.view(target.shape) if reduction == "none" else loss
    loss.backward(grad.double())
    return loss.detach(), x.grad


def _check(shape, dtype, device, label_smoothing=0.0, target_dtype=torch.int64, scale=3.0):
    *lead, v = shape
    logits = (torch.randn(*shape, device=device) * scale).to(dtype).requires_grad_(True)
    target = torch.randint(0, v, tuple(lead), device=device, dtype=target_dtype)
    loss = cross_entropy(logits, target, label_smoothing=label_smoothing)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    grad = torch.randn_like(loss)
    loss.backward(grad)
    ref_loss, ref_grad = _reference(logits, target, grad, label_smoothing)
    assert logits.grad.dtype == dtype
    assert_close(loss, ref_loss.float(), torch.float32 if dtype == torch.float32 else dtype)
    assert_close(logits.grad, ref_grad.to(dtype), dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(shape, dtype, device):
    _check(shape, dtype, device)


@pytest.mark.parametrize("label_smoothing", [0.1, 0.3])
def test_label_smoothing_matches_torch_definition(label_smoothing, device):
    _check((4, 9, 130), torch.float32, device, label_smoothing)


def test_int32_targets_and_3d_logits(device):
    _check((3, 11, 70), torch.float32, device, target_dtype=torch.int32)


def test_large_negative_and_masked_logits_stay_finite(device):
    """An offset of -1000 (exp underflows without the max shift) and whole -inf columns (a masked
    vocabulary) still give the reference loss and gradient."""
    logits = torch.randn(9, 300, device=device) * 2 - 1000.0
    logits[:, 150:] = float("-inf")
    target = torch.randint(0, 150, (9,), device=device)
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target)
    grad = torch.rand_like(loss) + 0.5
    loss.backward(grad)
    ref_loss, ref_grad = _reference(logits, target, grad)
    assert torch.isfinite(loss).all()
    assert_close(loss, ref_loss.float(), torch.float32)
    assert_close(x.grad, ref_grad.float(), torch.float32)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ignore_index_and_reductions_match_torch(reduction, device):
    logits = (torch.randn(40, 97, device=device) * 2).requires_grad_(True)
    target = torch.randint(0, 97, (40,), device=device)
    target[::3] = -7
    loss = cross_entropy(logits, target, ignore_index=-7, reduction=reduction)
    loss.backward()
    one = torch.tensor(1.0, device=device)
    ref_loss, ref_grad = _reference(logits, target, one, ignore_index=-7, reduction=reduction)
    assert_close(loss, ref_loss.float(), torch.float32)
    assert_close(logits.grad, ref_grad.float(), torch.float32)
    assert torch.count_nonzero(logits.grad[::3]) == 0


def test_ignored_rows_have_zero_loss_per_token(device):
    logits = torch.randn(6, 20, device=device)
    target = torch.tensor([1, -100, 3, -100, 0, 19], device=device)
    loss = cross_entropy(logits, target)
    assert torch.equal(loss[1], torch.zeros((), device=device)) and loss[3].item() == 0.0
    assert (loss[[0, 2, 4, 5]] > 0).all()


def test_out_of_range_target_is_nan_not_garbage(device, monkeypatch):
    logits = torch.randn(4, 16, device=device)
    target = torch.tensor([0, 16, -1, 5], device=device)
    loss = cross_entropy(logits, target)
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and torch.isfinite(loss[[0, 3]]).all()
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    with pytest.raises(
        ValueError, match=r"2 ids outside \[0, 16\) that are not ignore_index=-100 \(first: 16\)"
    ):
        cross_entropy(logits, target)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_out_of_range_target_gradient_is_nan_where_the_loss_is_used(reduction, device):
    """An out-of-range target's NaN loss reaches its logits gradient as NaN (a NaN-in-grad guard sees it),
    not as a finite softmax row; a row the caller drops (zero grad_loss) gets zero, the others stay exact."""
    logits = (torch.randn(5, 16, device=device) * 2).requires_grad_(True)
    target = torch.tensor([0, 16, -1, 5, -100], device=device)
    loss = cross_entropy(logits, target, label_smoothing=0.1, reduction=reduction)
    row_grad = torch.tensor([1.0, 1.0, 0.0, 0.5, 1.0], device=device)
    loss.backward(row_grad if reduction == "none" else None)
    if reduction == "mean":
        row_grad = torch.full((5,), 1 / 4, device=device)  # 4 rows not ignored
    bad = torch.tensor([False, True, True, False, False], device=device)
    used_bad = bad & (row_grad != 0)
    assert torch.isnan(logits.grad[used_bad]).all()
    _, ref = _reference(logits, torch.where(bad, 0, target), torch.where(bad, 0.0, row_grad), 0.1)
    assert_close(logits.grad[~used_bad], ref[~used_bad].float(), torch.float32)
    from primus_turbo.pytorch.kernels.loss import cross_entropy_impl as impl  # the eager twin: the same rule

    _, lse = impl.cross_entropy_fwd_eager(logits.detach(), target, 0.1, -100, 0, 16, True)
    eager = impl.cross_entropy_bwd_eager(logits.detach(), target, lse, row_grad, 0.1, -100, 0, 16)
    assert torch.equal(torch.isnan(eager).all(1), used_bad)


def test_empty_rows_and_strided_rows(device):
    empty = torch.randn(0, 50, device=device, requires_grad=True)
    out = cross_entropy(empty, torch.zeros(0, dtype=torch.long, device=device))
    assert out.shape == (0,)
    out.sum().backward()
    assert empty.grad.shape == (0, 50)
    base = torch.randn(8, 64, device=device)
    view = base[:, :48].requires_grad_(False)  # rows with stride 64, unit stride along V
    target = torch.randint(0, 48, (8,), device=device)
    ref, _ = _reference(view, target, torch.ones(8, device=device))
    assert_close(cross_entropy(view, target), ref.float(), torch.float32)


@pytest.mark.parametrize("final", [True, False])
def test_eager_twin_matches_the_kernels(final, device):
    """The fp32 eager math (CPUs without the interpreter, rows == 0) against the Triton kernels, on a vocab
    shard [40, 90) of 130 with label smoothing, an ignored row and a target off the shard."""
    from primus_turbo.pytorch.kernels.loss import cross_entropy_impl as impl

    logits = torch.randn(12, 50, device=device) * 3
    target = torch.randint(0, 130, (12,), device=device)
    target[:3] = torch.tensor([-100, 45, 10], device=device)
    args = (0.1, -100, 40, 130, final)
    out, lse = impl.cross_entropy_fwd(logits, target, *args)
    ref_out, ref_lse = impl.cross_entropy_fwd_eager(logits, target, *args)
    assert_close(out, ref_out, torch.float32)
    if final:
        assert_close(lse, ref_lse, torch.float32)
        grad_loss = torch.rand(12, device=device)
        grad = impl.cross_entropy_bwd(logits, target, lse, grad_loss, 0.1, -100, 40, 130)
        ref = impl.cross_entropy_bwd_eager(logits, target, lse, grad_loss, 0.1, -100, 40, 130)
        assert_close(grad, ref, torch.float32)
        assert torch.count_nonzero(grad[0]) == 0


def _tp_body(rank, world_size, device, logits_full, target, grad, label_smoothing):
    import torch.distributed as dist

    v = logits_full.shape[-1] // world_size
    shard = logits_full[..., rank * v : (rank + 1) * v].clone().requires_grad_(True)
    loss = cross_entropy(shard, target, label_smoothing=label_smoothing, tp_group=dist.group.WORLD)
    loss.backward(grad)
    ref_loss, ref_grad = _reference(logits_full, target, grad, label_smoothing)
    assert_close(loss, ref_loss.float(), torch.float32)
    assert_close(shard.grad, ref_grad[..., rank * v : (rank + 1) * v].float(), torch.float32)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_vocab_parallel_two_ranks_match_the_full_vocabulary(label_smoothing):
    logits = torch.randn(3, 10, 2 * 75) * 3
    logits[0, 0, :75] = float("-inf")  # one rank's shard of a row entirely masked
    target = torch.randint(0, 150, (3, 10))
    target[0, 0] = 100
    target[1, ::4] = -100
    grad = torch.rand(3, 10) + 0.5
    run_distributed(_tp_body, world_size=2, args=(logits, target, grad, label_smoothing))


def test_torch_compile_fullgraph_matches_eager(device):
    logits = torch.randn(16, 77, device=device, requires_grad=True)
    target = torch.randint(0, 77, (16,), device=device)
    compiled = torch.compile(lambda x, t: cross_entropy(x, t, reduction="mean"), fullgraph=True)
    out = compiled(logits, target)
    out.backward()
    grad = logits.grad.clone()
    logits.grad = None
    ref = cross_entropy(logits, target, reduction="mean")
    ref.backward()
    assert_close(out, ref, torch.float32)
    assert_close(grad, logits.grad, torch.float32)


BAD = [
    (dict(logits=[1.0]), TypeError, "logits must be a torch.Tensor"),
    (
        dict(logits_dtype=torch.int64),
        TypeError,
        "logits dtype torch.int64; accepted: bfloat16, float16, float32",
    ),
    (dict(target_dtype=torch.float32), TypeError, "target dtype torch.float32; accepted: int64, int32"),
    (dict(v=0), ValueError, r"V >= 1, got shape \(4, 0\)"),
    (dict(target_shape=(5,)), ValueError, r"target shape \(5,\) must equal logits.shape\[:-1\] = \(4,\)"),
    (dict(label_smoothing=1.0), ValueError, r"label_smoothing must be in \[0, 1\), got 1.0"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a float"),
    (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
    (dict(ignore_index=-(2**63) - 1), ValueError, "ignore_index must fit in int64"),
    (dict(reduction="avg"), ValueError, "reduction 'avg'; accepted: none, sum, mean"),
    (dict(tp_group="world"), TypeError, "tp_group must be a ProcessGroup or None"),
]


@pytest.mark.parametrize("bad, exc, match", BAD)
def test_bad_input_names_the_argument(bad, exc, match):
    v = bad.get("v", 8)
    logits = bad.get("logits") or torch.randn(4, v).to(bad.get("logits_dtype", torch.float32))
    target = torch.zeros(bad.get("target_shape", (4,)), dtype=bad.get("target_dtype", torch.int64))
    kw = {k: bad[k] for k in ("label_smoothing", "ignore_index", "reduction", "tp_group") if k in bad}
    with pytest.raises(exc, match=match):
        cross_entropy(logits, target, **kw)


def test_target_on_another_device_is_rejected():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with pytest.raises(ValueError, match="target is on cpu but logits on cuda"):
        cross_entropy(torch.randn(2, 5, device="cuda"), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
# rows kept small: the float64 reference holds ~4 copies of the logits, and 8 xdist workers share one GPU
# (session 10: (2048, 102400) beside the RMSNorm training shapes ran the GPU out of memory)
@pytest.mark.parametrize("rows, v", [(1024, 32000), (512, 102400), (1000, 50257)])
def test_gpu_vocabulary_sizes(rows, v):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _check((rows, v), torch.bfloat16, torch.device("cuda"), scale=4.0)


def _compile_all() -> None:
    from primus_turbo.triton.loss import cross_entropy_kernel as ck

    for dtype in ("bf16", "fp32"):
        fwd = {
            "logits_ptr": f"*{dtype}", "target_ptr": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32",
            "rows": "i32", "V": "i32", "stride_row": "i64", "vocab_start": "i32", "vocab_total": "i32",
            "ignore_index": "i32", "smoothing": "fp32", "FINAL": "constexpr", "SMOOTH": "constexpr",
            "BLOCK": "constexpr",
        }  # fmt: skip
        for final in (True, False):
            compile_for_sm90(
                ck.cross_entropy_fwd_kernel, fwd, {"FINAL": final, "SMOOTH": True, "BLOCK": ck.BLOCK_V},
                num_warps=ck.NUM_WARPS,
            )  # fmt: skip
        bwd = {
            "logits_ptr": f"*{dtype}", "target_ptr": "*i64", "lse_ptr": "*fp32", "grad_loss_ptr": "*fp32",
            "grad_ptr": f"*{dtype}", "V": "i32", "stride_row": "i64", "grad_stride_row": "i64",
            "vocab_start": "i32", "vocab_total": "i32", "ignore_index": "i32", "smoothing": "fp32",
            "BLOCK": "constexpr",
        }  # fmt: skip
        compile_for_sm90(ck.cross_entropy_bwd_kernel, bwd, {"BLOCK": ck.BLOCK_V}, num_warps=ck.NUM_WARPS)


def test_cross_entropy_kernels_compile_sm90():
    run_compile_check("test_cross_entropy")


if __name__ == "__main__":
    _compile_all()
