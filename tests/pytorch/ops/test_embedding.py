"""turbo.ops.embedding: the lookup and torch's gradient without main_grad; with accumulate_into_main_grad the
weight gradient lands in an fp32 main_grad (float64 reference, repeated ids, ids seen by no token, two
micro-batches) with Megatron's placeholder in weight.grad; bitwise run-to-run determinism on GPU; bad input;
the sm_90 compile of the kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_utils import assert_close
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.ops.embedding import embedding


def _weight(v, h, dtype, device, main_grad=True):
    w = (torch.randn(v, h, device=device) * 0.5).to(dtype).requires_grad_(True)
    if main_grad:
        w.main_grad = torch.randn(v, h, device=device, dtype=torch.float32)  # a non-zero running sum
        w.grad_added_to_main_grad = False
    return w


def _ids(shape, v, device, dtype=torch.int64, repeat_heavy=False):
    ids = torch.randint(0, v, shape, device=device, dtype=dtype)
    if repeat_heavy:  # one id through half the tokens: a long run in the sorted order
        ids.view(-1)[::2] = 3
    return ids


@pytest.mark.parametrize("v, h", [(50, 64), (37, 300), (1000, 129)])  # odd H, H past one block
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("repeat_heavy", [False, True])
def test_main_grad_accumulation_matches_float64(v, h, dtype, repeat_heavy, device):
    w = _weight(v, h, dtype, device)
    start = w.main_grad.clone()
    expect = start.double()
    for _ in range(2):  # two micro-batches into one running sum
        ids = _ids((3, 17), v, device, repeat_heavy=repeat_heavy)
        out = embedding(ids, w, accumulate_into_main_grad=True)
        assert out.shape == (3, 17, h) and out.dtype == dtype
        assert torch.equal(out, F.embedding(ids, w.detach()))
        grad = torch.randn_like(out)
        out.backward(grad)
        expect.index_add_(0, ids.reshape(-1), grad.reshape(-1, h).double())
        assert w.grad_added_to_main_grad and w.grad is not None and w.grad.shape == w.shape
        w.grad = None
    assert_close(w.main_grad, expect.float(), torch.float32)
    untouched = (expect == start.double()).all(dim=1)  # rows no token used: kept bit for bit
    assert torch.equal(w.main_grad[untouched], start[untouched])


def test_without_main_grad_the_gradient_is_torchs(device):
    w = _weight(40, 24, torch.float32, device, main_grad=False)
    ids = _ids((5, 7), 40, device, dtype=torch.int32)
    out = embedding(ids, w)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_w = w.detach().clone().requires_grad_(True)
    F.embedding(ids, ref_w).backward(grad)
    assert torch.equal(out, F.embedding(ids, ref_w.detach()))
    assert_close(w.grad, ref_w.grad, torch.float32)


def test_no_ddp_attribute_means_no_placeholder(device):
    """main_grad without grad_added_to_main_grad (no Megatron DDP): the weight gets no gradient at all."""
    w = _weight(20, 16, torch.float32, device)
    del w.grad_added_to_main_grad
    before = w.main_grad.clone()
    ids = _ids((9,), 20, device)
    out = embedding(ids, w, accumulate_into_main_grad=True)
    out.backward(torch.ones_like(out))
    assert w.grad is None
    counts = torch.zeros_like(before).index_add_(0, ids, torch.ones(9, 16, device=device))
    assert_close(w.main_grad - before, counts, torch.float32)


BAD = [
    (lambda: embedding(torch.zeros(3), torch.randn(4, 2)), TypeError, "input must be an int32 or int64"),
    (lambda: embedding(torch.zeros(3, dtype=torch.long), torch.randn(4)), ValueError, "weight must be a 2-D"),
    (lambda: embedding(torch.zeros(3, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long)), ValueError,
     "floating-point"),
    (lambda: embedding(torch.zeros(3, dtype=torch.long), torch.randn(4, 2), accumulate_into_main_grad=True),
     ValueError, "needs weight.main_grad"),
]  # fmt: skip


@pytest.mark.parametrize("bad, exc, match", BAD)
def test_bad_input_names_the_argument(bad, exc, match):
    with pytest.raises(exc, match=match):
        bad()


@pytest.mark.parametrize("ids", [[0, 4, 1], [-1, 2], [3, 2**40]])
@pytest.mark.parametrize("accumulate", [False, True])
def test_out_of_range_ids_name_the_argument(ids, accumulate, device, monkeypatch):
    """CPU ids are checked on the host (free); CUDA ids only with PRIMUS_TURBO_DEBUG_CHECKS=1 (one sync),
    which names the range instead of torch's bare "index out of range in self" or a device-side assert."""
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    w = _weight(4, 3, torch.float32, device)
    ids = torch.tensor(ids, device=device)
    with pytest.raises(ValueError, match=r"input ids must be in \[0, 4\) \(weight.shape\[0\]\), got range"):
        embedding(ids, w, accumulate_into_main_grad=accumulate)


def test_integer_main_grad_is_rejected():
    w = torch.randn(4, 6, requires_grad=True)
    w.main_grad = torch.zeros(4, 6, dtype=torch.int64)  # would truncate every accumulated gradient
    with pytest.raises(TypeError, match="weight.main_grad must be floating-point, got torch.int64"):
        embedding(torch.zeros(2, dtype=torch.long), w, accumulate_into_main_grad=True)


def test_strided_main_grad_is_rejected():
    w = torch.randn(4, 6, requires_grad=True)
    w.main_grad = torch.zeros(6, 4).t()
    with pytest.raises(ValueError, match="unit stride along H"):
        embedding(torch.zeros(2, dtype=torch.long), w, accumulate_into_main_grad=True)


@pytest.mark.gpu
@pytest.mark.deterministic
def test_gpu_vocabulary_scale_is_bitwise_deterministic():
    """102400 x 2048 bf16 (deepseek_moe), 4096 tokens with a long run of one id: two runs from the same
    main_grad give identical bits, within fp32 tolerance of float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    v, h = 102400, 2048
    w = _weight(v, h, torch.bfloat16, torch.device("cuda"))
    ids = _ids((1, 4096), v, "cuda", repeat_heavy=True)
    grad = torch.randn(1, 4096, h, device="cuda", dtype=torch.bfloat16)
    start = w.main_grad.clone()
    results = []
    for _ in range(2):
        w.main_grad.copy_(start)
        embedding(ids, w, accumulate_into_main_grad=True).backward(grad)
        results.append(w.main_grad.clone())
    assert torch.equal(results[0], results[1])
    rows = torch.unique(ids)
    expect = start.double().index_add_(0, ids.reshape(-1), grad.reshape(-1, h).double())
    assert_close(results[0][rows], expect[rows].float(), torch.float32)


def _compile_all() -> None:
    from primus_turbo.triton.embedding import embedding_kernel as ek

    for dtype in ("bf16", "fp32"):
        sig = {
            "main_grad_ptr": "*fp32", "grad_ptr": f"*{dtype}", "sorted_ids_ptr": "*i64",
            "perm_ptr": "*i64", "num_tokens": "i32", "hidden": "i32", "stride_mg": "i64", "stride_g": "i64",
            "BLOCK_H": "constexpr",
        }  # fmt: skip
        compile_for_sm90(ek.embedding_accumulate_kernel, sig, {"BLOCK_H": ek.BLOCK_H}, num_warps=4)


def test_embedding_kernel_compiles_sm90():
    run_compile_check("test_embedding")


if __name__ == "__main__":
    _compile_all()
