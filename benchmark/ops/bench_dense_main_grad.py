"""Dense weight gradient into Megatron's fp32 ``main_grad``: turbo's fused path against Megatron's stock one.

For y = x @ W^T the weight gradient is dW = dY^T @ X. Megatron without its fused CUDA extension computes dW in
bf16 and DDP's hook adds it into the fp32 main_grad (two kernels, dW rounded to bf16); turbo's
``ops.gemm(accumulate_into_main_grad=True)`` calls ``gemm_accumulate_``: one cuBLAS GEMM with bf16 inputs,
fp32 output and beta=1 into main_grad. Shapes: the linears of ``recipe=deepseek_moe_fp8`` for one 4096-token
micro-batch. Rows: GPU time (median of ``triton.testing.do_bench``), TFLOP/s of the GEMM, and the ratio
stock / turbo (> 1: turbo faster); the check compares both results with an fp32 product.

    python benchmark/ops/bench_dense_main_grad.py [--quick] [--out DIR]
"""

from __future__ import annotations

import sys

import torch
from bench_utils import bench_ms, bench_parser, out_dir, print_table, tflops, write_csv

from primus_turbo.pytorch.kernels.gemm.gemm_impl import GemmDispatcher, gemm_accumulate_

TOKENS = 4096
# (name, out_features, in_features) of the deepseek_moe_fp8 linears (hidden 2048, MLA, vocab 102400)
LINEARS = [
    ("lm_head", 102400, 2048),
    ("dense fc1", 2 * 10944, 2048),
    ("dense fc2", 2048, 10944),
    ("shared fc1", 2 * 2816, 2048),
    ("shared fc2", 2048, 2816),
    ("q_proj", 16 * 192, 2048),
    ("kv_down", 512 + 64, 2048),
    ("kv_up", 16 * 256, 512),
    ("attn proj", 2048, 16 * 128),
]


def run_linear(name: str, n_out: int, n_in: int) -> dict:
    dy = torch.randn(TOKENS, n_out, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(TOKENS, n_in, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(n_out, n_in, device="cuda", dtype=torch.float32)

    def turbo():
        gemm_accumulate_(main_grad, dy, x, True, False)  # the operands ops.gemm's backward passes

    def stock():
        main_grad.add_(torch.mm(dy.t(), x))  # bf16 wgrad, then DDP's hook adds it

    start = main_grad.clone()
    want = start + torch.mm(dy.t().float(), x.float())
    turbo()
    err_turbo = ((main_grad - want).norm() / want.norm()).item()
    backend = GemmDispatcher.last_backend.name if GemmDispatcher.last_backend else "?"
    main_grad.copy_(start)
    stock()
    err_stock = ((main_grad - want).norm() / want.norm()).item()
    flop = 2.0 * TOKENS * n_out * n_in
    t_ms, _ = bench_ms(turbo)
    s_ms, _ = bench_ms(stock)
    return {
        "linear": name, "shape": f"{n_out}x{n_in} K={TOKENS}", "turbo backend": backend,
        "turbo ms": t_ms, "turbo TFLOP/s": tflops(flop, t_ms), "stock ms": s_ms,
        "stock TFLOP/s": tflops(flop, s_ms), "stock / turbo": s_ms / t_ms,
        "turbo rel err": err_turbo, "stock rel err": err_stock,
    }  # fmt: skip


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dense_main_grad: needs a CUDA device")
    torch.manual_seed(0)
    linears = LINEARS[:2] if args.quick else LINEARS
    rows = [run_linear(*spec) for spec in linears]
    name = "dense_main_grad_quick.csv" if args.quick else "dense_main_grad.csv"
    write_csv(out_dir(args) / name, rows)
    print_table(rows, list(rows[0].keys()))


if __name__ == "__main__":
    main()
