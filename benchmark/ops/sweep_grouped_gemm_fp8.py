"""FP8 grouped GEMM tiles and TMA candidates (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_grouped_gemm_fp8.py [--out DIR] [--quick]

The Triton FP8 grouped kernels serve what torch._scaled_grouped_mm (CUTLASS) cannot: HYBRID's E5M2
gradients (the dgrad and the FP8 wgrad), BLOCKWISE, unaligned groups in the wgrad. They run one fixed
tile (128x128x128, 8 warps, 4 stages) through masked pointer loads. Per MoE shape, GPU time
(``do_bench_cudagraph``, no host time) of:

* forward kernel (the dgrad is the same kernel): the shipped tile, other tiles, and a candidate that
  loads A and B through host TMA descriptors (A [M, K] rows past the group feed only masked output rows;
  B [G*N, K] K-major, columns past N feed only masked output columns; K's tail is TMA zero fill);
* variable-K (wgrad) kernel over token-contiguous copies: the shipped tile, other tiles, and a TMA
  candidate for the BLOCK_K-aligned interior token tiles (the two partial edge tiles stay masked loads);

against CUTLASS on the same E4M3 operands (the variable-K with groups padded to multiples of 16, which
CUTLASS needs) and torch._grouped_mm bf16. Every candidate's output is checked against the shipped
kernel's (SNR in dB). Writes DIR/sweep_grouped_gemm_fp8.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_parser, out_dir  # noqa: E402

from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (  # noqa: E402
    SCALE_ROWWISE,
    _block_g,
    _group_schedule,
    _num_programs,
    _pick,
    launch_grouped_gemm,
    launch_grouped_gemm_variable_k,
)

# (name, experts, rows, N, K, dist): the bench_grouped_gemm quick set plus the fc2 layers
SHAPES = [  # most telling first (a device call may cut the sweep short)
    ("dsv3-fc1", 32, 4096 * 8, 4096, 7168, "skewed"),
    ("dsv2lite-fc1", 64, 4096 * 6, 2816, 2048, "balanced"),
    ("mixtral-fc1", 8, 4096 * 2, 28672, 4096, "balanced"),
    ("dsv3-fc2", 32, 4096 * 8, 7168, 2048, "balanced"),
    ("dsv2lite-fc2", 64, 4096 * 6, 2048, 1408, "balanced"),
]
# (BLOCK_M|P, BLOCK_N|Q, BLOCK_K, num_warps, num_stages); the first is the shipped one
TILES = [
    (128, 128, 128, 8, 4),
    (128, 256, 128, 8, 3),
    (256, 128, 128, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 128, 4, 4),
    (64, 256, 128, 4, 4),
]


@triton.jit
def fwd_tma_kernel(
    a_desc, b_desc, c_ptr, group_lens_ptr, a_scale_ptr, b_scale_ptr, G, M, N, K, stride_cm,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """ROWWISE: C[rows_g] = (A * sa)[rows_g] @ (B_g * sb_g)^T with B [G*N, K] (K-major)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    gidx, starts, lens, tiles, cum_tiles = _group_schedule(group_lens_ptr, G, M, BLOCK_G, BLOCK_M, num_n)
    total_tiles = tl.sum(tiles, axis=0)
    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)
    for tile in range(pid, total_tiles, NUM_PROGS):
        g = tl.sum((cum_tiles <= tile).to(tl.int32), axis=0)
        local = tile - (_pick(gidx, cum_tiles, g) - _pick(gidx, tiles, g))
        row_start = _pick(gidx, starts, g)
        row_end = row_start + _pick(gidx, lens, g)
        num_m = _pick(gidx, tiles, g) // num_n
        tiles_per_band = GROUP_M * num_n
        first_m = (local // tiles_per_band) * GROUP_M
        band_m = tl.minimum(num_m - first_m, GROUP_M)
        tile_m = first_m + (local % tiles_per_band) % band_m
        tile_n = (local % tiles_per_band) // band_m
        m0 = row_start + tile_m * BLOCK_M
        rows = m0 + offs_bm
        cols = tile_n * BLOCK_N + offs_bn
        row_mask = rows < row_end
        col_mask = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < G:
            n0 = g * N + tile_n * BLOCK_N
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([m0.to(tl.int32), k0])
                b = b_desc.load([n0.to(tl.int32), k0])
                acc = tl.dot(a, b.T, acc)
            sa = tl.load(a_scale_ptr + rows, mask=row_mask, other=0.0)
            sb = tl.load(b_scale_ptr + g * N + cols, mask=col_mask, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _vk_masked(x_ptr, y_ptr, acc, k0, row_start, row_end, ps, qs, p_mask, q_mask, offs_bk, M):
    ks = k0 + offs_bk
    r_mask = (ks >= row_start) & (ks < row_end)
    x = tl.load(
        x_ptr + ps.to(tl.int64)[:, None] * M + ks[None, :], mask=p_mask[:, None] & r_mask[None, :], other=0.0
    )
    y = tl.load(
        y_ptr + qs.to(tl.int64)[None, :] * M + ks[:, None], mask=r_mask[:, None] & q_mask[None, :], other=0.0
    )
    return tl.dot(x, y, acc)


@triton.jit
def vk_tma_kernel(
    x_desc, y_desc, x_ptr, y_ptr, c_ptr, group_lens_ptr, x_scale_ptr, y_scale_ptr, G, M, P, Q,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """ROWWISE: C[g] = (X_t[:, rows_g] * sx) @ (Y_t[:, rows_g] * sy)^T, X_t [P, M] and Y_t [Q, M]
    token-contiguous, C [G, P, Q] contiguous."""
    pid = tl.program_id(0)
    gidx, starts, lens, _, _ = _group_schedule(group_lens_ptr, G, M, BLOCK_G, 1, 1)
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    per_group = num_p * num_q
    offs_bp = tl.arange(0, BLOCK_P)
    offs_bq = tl.arange(0, BLOCK_Q)
    offs_bk = tl.arange(0, BLOCK_K)
    for tile in range(pid, G * per_group, NUM_PROGS):
        g = tile // per_group
        local = tile % per_group
        p0 = (local // num_q) * BLOCK_P
        q0 = (local % num_q) * BLOCK_Q
        row_start = _pick(gidx, starts, g)
        row_end = row_start + _pick(gidx, lens, g)
        ps = p0 + offs_bp
        qs = q0 + offs_bq
        p_mask = ps < P
        q_mask = qs < Q
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
        first_full = (tl.cdiv(row_start, BLOCK_K) * BLOCK_K).to(tl.int32)  # TMA offsets are 32-bit
        last_full = ((row_end // BLOCK_K) * BLOCK_K).to(tl.int32)
        for k0 in range(first_full, last_full, BLOCK_K):
            x = x_desc.load([p0, k0])
            y = y_desc.load([q0, k0])
            acc = tl.dot(x, y.T, acc)
        if (row_start < first_full) & (row_start < row_end):  # head: a partial token tile
            acc = _vk_masked(x_ptr, y_ptr, acc, first_full - BLOCK_K, row_start, row_end, ps, qs, p_mask,
                             q_mask, offs_bk, M)  # fmt: skip
        if (last_full < row_end) & (last_full >= first_full):  # tail: a partial token tile
            acc = _vk_masked(x_ptr, y_ptr, acc, last_full, row_start, row_end, ps, qs, p_mask, q_mask,
                             offs_bk, M)  # fmt: skip
        sx = tl.load(x_scale_ptr + ps, mask=p_mask, other=0.0)
        sy = tl.load(y_scale_ptr + qs, mask=q_mask, other=0.0)
        acc = acc * sx[:, None] * sy[None, :]
        c_ptrs = c_ptr + g.to(tl.int64) * P * Q + ps[:, None] * Q + qs[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=p_mask[:, None] & q_mask[None, :])


def tma_forward(a, sa, w, sw, lens, tile):
    """a [M, K] fp8, w [G, N, K] fp8 contiguous, sa [M], sw [G, N]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages = tile
    (m, k), (g, n, _) = a.shape, w.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    a_desc = TensorDescriptor(a, [m, k], [k, 1], [bm, bk])
    w2 = w.view(g * n, k)
    b_desc = TensorDescriptor(w2, [g * n, k], [k, 1], [bn, bk])
    progs = _num_programs(a.device)

    def run():
        fwd_tma_kernel[(progs,)](
            a_desc, b_desc, out, lens, sa, sw, g, m, n, k, out.stride(0),
            NUM_PROGS=progs, BLOCK_G=_block_g(g), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return run


def tma_variable_k(x_t, y_t, sx, sy, lens, tile):
    """x_t [P, M], y_t [Q, M] fp8 contiguous; out [G, P, Q] bf16."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bp, bq, bk, warps, stages = tile
    (p, m), q, g = x_t.shape, y_t.shape[0], lens.shape[0]
    out = torch.empty(g, p, q, dtype=torch.bfloat16, device=x_t.device)
    x_desc = TensorDescriptor(x_t, [p, m], [m, 1], [bp, bk])
    y_desc = TensorDescriptor(y_t, [q, m], [m, 1], [bq, bk])
    progs = _num_programs(x_t.device)

    def run():
        vk_tma_kernel[(progs,)](
            x_desc, y_desc, x_t, y_t, out, lens, sx, sy, g, m, p, q,
            NUM_PROGS=progs, BLOCK_G=_block_g(g), BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=bk,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return out

    return run


def group_lens(rows, experts, dist, align, device):
    if dist == "balanced":
        lens = torch.full((experts,), rows // experts, dtype=torch.int64)
        lens[: rows % experts] += 1
    else:  # one expert gets 60%
        rest = torch.rand(experts - 1, generator=torch.Generator().manual_seed(0)).double() + 0.05
        lens = torch.cat(
            [torch.tensor([rows * 3 // 5]), (rest / rest.sum() * (rows * 2 // 5)).floor().long()]
        )
    if align > 1:
        lens = (lens // align) * align
    lens[0] += rows - int(lens.sum())
    return lens.to(device)


def snr(ref, out):
    err = (out.float() - ref.float()).pow(2).sum().clamp_min(1e-30)
    return float(10 * torch.log10(ref.float().pow(2).sum() / err))


def _ms(fn):
    return tt.do_bench_cudagraph(fn, rep=60, return_mode="median")


def _try(fn, ref):
    try:
        out = fn()
        torch.cuda.synchronize()
        return _ms(fn), snr(ref, out)
    except Exception as e:  # a tile that does not compile or fit: reported, the sweep goes on
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def _row(report, label, flop, res, base_ms):
    ms, q = res
    if ms is None:
        report.write(f"| {label} | failed | | | {q} |\n")
        return
    report.write(f"| {label} | {ms * 1e3:.1f} | {flop / ms / 1e9:.0f} | {base_ms / ms:.2f}x | {q:.1f} |\n")


def sweep_shape(name, experts, rows, n, k, dist, report: io.StringIO) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    lens = group_lens(rows, experts, dist, 16, dev)  # multiples of 16: CUTLASS's wgrad needs them
    offs = torch.cumsum(lens, 0).to(torch.int32)
    a16 = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w16 = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) * 0.05
    g16 = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    a8, w8 = a16.to(e4), (w16 * 20).to(e4)
    sa = torch.rand(rows, device=dev) + 0.5
    sw = torch.rand(experts, n, device=dev) * 0.05 + 0.025
    flop = 2.0 * rows * n * k
    report.write(f"\n## {name}: {experts} experts, {rows} rows ({dist}), N={n}, K={k}\n\n")
    report.write(
        "| forward kernel | us | TFLOP/s | vs CUTLASS | SNR vs shipped (dB) |\n|---|---|---|---|---|\n"
    )
    bf16_ms = _ms(lambda: torch._grouped_mm(a16, w16.transpose(1, 2), offs=offs))
    cut = lambda: torch._scaled_grouped_mm(  # noqa: E731
        a8, w8.transpose(1, 2), sa, sw, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    cut_ms = _ms(cut)
    out = torch.empty(rows, n, dtype=torch.bfloat16, device=dev)

    def shipped(tile=None, a=a8):
        cfg = None
        if tile is not None:
            cfg = dict(
                BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=tile[2], num_warps=tile[3], num_stages=tile[4]
            )
        return lambda: launch_grouped_gemm(
            a, w8.transpose(1, 2), out, lens, sa, sw, SCALE_ROWWISE, config=cfg
        )

    ref = shipped()().clone()
    _row(report, "torch._grouped_mm bf16", flop, (bf16_ms, float("nan")), cut_ms)
    _row(report, "CUTLASS _scaled_grouped_mm E4M3", flop, (cut_ms, snr(ref, cut())), cut_ms)
    for tile in TILES:
        _row(report, f"Triton ptr {tile}", flop, _try(shipped(tile), ref), cut_ms)
    _row(report, "Triton ptr shipped, A E5M2 (the dgrad)", flop, _try(shipped(None, a16.to(e5)), ref), cut_ms)
    for tile in TILES:
        _row(report, f"Triton TMA {tile}", flop, _try(tma_forward(a8, sa, w8, sw, lens, tile), ref), cut_ms)

    # wgrad of this layer: dW[g] [N, K] = dC_g^T @ A_g over token-contiguous copies
    report.write(
        "\n| variable-K (wgrad) | us | TFLOP/s | vs CUTLASS | SNR vs shipped (dB) |\n|---|---|---|---|---|\n"
    )
    x_t, y_t = g16.t().contiguous().to(e4), a16.t().contiguous().to(e4)  # [N, M], [K, M]
    sx, sy = torch.rand(n, device=dev) + 0.5, torch.rand(k, device=dev) + 0.5
    vk_out = torch.empty(experts, n, k, dtype=torch.bfloat16, device=dev)

    def vk(tile=None, xt=x_t):
        cfg = None
        if tile is not None:
            cfg = dict(
                BLOCK_P=tile[0], BLOCK_Q=tile[1], BLOCK_K=tile[2], num_warps=tile[3], num_stages=tile[4]
            )
        return lambda: launch_grouped_gemm_variable_k(
            xt.t(), y_t.t(), vk_out, lens, sx, sy, SCALE_ROWWISE, config=cfg
        )

    vref = vk()().clone()
    bf16_wg = _ms(lambda: torch._grouped_mm(g16.t(), a16, offs=offs))
    sa_g = sx.reshape(1, n).expand(experts, n).reshape(-1).contiguous()
    sb_g = sy.reshape(1, k).expand(experts, k).reshape(-1).contiguous()
    vcut = lambda: torch._scaled_grouped_mm(  # noqa: E731
        x_t, y_t.t(), sa_g, sb_g, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True
    )
    vcut_ms = _ms(vcut)
    _row(report, "torch._grouped_mm bf16", flop, (bf16_wg, float("nan")), vcut_ms)
    _row(report, "CUTLASS _scaled_grouped_mm E4M3", flop, (vcut_ms, snr(vref, vcut())), vcut_ms)
    for tile in TILES:
        _row(report, f"Triton ptr {tile}", flop, _try(vk(tile), vref), vcut_ms)
    _row(
        report,
        "Triton ptr shipped, X E5M2 (HYBRID)",
        flop,
        _try(vk(None, g16.t().contiguous().to(e5)), vref),
        vcut_ms,
    )
    for tile in TILES:
        _row(
            report,
            f"Triton TMA {tile}",
            flop,
            _try(tma_variable_k(x_t, y_t, sx, sy, lens, tile), vref),
            vcut_ms,
        )
    # unaligned groups (what the Triton wgrad serves): shipped vs TMA at the shipped tile
    ulens = group_lens(rows, experts, dist, 1, dev)
    uref = launch_grouped_gemm_variable_k(x_t.t(), y_t.t(), vk_out, ulens, sx, sy, SCALE_ROWWISE).clone()
    ship_u = lambda: launch_grouped_gemm_variable_k(x_t.t(), y_t.t(), vk_out, ulens, sx, sy, SCALE_ROWWISE)  # noqa: E731
    _row(report, "unaligned groups: Triton ptr shipped", flop, _try(ship_u, uref), vcut_ms)
    for tile in TILES[:2]:
        _row(report, f"unaligned groups: Triton TMA {tile}", flop,
             _try(tma_variable_k(x_t, y_t, sx, sy, ulens, tile), uref), vcut_ms)  # fmt: skip


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_grouped_gemm_fp8: needs a CUDA device")
    report = io.StringIO()
    report.write(f"# FP8 grouped GEMM sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
                 f"triton {triton.__version__}\n")  # fmt: skip
    path = out_dir(args) / "sweep_grouped_gemm_fp8.txt"
    for shape in SHAPES[:1] if args.quick else SHAPES:
        part = io.StringIO()
        try:
            sweep_shape(*shape, part)
        except Exception as e:  # a faulting candidate poisons the CUDA context: keep what was measured
            part.write(f"\n{shape[0]}: stopped by {type(e).__name__}: {str(e).splitlines()[0][:200]}\n")
        print(part.getvalue(), flush=True)
        report.write(part.getvalue())
        path.write_text(report.getvalue())


if __name__ == "__main__":
    main()
