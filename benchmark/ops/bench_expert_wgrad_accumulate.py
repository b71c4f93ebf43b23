"""Expert weight gradient into fp32 gradient buffers: the wgrad GEMM then an add pass, against the Triton
variable-K grouped GEMM adding in its epilogue (``accumulate=True``), at the deepseek_moe_fp8 expert shapes.

Per MoE layer and micro-batch of gradient accumulation (after the first), TorchTitan's AMP path and Megatron's
DDP both add a bf16 [G, N, K] weight gradient into an fp32 buffer: 10 bytes per element after the GEMM wrote
2. Rows (median GPU ms, ``triton.testing.do_bench``, same process):

  cutlass + add     torch._grouped_mm wgrad (bf16) + core.main_grad's one-launch fp32 += bf16 (today's path)
  triton + add      the Triton variable-K wgrad (bf16) + the same add
  triton fused      the Triton variable-K wgrad adding into the fp32 buffer (one launch), with tile variants;
                    "(C first)": the buffer read as the accumulator's start instead of in the epilogue
  first micro-batch: cutlass bf16 + .float() copy vs Triton writing fp32 directly
  megatron ...      the library paths of the Megatron experts, main_grads laid out in reverse expert order as
                    DDP does: "cutlass + add (reverse)" the path before main_grad_into (the bf16 gradient,
                    then one add launch at a negative stride), "main_grad_into (reverse)" the wgrad GEMM
                    summing into them (grouped_gemm_variable_k_into_, reverse_groups, default backend)

    python benchmark/ops/bench_expert_wgrad_accumulate.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, out_dir, print_table, tflops, write_csv  # noqa: E402

from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (  # noqa: E402
    GroupedWgradIntoDispatcher,
    cutlass_offsets,
    grouped_gemm_variable_k_into_,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import launch_grouped_gemm_variable_k  # noqa: E402
from primus_turbo.triton.main_grad.accumulate_kernel import launch_accumulate_grouped  # noqa: E402

# deepseek_moe_fp8: 64 experts, hidden 2048, expert FFN 1408, top-6 of 2 x 4096 tokens per micro-batch
SHAPES = [  # (label, G, P (gradient columns), Q (activation columns), routed rows)
    ("fc1 (w1|w3) wgrad", 64, 2816, 2048, 49152),
    ("fc2 (w2) wgrad", 64, 2048, 1408, 49152),
]
TILES = [  # (BLOCK_P, BLOCK_Q, BLOCK_K, num_warps, num_stages); the first is the default
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
]


def _lens(g: int, rows: int, skewed: bool) -> torch.Tensor:
    if not skewed:
        return torch.full((g,), rows // g, dtype=torch.int64, device="cuda")
    w = torch.rand(g, generator=torch.Generator().manual_seed(0)) ** 3 + 0.05
    lens = (w / w.sum() * rows).long()
    lens[0] += rows - lens.sum()
    return lens.cuda()


def run_shape(label, g, p, q, rows, skewed, tiles) -> list[dict]:
    lens = _lens(g, rows, skewed)
    grad = torch.randn(rows, p, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(rows, q, device="cuda", dtype=torch.bfloat16)
    offs = cutlass_offsets(lens, rows)
    init = torch.randn(g, p, q, device="cuda")  # the fp32 gradient buffer before this micro-batch
    main = init.clone()
    bf16_out = torch.empty(g, p, q, device="cuda", dtype=torch.bfloat16)
    expected = init.clone()
    launch_accumulate_grouped(expected[0], torch._grouped_mm(grad.t(), act, offs=offs), p * q)
    flop = 2.0 * rows * p * q
    dist = "skewed" if skewed else "balanced"

    def cutlass_add():
        launch_accumulate_grouped(main[0], torch._grouped_mm(grad.t(), act, offs=offs), p * q)

    def triton_add():
        launch_grouped_gemm_variable_k(grad, act, bf16_out, lens)
        launch_accumulate_grouped(main[0], bf16_out, p * q)

    candidates = {"cutlass + add": cutlass_add, "triton + add": triton_add}
    for bp, bq, bk, warps, stages in tiles:
        cfg = dict(BLOCK_P=bp, BLOCK_Q=bq, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        name = f"triton fused {bp}x{bq}x{bk} w{warps} s{stages}"
        candidates[name] = lambda cfg=cfg: launch_grouped_gemm_variable_k(
            grad, act, main, lens, accumulate=1, config=cfg
        )
        candidates[name.replace("fused", "fused (C first)")] = lambda cfg=cfg: launch_grouped_gemm_variable_k(
            grad, act, main, lens, accumulate=2, config=cfg
        )
    candidates["first mb: cutlass + .float()"] = lambda: torch._grouped_mm(grad.t(), act, offs=offs).float()
    candidates["first mb: triton fp32 out"] = lambda: launch_grouped_gemm_variable_k(
        grad, act, torch.empty(g, p, q, device="cuda"), lens
    )

    # Megatron: expert e's main_grad is block G-1-e of one flat buffer (DDP's reverse order)
    def megatron_before():
        launch_accumulate_grouped(main[g - 1], torch._grouped_mm(grad.t(), act, offs=offs), -p * q)

    def megatron_fused():
        grouped_gemm_variable_k_into_(grad, act, lens, main, True, offs, True)

    candidates["megatron: cutlass + add (reverse)"] = megatron_before
    candidates["megatron: main_grad_into (reverse)"] = megatron_fused
    rows_out, base = [], None
    for name, fn in candidates.items():
        check = ""
        if "fused" in name or "megatron" in name:  # one call from the same start: the same sum up to bf16
            main.copy_(init)
            fn()
            want = init + (expected - init).flip(0) if "reverse" in name else expected
            err = ((main - want).abs().max() / want.abs().max()).item()
            check = "PASS" if err < 1e-2 else f"FAIL {err:.2e}"
        ms, std = bench_ms(fn)
        if name == "cutlass + add":
            base = ms
        if name == "megatron: main_grad_into (reverse)":
            name += f" ({GroupedWgradIntoDispatcher.last_backend.name})"
        rows_out.append({
            "label": label, "dist": dist, "impl": name, "Check": check, "ms": ms, "ms_stddev": std,
            "TFLOPS (GEMM)": tflops(flop, ms), "speedup vs cutlass + add": base / ms if base else None,
        })  # fmt: skip
    return rows_out


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    for label, g, p, q, m in SHAPES:
        for skewed in (False,) if args.quick else (False, True):
            rows += run_shape(label, g, p, q, m, skewed, TILES[:2] if args.quick else TILES)
    cols = ["label", "dist", "impl", "Check", "ms", "TFLOPS (GEMM)", "speedup vs cutlass + add"]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print_table(rows, cols)
    write_csv(out_dir(args) / f"expert_wgrad_accumulate{'_quick' if args.quick else ''}.csv", rows)


if __name__ == "__main__":
    main()
