"""Variable-K (wgrad) candidate with per-group device-side TMA descriptors, vs the shipped kernel and CUTLASS
(a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_grouped_vk_devdesc.py [--out DIR] [--quick]

Why: the shipped variable-K TMA kernel reads each group's tokens through one descriptor over all of X / Y,
so a group's first and last token windows (not aligned to BLOCK_K) go through masked pointer loads outside
the TMA pipeline. With short groups (a few hundred tokens: 3-7 K steps a tile) those two steps and the
pipeline's restart per tile dominate: the kernel is 0.87x CUTLASS at DeepSeek-V3 fc1 skewed in bf16 (0.63x
in FP8), and summing into fp32 main_grad it lost to CUTLASS + an add pass at the recipe's real routing
(session 26). The candidate builds two descriptors per tile on the device (``tl.make_tensor_descriptor``)
over exactly the group's rows: every K step is a TMA load, the rows past the group are zero-filled by the
hardware, no masks. The cost is writing and fencing two descriptors per tile.

Rows, per shape (GPU time, ``do_bench_cudagraph``; SNR against CUTLASS): wgrad with a bf16 output and the
wgrad summed into an fp32 buffer (accumulate=2), each for CUTLASS (+ core.main_grad's one-launch add), the
shipped TMA kernel (default tile) and the candidate's tiles. Shapes: the five of the FP8 sweep plus the
deepseek_moe recipe's experts (64 x 768 tokens on average) with uneven (Zipf-like) routing.
Writes DIR/sweep_grouped_vk_devdesc.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402
from sweep_grouped_gemm_fp8 import SHAPES, _ms, _row, _try, group_lens  # noqa: E402

from primus_turbo.pytorch.core.main_grad import add_into_  # noqa: E402
from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (  # noqa: E402
    _group_schedule,
    _vk_c_tile,
    _vk_tile_coords,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_tma_kernel import (  # noqa: E402
    launch_grouped_gemm_variable_k_tma,
)

# (BLOCK_P, BLOCK_Q, BLOCK_K, num_warps, num_stages, PROGS_PER_SM)
TILES = [(128, 256, 64, 8, 3, 1), (128, 128, 64, 4, 3, 2), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 4, 1)]
RECIPE = [("recipe-fc1", 64, 49152, 2816, 2048, "zipf"), ("recipe-fc2", 64, 49152, 2048, 1408, "zipf")]


@triton.jit
def vk_devdesc_kernel(
    x_ptr, y_ptr, c_ptr, group_lens_ptr, G, M, P, Q, stride_xm, stride_ym, stride_cg, stride_cp, stride_cq,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr, ACCUMULATE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """C[g] (+)= X[rows_g]^T @ Y[rows_g] for row-major 16-bit X [M, P], Y [M, Q]; empty groups: zeros
    (ACCUMULATE 2: C[g] read as the accumulator's start, empty groups unchanged)."""
    pid = tl.program_id(0)
    gidx, starts, lens, _, _ = _group_schedule(group_lens_ptr, G, M, BLOCK_G, 1, 1)
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    per_group = num_p * num_q
    offs_p = tl.arange(0, BLOCK_P)
    offs_q = tl.arange(0, BLOCK_Q)
    for tile in range(pid, G * per_group, NUM_PROGS):
        g, row_start, row_end, p0, q0 = _vk_tile_coords(
            tile, per_group, num_q, gidx, starts, lens, BLOCK_P, BLOCK_Q
        )
        ps = p0 + offs_p
        qs = q0 + offs_q
        p_mask = ps < P
        q_mask = qs < Q
        c_ptrs, c_mask, acc = _vk_c_tile(
            c_ptr, g, ps, qs, p_mask, q_mask, stride_cg, stride_cp, stride_cq, BLOCK_P, BLOCK_Q, ACCUMULATE
        )
        n = (row_end - row_start).to(tl.int32)
        rows = tl.maximum(n, 1)  # a descriptor needs a non-empty shape; an empty group runs no K step
        p0 = p0.to(tl.int32)  # descriptor coordinates are 32-bit
        q0 = q0.to(tl.int32)
        base = row_start.to(tl.int64)
        x_g = x_ptr + base * stride_xm
        y_g = y_ptr + base * stride_ym
        xd = tl.make_tensor_descriptor(x_g, [rows, P], [stride_xm, 1], [BLOCK_K, BLOCK_P])
        yd = tl.make_tensor_descriptor(y_g, [rows, Q], [stride_ym, 1], [BLOCK_K, BLOCK_Q])
        for k0 in range(0, n, BLOCK_K):
            x = xd.load([k0, p0]).T
            y = yd.load([k0, q0])
            if UPCAST:
                x = x.to(tl.float32)
                y = y.to(tl.float32)
            acc = tl.dot(x, y, acc)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def launch_vk_devdesc(x, y, out, group_lens, tile=TILES[0], accumulate=0):
    """out[g] (+)= x[rows_g]^T @ y[rows_g]: x [M, P], y [M, Q] row-major bf16/fp16 (16-byte aligned rows),
    out [G, P, Q] of any float dtype and strides."""
    m, p = x.shape
    q, g = y.shape[1], out.shape[0]
    bp, bq, bk, warps, stages, per_sm = tile
    on_gpu = x.is_cuda
    progs = (torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm) if on_gpu else 3
    triton.set_allocator(_alloc)  # the device-side descriptors' global scratch
    vk_devdesc_kernel[(progs,)](
        x, y, out, group_lens, g, m, p, q, x.stride(0), y.stride(0), *out.stride(),
        NUM_PROGS=progs, BLOCK_G=triton.next_power_of_2(g + 1), BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=bk,
        ACCUMULATE=accumulate, UPCAST=not on_gpu, num_warps=warps, num_stages=stages if on_gpu else 1,
    )  # fmt: skip
    return out


def zipf_lens(rows: int, experts: int, device) -> torch.Tensor:
    """Uneven routing: expert i gets ~1 / (i + 1)^0.8 of the tokens, in shuffled order (fixed seed)."""
    w = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 0.8
    w = w[torch.randperm(experts, generator=torch.Generator().manual_seed(0))]
    lens = (w / w.sum() * rows).floor().long()
    lens[0] += rows - int(lens.sum())
    return lens.to(device)


def sweep_shape(name, experts, rows, n, k, dist, report: io.StringIO) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lens = zipf_lens(rows, experts, dev) if dist == "zipf" else group_lens(rows, experts, dist, 1, dev)
    offs = torch.cumsum(lens, 0).to(torch.int32)
    a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
    flop = 2.0 * rows * n * k
    report.write(f"\n## {name}: {experts} experts, {rows} rows ({dist}; tokens per expert {int(lens.min())}-")
    report.write(f"{int(lens.max())}), N={n}, K={k}\n")
    head = "| {} | us | TFLOP/s | vs CUTLASS | SNR vs CUTLASS (dB) |\n|---|---|---|---|---|\n"

    def timed(fn, ref, before):  # as _try, the buffer reset before the SNR run (it accumulates)
        before()
        return _try(fn, ref)

    report.write("\n" + head.format("wgrad (bf16 out)"))
    out = torch.empty(experts, n, k, dtype=torch.bfloat16, device=dev)
    cut = lambda: torch._grouped_mm(dy.t(), a, offs=offs)  # noqa: E731
    ref = cut().clone()
    cut_ms = _ms(cut)
    _row(report, "CUTLASS torch._grouped_mm", flop, (cut_ms, float("inf")), cut_ms)
    shipped = lambda: launch_grouped_gemm_variable_k_tma(dy, a, out, lens)  # noqa: E731
    _row(report, "shipped TMA (default tile)", flop, _try(shipped, ref), cut_ms)
    for tile in TILES:
        run = lambda tile=tile: launch_vk_devdesc(dy, a, out, lens, tile)  # noqa: E731
        _row(report, f"device descriptors {tile}", flop, _try(run, ref), cut_ms)

    report.write("\n" + head.format("wgrad += into fp32"))
    acc = torch.randn(experts, n, k, device=dev)
    base = acc.clone()
    fref = base + ref.float()

    def reset():
        acc.copy_(base)

    def cut_add():
        add_into_(acc, torch._grouped_mm(dy.t(), a, offs=offs))
        return acc

    cut_add_ms = timed(cut_add, fref, reset)
    _row(report, "CUTLASS + add_into_ (one launch)", flop, cut_add_ms, cut_add_ms[0])
    shipped = lambda: launch_grouped_gemm_variable_k_tma(dy, a, acc, lens, accumulate=2)  # noqa: E731
    _row(report, "shipped TMA accumulate=2", flop, timed(shipped, fref, reset), cut_add_ms[0])
    for tile in TILES:
        run = lambda tile=tile: launch_vk_devdesc(dy, a, acc, lens, tile, accumulate=2)  # noqa: E731
        _row(report, f"device descriptors {tile}", flop, timed(run, fref, reset), cut_add_ms[0])


if __name__ == "__main__":
    shapes = RECIPE + [s for s in SHAPES if s[0] in ("dsv3-fc1", "dsv2lite-fc1", "dsv2lite-fc2")]
    title = "variable-K with device-side descriptors"
    run_sweep(__doc__, "sweep_grouped_vk_devdesc", title, shapes, sweep_shape)
