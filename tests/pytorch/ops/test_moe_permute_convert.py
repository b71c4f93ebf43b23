"""token_permute / token_unpermute with ``out_dtype``: the element type changes inside the permute (fp32
tokens into bf16/fp16 rows) and the unpermute (bf16/fp16 rows summed into fp32 tokens), forward and backward.

The converting ops must give bitwise what the two-pass composition they replace gives (a permute in fp32
then ``.to(bf16)``; ``.float()`` then an fp32 unpermute), gradients included: TorchTitan's fp32 residual
stream under autocast takes this path (``TurboMoE``), and its numerics must not move. Each backend is
also checked on its own (TORCH, TRITON; TURBO, the CUDA C++ twin, on a GPU).
"""

import pytest
import torch
from test_utils import assert_close

from primus_turbo.pytorch.kernels.moe.permute_impl import (
    PermuteTorch,
    PermuteTriton,
    PermuteTurbo,
    build_row_id_map,
)
from primus_turbo.pytorch.ops.moe.permute import token_permute, token_unpermute

HALVES = [torch.bfloat16, torch.float16]


def _routing(t, e, k, device, drop_frac):
    indices = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
    indices = indices.masked_fill(torch.rand(t, k, device=device) < drop_frac, -1)
    return indices, torch.rand(t, k, device=device)


def _grads(outputs, inputs, grads):
    return torch.autograd.grad(outputs, inputs, grads)


@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("drop_frac", [0.0, 0.3])
def test_converting_permute_equals_permute_then_cast(half, drop_frac, device):
    t, e, k, h = 37, 8, 3, 48
    indices, probs = _routing(t, e, k, device, drop_frac)
    x = torch.randn(t, h, device=device, requires_grad=True)
    out, out_probs, row_id_map, tpe = token_permute(x, indices, probs, num_experts=e, out_dtype=half)
    ref, ref_probs, ref_map, ref_tpe = token_permute(x, indices, probs, num_experts=e)
    ref = ref.to(half)
    assert out.dtype == half and out_probs.dtype == probs.dtype
    n = int(tpe.sum())
    assert torch.equal(out[:n], ref[:n]) and torch.equal(out_probs[:n], ref_probs[:n])
    assert torch.equal(row_id_map, ref_map) and torch.equal(tpe, ref_tpe)
    assert out[:n].float().abs().sum() > 0

    g = torch.randn(out.shape, device=device).to(half)
    (gx,) = _grads(out, x, g)
    (gx_ref,) = _grads(ref, x, g)
    assert gx.dtype == torch.float32
    assert torch.equal(gx, gx_ref), "the tokens' gradient is the fp32 sum of the rows' gradients"
    assert gx.abs().sum() > 0


@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("merging", [False, True], ids=["plain", "probs"])
def test_converting_unpermute_equals_upcast_then_unpermute(half, merging, device):
    t, e, k, h = 37, 8, 3, 48
    indices, probs = _routing(t, e, k, device, 0.2)
    _, _, row_id_map, tpe = token_permute(torch.randn(t, h, device=device), indices, num_experts=e)
    y = torch.randn(t * k, h, device=device).to(half).requires_grad_(True)
    p = probs.clone().requires_grad_(True) if merging else None
    out = token_unpermute(y, row_id_map, p, out_dtype=torch.float32)
    ref = token_unpermute(y.float(), row_id_map, p)
    assert out.dtype == torch.float32
    assert torch.equal(out, ref)
    assert out.abs().sum() > 0

    g = torch.randn_like(out)
    inputs = (y, p) if merging else (y,)
    got, want = _grads(out, inputs, g), _grads(ref, inputs, g)
    assert got[0].dtype == half
    n = int(tpe.sum())
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[:n] if a.dim() == 2 else a, b[:n] if b.dim() == 2 else b)
    assert got[0][:n].float().abs().sum() > 0


def test_converting_unpermute_matches_an_fp64_reference(device):
    """Against fp64: bf16 rows weighted and summed in fp32 land within fp32 rounding of the exact sum."""
    t, e, k, h = 64, 16, 4, 96
    indices, probs = _routing(t, e, k, device, 0.1)
    _, _, row_id_map, _ = token_permute(torch.randn(t, h, device=device), indices, num_experts=e)
    y = torch.randn(t * k, h, device=device).to(torch.bfloat16)
    out = token_unpermute(y, row_id_map, probs, out_dtype=torch.float32)
    sel = (row_id_map >= 0).unsqueeze(-1).double()
    want = (y.double()[row_id_map.clamp(min=0).long()] * sel * probs.double().unsqueeze(-1)).sum(1)
    assert_close(out, want, torch.float32)


@pytest.mark.parametrize("impl", [PermuteTorch, PermuteTriton], ids=["torch", "triton"])
@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
def test_backends_convert_both_ways(impl, half, device):
    if not impl.can_handle(kind="permute", x=torch.empty(1, device=device), row_id_map=None):
        pytest.skip(f"{impl.__name__} cannot run on {device}")
    _check_backend(impl, half, device, t=41, h=56)


def _check_backend(impl, half, device, t, h, e=16, k=4):
    indices, probs = _routing(t, e, k, device, 0.1)
    row_id_map, _, num_rows = build_row_id_map(indices, e, None, 0, None)
    x = torch.randn(t, h, device=device)
    kw = dict(kind="permute", x=x, row_id_map=row_id_map, probs=probs, num_rows=num_rows, zero_fill=True)
    want, want_probs = PermuteTorch.execute(**kw)
    out, out_probs = impl.execute(**kw, out_dtype=half)
    assert out.dtype == half
    assert torch.equal(out, want.to(half)) and torch.equal(out_probs, want_probs)
    y = torch.randn(num_rows, h, device=device).to(half)
    ukw = dict(kind="unpermute", y=y, row_id_map=row_id_map, probs=probs, num_tokens=t)
    got = impl.execute(**ukw, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert_close(got, PermuteTorch.execute(**{**ukw, "y": y.double()}), torch.float32)
    back = impl.execute(**{**ukw, "y": got.repeat(k, 1)[:num_rows]}, out_dtype=half)  # fp32 -> 16-bit sums
    assert back.dtype == half


@pytest.mark.gpu
@pytest.mark.parametrize("half", HALVES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("h", [2048, 7168, 1030])  # 1030: not a multiple of 4, the scalar kernels
def test_turbo_csrc_converts_both_ways(half, h, device):
    x = torch.empty(1, h, device=device)
    if not PermuteTurbo.can_handle(kind="permute", x=x, row_id_map=torch.zeros(1, 1, dtype=torch.int32,
                                   device=device), probs=None, out_dtype=half):  # fmt: skip
        pytest.skip("csrc extension not built (or built before out_dtype)")
    _check_backend(PermuteTurbo, half, device, t=1024, h=h, e=64, k=6)


@pytest.mark.parametrize("bad", [torch.int32, torch.float8_e4m3fn, torch.float16])
def test_bad_out_dtype_names_the_argument(bad, device):
    t, e, k, h = 8, 4, 2, 16
    indices, _ = _routing(t, e, k, device, 0.0)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)  # bf16 -> fp16: not a supported conversion
    with pytest.raises(TypeError, match="token_permute: out_dtype"):
        token_permute(x, indices, num_experts=e, out_dtype=bad)
    _, _, row_id_map, _ = token_permute(x, indices, num_experts=e)
    with pytest.raises(TypeError, match="token_unpermute: out_dtype"):
        token_unpermute(torch.randn(t * k, h, device=device, dtype=torch.bfloat16), row_id_map, out_dtype=bad)


@pytest.mark.parametrize(
    "pad_multiple,capacity,zero_fill", [(16, None, False), (0, 5, False), (0, None, True)],
    ids=["padded", "capacity", "zero_fill_tail"],
)  # fmt: skip
def test_converting_permute_keeps_padding_and_tail_rows_zero(pad_multiple, capacity, zero_fill, device):
    """Padding / capacity / upper-bound tail rows of a converting permute are zeros of the output dtype, and
    the rows the map names hold the cast tokens, as with the same-dtype op."""
    t, e, k, h = 29, 8, 3, 24
    indices, probs = _routing(t, e, k, device, 0.3)
    x = torch.randn(t, h, device=device, requires_grad=True)
    kw = dict(num_experts=e, pad_multiple=pad_multiple, capacity=capacity, zero_fill=zero_fill)
    out, out_probs, row_id_map, _ = token_permute(x, indices, probs, out_dtype=torch.bfloat16, **kw)
    ref, ref_probs, ref_map, _ = token_permute(x, indices, probs, **kw)
    assert out.dtype == torch.bfloat16 and torch.equal(row_id_map, ref_map)
    assert torch.equal(out, ref.to(torch.bfloat16)) and torch.equal(out_probs, ref_probs)
    named = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    named[row_id_map[row_id_map >= 0].long()] = True
    assert (out[~named] == 0).all() and (out[named].float().abs().sum(-1) > 0).all()
    (gx,) = torch.autograd.grad(out, x, torch.ones_like(out))
    (gref,) = torch.autograd.grad(ref, x, torch.ones_like(ref))
    assert gx.dtype == torch.float32 and torch.equal(gx, gref)  # each kept route contributes 1 per element
