"""The TMA grouped GEMM kernels on bf16 / fp16 operands: the forward with a K-contiguous B (the [G, N, K]
weight viewed transposed), the dgrad with an N-contiguous B (the weight itself), the variable-K over
row-major X / Y (bf16 out, and added into an fp32 buffer), against the fp64 reference. CPU: the Triton
interpreter; GPU: sm_90."""

from __future__ import annotations

import pytest
import torch
from ref.grouped_gemm_ref import grouped_gemm_ref, make_group_lens
from test_utils import assert_close

from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
    SCALE_NONE,
    SCALE_TENSORWISE,
    launch_grouped_gemm_variable_k,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_tma_kernel import (
    _b_layout,
    _b_layout_nmajor,
    launch_grouped_gemm_tma,
    launch_grouped_gemm_variable_k_tma,
    tma_forward_supported,
    tma_variable_k_supported,
)


@pytest.fixture
def dev(device):
    if device.type == "cuda" and not torch.cuda.get_device_capability(device) >= (9, 0):
        pytest.skip("TMA needs sm_90")
    return device


def _lens(m, g, kind, dev, tail=0):
    torch.manual_seed(11)
    lens = make_group_lens(m - tail, g, kind, "cpu")
    return lens.to(dev)


def _vk_ref(x, y, lens):
    out, start = [], 0
    for n in lens.tolist():
        out.append(x[start : start + n].double().cpu().t() @ y[start : start + n].double().cpu())
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
@pytest.mark.parametrize("layout", ["forward", "dgrad"])
def test_tma_half_forward_and_dgrad(dtype, kind, layout, dev):
    """forward: out = a @ w[g]^T (B K-contiguous); dgrad: out = dy @ w[g] (B N-contiguous, groups shifted
    by rows; the reduction 128 is a multiple of the GPU tile's BLOCK_K 64). 200 rows: partial row tiles
    at every group edge; 8 rows past sum(group_lens) must come back as zeros."""
    g, m, n, k = 4, 200, 128, 80
    torch.manual_seed(0)
    w = (torch.randn(g, n, k, device=dev) / k**0.5).to(dtype)
    if layout == "forward":
        a, b_view, trans_b = torch.randn(m, k, device=dev).to(dtype), w.transpose(1, 2), True
    else:
        a, b_view, trans_b = torch.randn(m, n, device=dev).to(dtype), w, False
    lens = _lens(m, g, kind, dev, tail=8)
    assert tma_forward_supported(a, b_view, SCALE_NONE, interpret=True)
    out = torch.full((m, b_view.shape[2]), 7.0, dtype=dtype, device=dev)
    launch_grouped_gemm_tma(a, b_view, out, lens)
    covered = int(lens.sum())
    ref = grouped_gemm_ref(a[:covered], w, lens.cpu(), trans_b)
    assert_close(out[:covered].double().cpu(), ref, dtype, msg=f"{layout} {kind} {dtype}")
    assert torch.count_nonzero(out[covered:]) == 0, "rows past sum(group_lens) are not zeros"


def test_tma_half_partial_tiles_and_pointer_stores(dev):
    """N = 40 and K = 24 (not tile multiples): the descriptor zero-fills K's tail and clips N's; a 16-bit
    row of 40 elements is 80 bytes, so the output's TMA store works; pointer stores give the same."""
    g, m, n, k = 3, 150, 40, 24
    torch.manual_seed(1)
    a = torch.randn(m, k, device=dev).to(torch.bfloat16)
    w = torch.randn(g, n, k, device=dev).to(torch.bfloat16)
    lens = _lens(m, g, "skewed", dev)
    outs = []
    for store in (True, False):
        out = torch.full((m, n), 7.0, dtype=torch.bfloat16, device=dev)
        outs.append(launch_grouped_gemm_tma(a, w.transpose(1, 2), out, lens, config={"TMA_STORE": store}))
    ref = grouped_gemm_ref(a, w, lens.cpu(), True)
    assert_close(outs[0].double().cpu(), ref, torch.bfloat16, msg="TMA store")
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kind", ["balanced", "skewed", "empty"])
def test_tma_half_variable_k(kind, dev):
    """dW[g] = dy[rows_g]^T @ a[rows_g] over row-major operands (token axis strided), groups of any
    length (partial token tiles at both edges): bf16 out, empty groups exact zeros."""
    g, m, p, q = 4, 232, 48, 80
    torch.manual_seed(2)
    x = torch.randn(m, p, device=dev).to(torch.bfloat16)
    y = torch.randn(m, q, device=dev).to(torch.bfloat16)
    lens = _lens(m, g, kind, dev)
    assert tma_variable_k_supported(x, y, interpret=True)
    out = torch.full((g, p, q), 7.0, dtype=torch.bfloat16, device=dev)
    launch_grouped_gemm_variable_k_tma(x, y, out, lens)
    ref = _vk_ref(x, y, lens)
    for e in range(g):
        scale = ref[e].abs().max().clamp_min(1.0)
        assert_close(out[e].double().cpu() / scale, ref[e] / scale, torch.bfloat16, msg=f"expert {e} {kind}")
    for e in torch.nonzero(lens == 0).flatten().tolist():
        assert torch.count_nonzero(out[e]) == 0, f"empty expert {e} is not exactly zero"


def test_tma_half_variable_k_accumulates_into_fp32(dev):
    """accumulate=2: the fp32 buffer is the accumulator's start (Megatron's main_grad); an empty group's
    slice is left exactly as it was. Scales with accumulate are refused."""
    g, m, p, q = 3, 170, 32, 64
    torch.manual_seed(3)
    x = torch.randn(m, p, device=dev).to(torch.bfloat16)
    y = torch.randn(m, q, device=dev).to(torch.bfloat16)
    lens = torch.tensor([100, 0, 70], device=dev)
    start = torch.randn(g, p, q, device=dev)
    out = start.clone()
    launch_grouped_gemm_variable_k_tma(x, y, out, lens, accumulate=2)
    ref = start.double().cpu() + _vk_ref(x, y, lens)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-4, atol=1e-3)
    assert torch.equal(out[1], start[1])
    ones = torch.ones(g, device=dev)
    with pytest.raises(ValueError, match="accumulate"):
        launch_grouped_gemm_variable_k_tma(x, y, out, lens, ones, ones, SCALE_TENSORWISE, accumulate=2)
    with pytest.raises(ValueError, match="accumulate"):
        launch_grouped_gemm_variable_k_tma(x, y, out, lens, accumulate=1)


@pytest.mark.parametrize("launcher", ["pointer", "tma"])
@pytest.mark.parametrize("accumulate", [0, 2])
def test_variable_k_reverse_groups_into_a_padded_block(launcher, accumulate, dev):
    """reverse_groups: group g lands in out[G-1-g] of a strided block (Megatron's reverse-ordered main_grads),
    written or added (empty group: zeros / untouched); the padding between the slices is never written."""
    g, m, p, q, pad = 3, 170, 32, 64, 24
    torch.manual_seed(5)
    x = torch.randn(m, p, device=dev).to(torch.bfloat16)
    y = torch.randn(m, q, device=dev).to(torch.bfloat16)
    lens = torch.tensor([100, 0, 70], device=dev)
    flat = torch.randn(g * (p * q + pad), device=dev)
    before = flat.clone()
    out = flat.as_strided((g, p, q), (p * q + pad, q, 1))
    start = out.clone()
    launch = launch_grouped_gemm_variable_k if launcher == "pointer" else launch_grouped_gemm_variable_k_tma
    launch(x, y, out, lens, accumulate=accumulate, reverse_groups=True)
    ref = _vk_ref(x, y, lens).flip(0) + (start.double().cpu() if accumulate else 0)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=1e-4, atol=1e-3)
    assert torch.equal(out[1], start[1]) if accumulate else torch.count_nonzero(out[1]) == 0
    mask = torch.ones_like(flat, dtype=torch.bool)
    for e in range(g):
        mask[e * (p * q + pad) : e * (p * q + pad) + p * q] = False
    assert torch.equal(flat[mask], before[mask]), "reverse_groups wrote into the padding"
    if launcher == "tma":
        with pytest.raises(ValueError, match="reverse_groups"):
            launch(x, y, out, lens, accumulate=accumulate, reverse_groups=True, config={"TMA_STORE": True})


def test_tma_half_eligibility(device):
    """Layouts a TMA box cannot read correctly stay on the pointer kernel."""
    w = torch.randn(2, 80, 96, device=device).to(torch.bfloat16)  # [G, N=80, K=96]
    a = torch.randn(64, 80, device=device).to(torch.bfloat16)
    # dgrad view with a reduction of 80: a 32- or 64-row K step would read the next expert's rows
    assert _b_layout_nmajor(w, 64) is None and _b_layout_nmajor(w, 16) is not None
    assert not tma_forward_supported(a, w, SCALE_NONE, interpret=True)
    assert _b_layout_nmajor(w[:1], 64) is not None  # one expert: the descriptor's zero fill ends it
    assert tma_forward_supported(a, w[:1], SCALE_NONE, interpret=True)
    assert _b_layout(w, 64) is None  # N-contiguous is not K-major
    assert not tma_forward_supported(a, w[:1], SCALE_TENSORWISE, interpret=True)  # scales: FP8 only
    assert not tma_forward_supported(a.half(), w[:1], SCALE_NONE, interpret=True)  # mixed dtypes
    a76 = torch.randn(64, 76, device=device).to(torch.bfloat16)  # rows 152 bytes apart
    assert not tma_forward_supported(a76, w[:1, :76], SCALE_NONE, interpret=True)
    assert tma_forward_supported(a[:, :76], w[:1, :76], SCALE_NONE, interpret=True)  # a view: 160 B rows
    assert not tma_forward_supported(a.float(), w[:1].float(), SCALE_NONE, interpret=True)
    x = torch.randn(64, 20, device=device).to(torch.bfloat16)  # 40-byte rows: not 16-byte aligned
    assert not tma_variable_k_supported(x, a, interpret=True)
    assert not tma_variable_k_supported(a, a.half(), interpret=True)
    with pytest.raises(ValueError, match="does not take"):
        launch_grouped_gemm_variable_k_tma(x, a, torch.empty(1, 20, 80), torch.tensor([64]))


def test_triton_backends_route_16_bit_operands_to_the_tma_kernels(dev, monkeypatch):
    """The op with the TRITON backend pinned (forward, dgrad, wgrad) and the wgrad added into a strided fp32
    buffer (w1's half of a fused [G, 2P, Q] gradient, as Megatron's main_grad) run the TMA launchers where
    the operands allow them: on CPU the eligibility checks are pointed at the interpreter."""
    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.kernels.grouped_gemm import grouped_gemm_impl as impl
    from primus_turbo.triton.grouped_gemm import grouped_gemm_tma_kernel as tmod

    calls = []

    def spy(name, fn):
        return lambda *a, **k: (calls.append(name), fn(*a, **k))[1]

    monkeypatch.setattr(impl, "tma_forward_supported", lambda a, b, m: tma_forward_supported(a, b, m, True))
    monkeypatch.setattr(impl, "tma_variable_k_supported", lambda x, y: tma_variable_k_supported(x, y, True))
    monkeypatch.setattr(impl, "launch_grouped_gemm_tma", spy("fwd", tmod.launch_grouped_gemm_tma))
    monkeypatch.setattr(
        impl, "launch_grouped_gemm_variable_k_tma", spy("vk", tmod.launch_grouped_gemm_variable_k_tma)
    )
    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    GlobalBackendManager.set_grouped_wgrad_accumulate_backend("TRITON")
    g, m, n, k = 4, 160, 128, 64
    torch.manual_seed(5)
    a = torch.randn(m, k, device=dev).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(g, n, k, device=dev) / k**0.5).to(torch.bfloat16).requires_grad_()
    lens = _lens(m, g, "skewed", dev)
    dy = torch.randn(m, n, device=dev).to(torch.bfloat16)
    out = turbo.ops.grouped_gemm(a, w, lens, trans_b=True)
    out.backward(dy)
    assert calls == ["fwd", "fwd", "vk"], calls  # forward, dgrad (N-contiguous weight), wgrad
    assert_close(out.double().cpu(), grouped_gemm_ref(a, w, lens.cpu(), True), torch.bfloat16, msg="out")
    ref_dw = _vk_ref(dy, a.detach(), lens)
    assert_close(
        w.grad.double().cpu() / ref_dw.abs().max(), ref_dw / ref_dw.abs().max(), torch.bfloat16, msg="dw"
    )
    buffer = torch.randn(g, 2 * n, k, device=dev)
    before = buffer.clone()
    impl.grouped_gemm_variable_k_into_(dy, a.detach(), lens, buffer[:, :n], True)
    assert calls[-1] == "vk"
    torch.testing.assert_close(
        buffer[:, :n].double().cpu(), before[:, :n].double().cpu() + ref_dw, rtol=1e-4, atol=1e-3
    )
    assert torch.equal(buffer[:, n:], before[:, n:])


# -- sm_90 compilation of the default tiles (the interpreter sees no shared-memory overflow) -------------
def _compile_all():
    from triton_compile_utils import compile_for_sm90

    from primus_turbo.triton.grouped_gemm import grouped_gemm_tma_kernel as tmod

    def sig_of(names, typed):
        return {n: typed.get(n, "i32") for n in names}

    for kmajor in (True, False):
        cfg = dict(tmod.HALF_FWD_TILE)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        typed = {
            "a_desc": f"tensordesc<bf16[{bm},{bk}]>",
            "b_desc": f"tensordesc<bf16[{bn},{bk}]>" if kmajor else f"tensordesc<bf16[{bk},{bn}]>",
            "c_ptr": "*bf16", "c_desc": f"tensordesc<bf16[{bm},{bn}]>", "group_lens_ptr": "*i64",
            "a_scale_ptr": "*bf16", "b_scale_ptr": "*bf16",
        }  # fmt: skip
        consts = dict(
            NUM_PROGS=132, BLOCK_G=64, GROUP_M=8, SCALE_MODE=0, UPCAST=False, B_KMAJOR=kmajor, **cfg
        )
        names = list(tmod.grouped_gemm_tma_kernel.arg_names)
        sig = {**sig_of(names, typed), **{k: "constexpr" for k in consts}}
        compile_for_sm90(tmod.grouped_gemm_tma_kernel, sig, consts, num_warps=warps, num_stages=stages)
    for tile, out_dtype, accumulate in (
        (tmod.HALF_VK_TILE, "bf16", 0),
        (tmod.HALF_VK_TILE, "fp32", 2),
        (tmod.HALF_VK_TILE_SMALL, "fp32", 2),
    ):
        cfg = dict(tile)
        cfg.pop("PROGS_PER_SM", None)
        # the launcher's rule: the tile's TMA store where its staging fits beside the operand stages
        cfg["TMA_STORE"] = cfg["TMA_STORE"] and tmod._vk_store_fits(cfg, 2, 4 if out_dtype == "fp32" else 2)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        bp, bq, bk = cfg["BLOCK_P"], cfg["BLOCK_Q"], cfg["BLOCK_K"]
        typed = {
            "x_desc": f"tensordesc<bf16[{bk},{bp}]>", "y_desc": f"tensordesc<bf16[{bk},{bq}]>",
            "x_ptr": "*bf16", "y_ptr": "*bf16", "c_ptr": f"*{out_dtype}",
            "c_desc": f"tensordesc<{out_dtype}[1,{bp},{bq}]>", "group_lens_ptr": "*i64",
            "x_scale_ptr": f"*{out_dtype}", "y_scale_ptr": f"*{out_dtype}",
        }  # fmt: skip
        consts = dict(
            NUM_PROGS=132, BLOCK_G=64, SCALE_MODE=0, UPCAST=False, TOKENS_CONTIGUOUS=False,
            ACCUMULATE=accumulate, **cfg,
        )  # fmt: skip
        names = list(tmod.grouped_gemm_variable_k_tma_kernel.arg_names)
        sig = {**sig_of(names, typed), **{k: "constexpr" for k in consts}}
        compile_for_sm90(
            tmod.grouped_gemm_variable_k_tma_kernel, sig, consts, num_warps=warps, num_stages=stages
        )


def test_default_tiles_compile_for_sm90():
    from triton_compile_utils import run_compile_check

    run_compile_check("test_grouped_gemm_half_tma")


if __name__ == "__main__":
    _compile_all()
    print("sm_90 compile OK")
