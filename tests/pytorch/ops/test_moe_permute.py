import pytest
import torch
from ref.moe_ref import indices_to_map, permute_ref, unpermute_ref
from test_utils import assert_close, assert_snr, fp8_snr_gate
from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.core.low_precision import Format
from primus_turbo.pytorch.kernels.moe.permute_impl import unpermute_bwd_probs_config
from primus_turbo.pytorch.ops.moe.permute import token_permute, token_permute_fp8, token_unpermute
from primus_turbo.triton.memory.zero_rows_kernel import zero_rows_from_kernel
from primus_turbo.triton.moe import permute_kernel as pk


def _routing(t, e, k, device, drop_frac=0.0):
    indices = torch.stack([torch.randperm(e, device=device)[:k] for _ in range(t)])
    if drop_frac:
        indices = indices.masked_fill(torch.rand(t, k, device=device) < drop_frac, -1)
    probs = torch.rand(t, k, device=device)
    return indices, probs


@pytest.mark.parametrize("form", ["indices", "map"])
@pytest.mark.parametrize("pad_multiple,capacity", [(0, None), (16, None), (0, 3)])
@pytest.mark.parametrize("drop_frac", [0.0, 0.3])
def test_permute_unpermute(form, pad_multiple, capacity, drop_frac, device):
    t, e, k, h = 29, 8, 3, 40
    indices, probs = _routing(t, e, k, device, drop_frac)
    rmap, dense = indices_to_map(indices, e, probs)
    x = torch.randn(t, h, device=device, requires_grad=True)
    if form == "indices":
        routing, p = indices, probs.clone().requires_grad_(True)
    else:
        routing, p = rmap, dense.float().requires_grad_(True)
    out, out_probs, row_id_map, tpe = token_permute(
        x, routing, p, pad_multiple=pad_multiple, num_experts=e, capacity=capacity
    )
    ref, ref_probs, ref_tpe, src = permute_ref(x.detach(), rmap, dense, pad_multiple, capacity)
    assert torch.equal(tpe.cpu().long(), ref_tpe)
    n = ref.shape[0]
    assert out.shape[0] >= n
    assert torch.equal(out[:n].double().cpu(), ref), "permute must be an exact copy"
    if pad_multiple or capacity:
        assert (out[n:] == 0).all(), "padding rows must be zero"
    assert torch.equal(out_probs[:n].double().cpu(), ref_probs)

    # Round trip: unpermute(permute(x)) == x * (number of kept routes of each token).
    back = token_unpermute(out, row_id_map)
    kept = unpermute_ref(torch.ones(n, 1), src, t).squeeze(-1)
    assert_close(back, x.detach().double().cpu() * kept.unsqueeze(-1), torch.float32)

    # Backward through permute (tokens and carried probs).
    g_out, g_probs = torch.randn_like(out), torch.randn_like(out_probs)
    torch.autograd.backward([out, out_probs], [g_out, g_probs])
    assert_close(x.grad, unpermute_ref(g_out[:n], src, t), torch.float32)
    ref_gp = torch.zeros_like(p, dtype=torch.float64).cpu()
    sel = row_id_map >= 0
    ref_gp[sel.cpu()] = g_probs.double().cpu()[row_id_map[sel].long().cpu()]
    assert_close(p.grad, ref_gp, torch.float32)


def test_zero_fill_zeroes_the_rows_after_the_last_group(device):
    """Indices with -1 routes give an upper-bound buffer; zero_fill=True makes its tail rows (and probs) zero,
    so a grouped GEMM may take them into the last group (TorchTitan's TurboEPMoE does)."""
    t, e, k, h = 29, 8, 3, 40
    indices, probs = _routing(t, e, k, device, drop_frac=0.4)
    junk = torch.full((t * k, h), float("nan"), device=device)  # freed memory the output may reuse
    del junk
    out, out_probs, _, tpe = token_permute(torch.randn(t, h, device=device), indices, probs, num_experts=e,
                                           zero_fill=True)  # fmt: skip
    n = int(tpe.sum())
    assert out.shape[0] == t * k > n
    assert (out[n:] == 0).all() and (out_probs[n:] == 0).all()


@pytest.mark.parametrize(
    "pad_multiple,capacity,drop_frac", [(16, None, 0.3), (0, 16, 0.0), (0, 9, 0.2), (0, None, 0.4)]
)
@pytest.mark.parametrize("merging", [False, True])
def test_rows_outside_the_map_are_zero_in_outputs_and_gradients(
    pad_multiple, capacity, drop_frac, merging, device
):
    """Padding, dropped and tail rows are zeroed by flag (zero_rows_outside_map, the unpermute-with-probs
    backward's covered flags) instead of a zero-filled allocation: they must be zero even where the buffer
    reuses freed NaN memory, and the rows the map names must hold the exact values."""
    t, e, k, h = 29, 8, 3, 40
    indices, probs = _routing(t, e, k, device, drop_frac)
    x = torch.randn(t, h, device=device)

    def poison(rows):  # freed NaN blocks of the buffers' sizes for the allocator to hand out next
        junk = [torch.full((rows, h), float("nan"), device=device) for _ in range(3)]
        junk += [torch.full((rows,), float("nan"), device=device)]
        del junk

    poison(t * k + e * max(pad_multiple, 1) + e * (capacity or 0))
    out, out_probs, rid, _ = token_permute(
        x, indices, probs, num_experts=e, pad_multiple=pad_multiple, capacity=capacity, zero_fill=True
    )
    named = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    named[rid[rid >= 0].long()] = True
    assert (~named).any(), "the case must leave rows outside the map"
    assert (out[~named] == 0).all() and (out_probs[~named] == 0).all()
    y = (out.detach() * 1.5 + 0.25).requires_grad_(True)  # "expert output": nonzero everywhere
    w = probs.clone().requires_grad_(True) if merging else None
    res = token_unpermute(y, rid, w)
    g = torch.randn_like(res)
    poison(y.shape[0])
    res.backward(g)
    assert (y.grad[~named] == 0).all(), "rows outside the map get a zero gradient"
    sel = rid >= 0
    tok = torch.arange(t, device=device).unsqueeze(1).expand_as(rid)[sel]
    want = g[tok] * (probs[sel].unsqueeze(-1) if merging else 1.0)
    assert_close(y.grad[rid[sel].long()], want.double().cpu(), torch.float32)
    if merging:
        ref_gw = torch.zeros(probs.shape, dtype=torch.float64, device=device)
        ref_gw[sel] = (g[tok].double() * y.detach()[rid[sel].long()].double()).sum(-1)
        assert_close(w.grad, ref_gw.cpu(), torch.float32)


@pytest.mark.parametrize(
    "n,h,start", [(37, 40, 11), (37, 40, 0), (37, 40, 37), (37, 40, 99), (300, 1100, 129)]
)
def test_zero_rows_from_zeroes_only_the_tail(n, h, start, device):
    """The dense-groups zero_fill path: only rows [start, N) are written (start read on the device)."""
    from primus_turbo.pytorch.core.utils import zero_rows_from

    out = torch.randn(n, h, device=device).to(torch.bfloat16)
    probs = torch.rand(n, device=device) + 0.5
    want_out, want_probs = out.clone(), probs.clone()
    want_out[start:] = 0
    want_probs[start:] = 0
    zero_rows_from(out, probs, torch.tensor(start, device=device))
    assert torch.equal(out, want_out) and torch.equal(probs, want_probs)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["indices", "map"])
def test_permute_unpermute_fwd_bwd_with_probs_has_no_host_sync(form, device):
    # A host sync per MoE layer drains the GPU queue every micro-batch: forward and backward must have none
    # (a CPU zero-dim tensor in the probs backward was one: its copy to the GPU blocks).
    t, e, k, h = 512, 16, 4, 256
    indices, probs = _routing(t, e, k, device, drop_frac=0.0)
    routing, probs_in = (indices, probs) if form == "indices" else indices_to_map(indices, e, probs)
    tokens = torch.randn(t, h, device=device, requires_grad=True)
    probs_in = probs_in.clone().requires_grad_(True)
    kwargs = {"num_experts": e} if form == "indices" else {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, out_probs, row_id_map, _ = token_permute(tokens, routing, probs_in, t * k, **kwargs)
        y = token_unpermute(out * out_probs[:, None], row_id_map, num_tokens=t)
        y.backward(torch.randn_like(y))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert tokens.grad is not None and probs_in.grad is not None and torch.isfinite(probs_in.grad).all()


@pytest.mark.parametrize("form", ["indices", "map"])
def test_unpermute_with_merging_probs(form, device):
    t, e, k, h = 31, 6, 2, 24
    indices, probs = _routing(t, e, k, device)
    rmap, dense = indices_to_map(indices, e, probs)
    routing, p = (indices, probs) if form == "indices" else (rmap, dense.float())
    x = torch.randn(t, h, device=device)
    y, _, row_id_map, _ = token_permute(x, routing, num_experts=e, num_out_tokens=t * k)
    y = (y * 1.5).requires_grad_(True)  # "expert output"
    w = p.clone().requires_grad_(True)
    out = token_unpermute(y, row_id_map, w)
    _, ref_probs, _, src = permute_ref(x, rmap, dense)
    yr = y.detach().double().cpu().requires_grad_(True)
    ref_probs = ref_probs.clone().requires_grad_(True)
    ref = unpermute_ref(yr, src, t, ref_probs)
    assert_close(out, ref, torch.float32)
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double().cpu())
    assert_close(y.grad, yr.grad, torch.float32)
    # probs grad: ref_probs is in permuted order; map it back through row_id_map.
    sel = row_id_map >= 0
    ref_gw = torch.zeros(w.shape, dtype=torch.float64)
    ref_gw[sel.cpu()] = ref_probs.grad[row_id_map[sel].long().cpu()]
    assert_close(w.grad, ref_gw, torch.float32)


def test_permute_fp8_rowwise(device):
    t, e, k, h = 19, 4, 2, 64
    indices, _ = _routing(t, e, k, device)
    x = torch.randn(t, h, device=device) * 3
    q, scales, row_id_map, tpe = token_permute_fp8(x, indices, num_experts=e, pad_multiple=16)
    ref, _, ref_tpe, src = permute_ref(x, indices_to_map(indices, e)[0], pad_multiple=16)
    assert torch.equal(tpe.cpu().long(), ref_tpe)
    deq = q.float() * scales.unsqueeze(-1)
    n = ref.shape[0]
    assert (deq[n:] == 0).all()
    ok = src >= 0
    amax = ref[ok].abs().amax(-1)
    assert torch.allclose(scales[:n].double().cpu()[ok], amax / 448.0, rtol=1e-6), (
        "row scale must be amax / 448"
    )
    err = (deq[:n].double().cpu() - ref).abs()
    # Within one E4M3 step (2^-3 relative, or one subnormal step 2^-9 in FP8 units near zero). The
    # Triton 3.7 interpreter's fp32->fp8 cast drops the exponent carry when the mantissa rounds up
    # (e.g. 127.9 -> 64 instead of 128), so on CPU a few elements may miss; the GPU must be exact.
    step = scales[:n].double().cpu().unsqueeze(-1) * 2.0**-9
    within = err <= ref.abs() * 0.125 + step * 1.01
    if device.type == "cuda":
        assert within.all()
    else:
        assert within.float().mean() > 0.97, f"{(~within).sum()} of {within.numel()} elements off by > 1 step"
    if device.type == "cuda":
        assert_snr(deq[:n].cpu()[ok], ref[ok], fp8_snr_gate(Format.E4M3), "fp8 permute")


def test_out_of_range_indices_are_dropped_without_debug_checks(device, monkeypatch):
    monkeypatch.delenv("PRIMUS_TURBO_DEBUG_CHECKS", raising=False)
    x = torch.randn(4, 16, device=device)
    idx = torch.tensor([[0, 7], [1, 2], [-5, 3], [3, 0]], device=device)
    if device.type == "cpu":  # the check is free on CPU: it always raises there
        with pytest.raises(ValueError, match="indices must be in"):
            token_permute(x, idx, num_experts=4)
        return
    out, _, _, tpe = token_permute(x, idx, num_experts=4)
    assert tpe.tolist() == [2, 1, 1, 2]  # the 7 and the -5 routes are dropped
    assert out.shape[0] >= 6


def test_permute_empty_and_bad_input(device, monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "1")
    x = torch.randn(0, 16, device=device, requires_grad=True)
    idx = torch.zeros(0, 2, dtype=torch.int64, device=device)
    out, _, row_id_map, tpe = token_permute(x, idx, num_experts=4)
    assert out.shape == (0, 16) and tpe.shape == (4,)
    assert token_unpermute(out, row_id_map).shape == (0, 16)

    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="indices must be in"):
        token_permute(x, torch.full((4, 2), 5, device=device), num_experts=4)
    with pytest.raises(ValueError, match="probs shape"):
        token_permute(x, torch.zeros(4, 2, dtype=torch.long, device=device), torch.rand(4, 3), num_experts=4)
    with pytest.raises(ValueError, match="num_experts"):
        token_permute(x, torch.zeros(4, 2, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="T = 4"):
        token_permute(x, torch.zeros(5, 2, dtype=torch.long, device=device), num_experts=4)
    with pytest.raises(TypeError, match="routing dtype"):
        token_permute(x, torch.zeros(4, 2, device=device), num_experts=4)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,e,k", [(4096, 7168, 256, 8), (8192, 2048, 64, 6)])
def test_permute_gpu_real_shapes(t, h, e, k, device):
    indices, probs = _routing(t, e, k, device)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
    out, out_probs, row_id_map, tpe = token_permute(x, indices, probs, num_experts=e, pad_multiple=128)
    back = token_unpermute(out, row_id_map, probs)
    assert_close(back, x.float() * probs.sum(-1, keepdim=True), torch.bfloat16)


SIG = {
    "x_ptr": "*bf16",
    "map_ptr": "*i32",
    "probs_ptr": "*fp32",
    "out_ptr": "*bf16",
    "out_probs_ptr": "*fp32",
    "H": "i32",
    "K": "i32",
    "stride_x": "i32",
    "stride_out": "i32",
    "HAS_PROBS": "constexpr",
    "BLOCK_H": "constexpr",
}
USIG = {
    "y_ptr": "*bf16",
    "map_ptr": "*i32",
    "probs_ptr": "*fp32",
    "out_ptr": "*bf16",
    "H": "i32",
    "K": "i32",
    "stride_y": "i32",
    "stride_out": "i32",
    "HAS_PROBS": "constexpr",
    "BLOCK_H": "constexpr",
}
BSIG = {
    "grad_out_ptr": "*bf16",
    "y_ptr": "*bf16",
    "map_ptr": "*i32",
    "probs_ptr": "*fp32",
    "grad_y_ptr": "*bf16",
    "grad_probs_ptr": "*fp32",
    "covered_ptr": "*i8",
    "H": "i32",
    "K": "i32",
    "stride_g": "i32",
    "stride_y": "i32",
    "routes_per_program": "i32",
    "BLOCK_K": "constexpr",
    "BLOCK_H": "constexpr",
}
QSIG = {
    "x_ptr": "*bf16",
    "map_ptr": "*i32",
    "out_ptr": "*fp8e4nv",
    "scale_ptr": "*fp32",
    "H": "i32",
    "K": "i32",
    "stride_x": "i32",
    "stride_out": "i32",
    "FP8_MAX": "constexpr",
    "BLOCK_H": "constexpr",
}


def _compile_all():
    for has_probs in (False, True):
        compile_for_sm90(pk.permute_kernel, SIG, {"HAS_PROBS": has_probs, "BLOCK_H": 2048})
        compile_for_sm90(pk.unpermute_kernel, USIG, {"HAS_PROBS": has_probs, "BLOCK_H": 2048})
    for k, h in ((8, 7168), (6, 2048), (3, 100)):
        block_k, block_h, _, warps = unpermute_bwd_probs_config(k, h)
        compile_for_sm90(pk.unpermute_bwd_probs_kernel, BSIG, {"BLOCK_K": block_k, "BLOCK_H": block_h},
                         num_warps=warps)  # fmt: skip
    compile_for_sm90(pk.mark_covered_kernel, {"map_ptr": "*i32", "covered_ptr": "*i8", "numel": "i32",
                                              "BLOCK": "constexpr"}, {"BLOCK": 4096})  # fmt: skip
    zsig = {"out_ptr": "*bf16", "probs_ptr": "*fp32", "covered_ptr": "*i8", "N": "i32", "H": "i32"}
    zsig |= {"stride": "i32", "HAS_PROBS": "constexpr", "BLOCK_R": "constexpr", "BLOCK_H": "constexpr"}
    for has_probs in (False, True):
        compile_for_sm90(pk.zero_uncovered_rows_kernel, zsig, {"HAS_PROBS": has_probs, "BLOCK_R": 4,
                                                              "BLOCK_H": 1024})  # fmt: skip
    zsig = {"out_ptr": "*bf16", "probs_ptr": "*fp32", "start_ptr": "*i64", "N": "i32", "H": "i32"}
    zsig |= {"stride_out": "i32", "HAS_PROBS": "constexpr", "BLOCK_R": "constexpr", "BLOCK_H": "constexpr"}
    for has_probs in (False, True):
        consts = {"HAS_PROBS": has_probs, "BLOCK_R": 16, "BLOCK_H": 1024}
        compile_for_sm90(zero_rows_from_kernel, zsig, consts)
    compile_for_sm90(pk.permute_fp8_rowwise_kernel, QSIG, {"FP8_MAX": 448.0, "BLOCK_H": 2048})
    _compile_ep()
    _compile_row_id_map()


def _compile_row_id_map():
    """The row-id map kernels (primus_turbo/triton/moe/row_id_map_kernel.py), both routing forms."""
    from primus_turbo.triton.moe import row_id_map_kernel as rk

    for idx_type in ("*i64", "*i32"):
        csig = {"idx_ptr": idx_type, "tile_counts_ptr": "*i32"}
        csig |= dict.fromkeys(["n_routes", "chunk_routes", "E", "NC"], "i32") | {"BLOCK_N": "constexpr"}
        compile_for_sm90(rk.index_chunk_count_kernel, csig, {"BLOCK_N": 64}, num_warps=1)
        rsig = {"idx_ptr": idx_type} | dict.fromkeys(["base_ptr", "offsets_ptr", "dest_ptr"], "*i32")
        rsig |= dict.fromkeys(["n_routes", "chunk_routes", "K", "E", "NC", "num_rows", "capacity"], "i32")
        rsig |= dict.fromkeys(["HAS_CAPACITY", "BLOCK_N"], "constexpr")
        for cap in (False, True):
            compile_for_sm90(rk.index_row_id_kernel, rsig, {"HAS_CAPACITY": cap, "BLOCK_N": 64}, num_warps=1)
    csig = {"map_ptr": "*u8", "tile_counts_ptr": "*i32"} | dict.fromkeys(["T", "C", "chunk_t"], "i32")
    compile_for_sm90(rk.map_column_count_kernel, csig | {"BLOCK_T": "constexpr"}, {"BLOCK_T": 1024})
    msig = {"map_ptr": "*u8"} | dict.fromkeys(["base_ptr", "offsets_ptr", "dest_ptr"], "*i32")
    msig |= dict.fromkeys(["T", "C", "chunk_t", "num_rows", "capacity"], "i32")
    msig |= dict.fromkeys(["HAS_CAPACITY", "BLOCK_T"], "constexpr")
    for cap in (False, True):
        compile_for_sm90(rk.map_row_id_kernel, msig, {"HAS_CAPACITY": cap, "BLOCK_T": 1024})
    ssig = dict.fromkeys(["tile_counts_ptr", "base_ptr", "counts_ptr"], "*i32")
    ssig |= dict.fromkeys(["E", "NC"], "i32") | dict.fromkeys(["BLOCK_E", "BLOCK_NC"], "constexpr")
    for block_e, block_nc in ((1, 4096), (8, 512)):
        compile_for_sm90(rk.expert_chunk_scan_kernel, ssig, {"BLOCK_E": block_e, "BLOCK_NC": block_nc})
    osig = dict.fromkeys(["counts_ptr", "offsets_ptr", "tokens_per_expert_ptr"], "*i32")
    osig |= dict.fromkeys(["E", "pad_multiple", "capacity"], "i32")
    osig |= dict.fromkeys(["HAS_CAPACITY", "BLOCK_E"], "constexpr")
    for cap in (False, True):
        compile_for_sm90(rk.expert_offsets_kernel, osig, {"HAS_CAPACITY": cap, "BLOCK_E": 4096})


def _compile_ep():
    """The TURBO expert-parallel kernels (primus_turbo/triton/moe/ep_kernel.py)."""
    from primus_turbo.triton.moe import ep_kernel as ek

    lsig = {
        "idx_ptr": "*i64",
        "in_rank_ptr": "*u8",
        "pos_ptr": "*i32",
        "peer_ptrs": "*i64",
        "counts_off": "i64",
    }
    lsig |= dict.fromkeys(["rank", "T", "W", "K", "experts_per_rank"], "i32")
    lsig |= dict.fromkeys(["FROM_INDICES", "BLOCK_T", "BLOCK_K"], "constexpr")
    for from_indices in (True, False):
        consts = {"FROM_INDICES": from_indices, "BLOCK_T": 1024, "BLOCK_K": 8}
        compile_for_sm90(ek.ep_layout_kernel, lsig, consts)
    dsig = {
        "x_ptr": "*bf16",
        "idx_ptr": "*i64",
        "probs_ptr": "*fp32",
        "scale_ptr": "*fp32",
        "pos_ptr": "*i32",
    }
    dsig |= {"counts_ptr": "*i64", "row_map_ptr": "*i32", "peer_ptrs": "*i64"}
    dsig |= dict.fromkeys(["rank", "T", "W", "H", "K", "S", "experts_per_rank"], "i32")
    dsig |= dict.fromkeys(["x_off", "idx_off", "probs_off", "scale_off"], "i64")
    dsig |= dict.fromkeys(
        ["HAS_PROBS", "HAS_SCALE", "WRITE_MAP", "BLOCK_R", "BLOCK_H", "BLOCK_K"], "constexpr"
    )
    dsig["BLOCK_W"] = "constexpr"
    for has_probs, has_scale, write_map in ((True, False, True), (True, True, True), (False, False, False)):
        consts = {"HAS_PROBS": has_probs, "HAS_SCALE": has_scale, "WRITE_MAP": write_map}
        consts |= {"BLOCK_R": 16, "BLOCK_H": 1024, "BLOCK_K": 64, "BLOCK_W": 2}
        compile_for_sm90(ek.ep_dispatch_push_kernel, dsig, consts, num_warps=8)
    csig = {"y_ptr": "*bf16", "w_ptr": "*fp32", "counts_ptr": "*i64", "peer_ptrs": "*i64"}
    csig |= dict.fromkeys(["rank", "W", "H", "K"], "i32")
    csig |= dict.fromkeys(["y_off", "w_off"], "i64")
    csig |= dict.fromkeys(["HAS_W", "BLOCK_R", "BLOCK_H", "BLOCK_K", "BLOCK_W"], "constexpr")
    for has_w in (False, True):
        consts = {"HAS_W": has_w, "BLOCK_R": 16, "BLOCK_H": 1024, "BLOCK_K": 16, "BLOCK_W": 8}
        compile_for_sm90(ek.ep_combine_push_kernel, csig, consts, num_warps=8)
    fsig = {"ws_x_ptr": "*bf16", "ws_idx_ptr": "*i32", "ws_probs_ptr": "*fp32", "out_x_ptr": "*bf16"}
    fsig |= {"out_idx_ptr": "*i64", "out_probs_ptr": "*fp32", "tpe_ptr": "*i32", "counts_ptr": "*i64"}
    fsig |= dict.fromkeys(["rank", "W", "R", "H", "K"], "i32")
    fsig |= dict.fromkeys(["HAS_PROBS", "HAS_TPE", "BLOCK_R", "BLOCK_H", "BLOCK_K", "BLOCK_W"], "constexpr")
    for has_probs in (False, True):
        consts = {"HAS_PROBS": has_probs, "HAS_TPE": has_probs, "BLOCK_R": 16, "BLOCK_H": 1024}
        consts |= {"BLOCK_K": 16, "BLOCK_W": 8}
        compile_for_sm90(ek.ep_recv_finalize_kernel, fsig, consts, num_warps=8)


def test_permute_kernels_compile_sm90():
    run_compile_check("test_moe_permute")


if __name__ == "__main__":
    _compile_all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_permute_turbo_csrc_matches_triton(dtype, device):
    from primus_turbo.pytorch.kernels.moe.permute_impl import PermuteTriton, PermuteTurbo, build_row_id_map

    t, h, e, k = 2048, 7168, 256, 8
    indices, probs = _routing(t, e, k, device, drop_frac=0.1)
    x = torch.randn(t, h, device=device, dtype=dtype)
    row_id_map, _, num_rows = build_row_id_map(indices, e, None, 128, None)
    kw = dict(kind="permute", x=x, row_id_map=row_id_map, probs=probs, num_rows=num_rows, zero_fill=True)
    if not PermuteTurbo.can_handle(**kw):
        pytest.skip("csrc extension (primus_turbo.pytorch._C) not built")
    out_c, probs_c = PermuteTurbo.execute(**kw)
    out_t, probs_t = PermuteTriton.execute(**kw)
    assert torch.equal(out_c, out_t) and torch.equal(probs_c, probs_t)
    ukw = dict(kind="unpermute", y=out_t, row_id_map=row_id_map, probs=probs, num_tokens=t)
    assert_close(PermuteTurbo.execute(**ukw), PermuteTriton.execute(**ukw).float(), dtype)


def test_moe_ops_torch_compile_fullgraph(device):
    """router -> swiglu_with_probs -> permute -> unpermute traces with fullgraph=True (custom ops +
    register_fake), forward and backward, and matches eager."""
    from primus_turbo.pytorch.ops.activation import swiglu_with_probs
    from primus_turbo.pytorch.ops.moe.router import fused_topk_routing

    def f(x, p, logits):
        probs, _, idx = fused_topk_routing(logits, 2, return_indices=True)
        y = swiglu_with_probs(x, p)
        topk_probs = probs.gather(1, idx)
        out, _, rid, _ = token_permute(y, idx, topk_probs, num_experts=8)
        return token_unpermute(out, rid, topk_probs).sum() + probs.sum()

    x = torch.randn(16, 32, device=device, requires_grad=True)
    p = torch.rand(16, device=device, requires_grad=True)
    logits = torch.randn(16, 8, device=device, requires_grad=True)
    eager = f(x, p, logits)
    grads = torch.autograd.grad(eager, [x, p, logits])
    compiled = torch.compile(f, fullgraph=True)(x, p, logits)
    cgrads = torch.autograd.grad(compiled, [x, p, logits])
    assert_close(compiled, eager, torch.float32)
    for a, b in zip(cgrads, grads):
        assert_close(a, b, torch.float32)


@pytest.mark.deterministic
def test_permute_unpermute_bitwise_deterministic(device):
    """Unpermute is a gather with a fixed summation order (no atomics): bitwise reproducible."""
    t, e, k, h = 64, 8, 4, 48
    indices, probs = _routing(t, e, k, device)
    x = torch.randn(t, h, device=device, requires_grad=True)
    runs = []
    for _ in range(2):
        out, _, rid, _ = token_permute(x, indices, num_experts=e, pad_multiple=16)
        y = token_unpermute(out * 1.5, rid, probs)
        (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        runs.append((y, gx))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("form", ["indices", "map"])
@pytest.mark.parametrize(
    "t, e, k, pad_multiple, capacity, num_out, knobs",
    [
        (37, 8, 3, 0, None, "exact", None),
        (300, 16, 4, 16, None, None, None),
        (300, 16, 4, 0, 9, "exact", None),
        (1, 4, 2, 128, None, "exact", None),
        # indices: 21-token chunks at top-3, 10 at top-6, 8 at top-8, 64 at top-1, so each expert's routes
        # span many chunks; capacities cut each expert mid-way (30 of ~96, 4 of ~5, 7 of ~15 routes)
        (300, 7, 3, 0, 30, "exact", None),
        (300, 12, 4, 8, None, "short", None),
        (600, 33, 5, 0, 60, None, None),
        (400, 64, 6, 0, None, "short", None),
        (200, 256, 8, 0, 4, "short", None),
        (300, 256, 8, 128, None, None, None),
        (250, 12, 1, 0, 7, "exact", None),
        (250, 12, 1, 4, None, "short", "int32"),
        (300, 12, 4, 0, 20, "short", "small"),
        (300, 12, 4, 16, None, None, "small"),
        (300, 33, 3, 8, None, "exact", "small"),
        (300, 33, 6, 0, 9, None, "small"),
        # tokens naming one expert twice (not top-k output, but legal input)
        (150, 5, 3, 0, None, None, "repeats"),
        (150, 5, 3, 0, 40, None, "repeats"),
    ],
)
@pytest.mark.parametrize("builder", ["triton", "csrc"])
def test_triton_row_id_map_equals_the_torch_reference(
    builder, form, t, e, k, pad_multiple, capacity, num_out, knobs, device, monkeypatch
):
    """The Triton map and the torch reference agree integer for integer: dropped routes, padding,
    capacity, num_out_tokens below the route count, the routing-map form with and without num_out_tokens,
    out-of-range ids (-3, E, E + 5) in the index form, int64 and int32 indices, a token naming an expert
    twice (both routes get the pair's second rank, as in the reference). Every case but the 1-token one
    runs several token chunks, so the in-chunk ranks and the per-chunk bases both count."""
    from primus_turbo.pytorch.kernels.moe import permute_impl

    if builder == "csrc":  # the CUDA twin of the index form (csrc/kernels/moe/row_id_map.cu)
        if form == "map" or not permute_impl._cpp_map_can_run(
            torch.zeros(1, k, dtype=torch.long, device=device), e
        ):
            pytest.skip("the csrc row-id map serves int indices on CUDA with the extension built")
    if knobs == "small":
        # 2-token chunks at top-4, scan tiles of 16 (several chunk tiles a row, several tiles of earlier
        # experts to sum) and several experts a scan program
        for name, value in {"_TILE": 16, "_ROUTES_PER_CHUNK": 8}.items():
            monkeypatch.setattr(permute_impl, name, value)
    torch.manual_seed(t * e + k)
    indices, probs = _routing(t, e, k, device, drop_frac=0.25)
    if knobs == "repeats":  # (the map form sees these as a denser map)
        indices = torch.randint(0, e, (t, k), device=device)
    rmap, _ = indices_to_map(indices, e, probs)
    routes = int((indices >= 0).sum())
    num_out = {"exact": routes, "short": routes // 2, None: None}[num_out]
    if form == "indices":
        # out-of-range ids route nowhere: the reference (whose scatter rejects ids >= E) sees them as -1
        routing = indices.clone()
        bad = torch.rand(t, k, device=device) < 0.1
        routing[bad] = torch.tensor([-3, e, e + 5], device=device).repeat(t * k)[: int(bad.sum())]
        routing = routing.to(torch.int32) if knobs == "int32" else routing
        ref_routing = torch.where(bad, torch.full_like(indices, -1), indices)
        num_out = None if num_out is None else num_out - int((bad & (indices >= 0)).sum())
    else:
        routing = ref_routing = rmap.to(device)
    build = permute_impl._build_row_id_map_cpp if builder == "csrc" else permute_impl._build_row_id_map_triton
    got = build(routing, e, num_out, pad_multiple, capacity)
    ref = permute_impl._build_row_id_map_torch(ref_routing, e, num_out, pad_multiple, capacity)
    assert got[2] == ref[2]
    assert torch.equal(got[1].cpu(), ref[1].cpu().to(torch.int32))
    assert got[0].dtype == torch.int32 and torch.equal(got[0].cpu(), ref[0].cpu())


@pytest.mark.gpu
def test_triton_row_id_map_at_deepseek_v3_size():
    from primus_turbo.pytorch.kernels.moe.permute_impl import (
        _build_row_id_map_cpp,
        _build_row_id_map_torch,
        _build_row_id_map_triton,
        _cpp_map_can_run,
    )

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    has_cpp = _cpp_map_can_run(torch.zeros(1, 8, dtype=torch.long, device="cuda"), 256)
    # DeepSeek-V3 (one EP rank's worth of tokens) and V2-Lite routing, with capacity and a short num_out
    for t, e, k in ((4096, 256, 8), (32768, 64, 6)):
        indices, probs = _routing(t, e, k, "cuda", drop_frac=0.05)
        rmap, _ = indices_to_map(indices, e, probs)
        modes = ((0, None, t * k), (128, None, t * k), (0, 100, None), (0, None, t * k // 2))
        for routing in (indices, rmap.cuda()):
            for pad, cap, num_out in modes:
                ref = _build_row_id_map_torch(routing, e, num_out, pad, cap)
                builders = [_build_row_id_map_triton]
                builders += [_build_row_id_map_cpp] if has_cpp and routing.dtype != torch.bool else []
                for build in builders:
                    got = build(routing, e, num_out, pad, cap)
                    assert got[2] == ref[2] and torch.equal(got[1], ref[1].to(torch.int32)), build.__name__
                    assert torch.equal(got[0], ref[0]), build.__name__
