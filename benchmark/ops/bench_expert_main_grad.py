"""Ways to add a grouped expert weight gradient [G, N, K] into G fp32 Megatron ``main_grad`` buffers.

Megatron's DDP lays the experts' main_grads out back to back in reverse parameter order (weight{G-1}
first), so they form one block with a negative expert stride. Prints one row per option: GPU time
(median of ``triton.testing.do_bench``), kernel launches (torch.profiler) and bytes moved per element
(the wgrad GEMM's own output write not counted); then what an fp32 instead of bf16 output costs the
FP8 wgrad GEMM, and whether ``torch._grouped_mm`` (the bf16 wgrad) can write fp32.
The last option is the one ``core.main_grad.accumulate_into_main_grads_`` takes.

    python benchmark/ops/bench_expert_main_grad.py [--groups 64 --rows 2816 --cols 2048]
"""

from __future__ import annotations

import argparse

import torch
import triton
from torch.profiler import ProfilerActivity, profile

from primus_turbo.triton.main_grad.accumulate_kernel import launch_accumulate_grouped

# Bytes moved per gradient element by each option (the wgrad GEMM's own output write not counted): the add
# reads the fp32 main_grad (4) and the gradient (2 bf16 / 4 fp32) and writes main_grad (4); a cast or a flip
# is one more pass (read its input, write its output).
BYTES_PER_ELEM = {
    "per-expert add_ (today: DDP hook)": 10,
    "_foreach_add_ fp32 += bf16": 10,
    "cast to fp32 + _foreach_add_": 18,  # cast 2 + 4, add 12
    "fp32 wgrad given: _foreach_add_": 12,
    "block add_ fp32 += bf16 (no flip: ascending)": 10,
    "block add_ fp32 += bf16 (flip)": 14,  # flip 2 + 2, add 10
    "fp32 wgrad given: block add_ (flip)": 20,  # flip 4 + 4, add 12
    "triton fused fp32 += bf16": 10,
}


def _ms(fn) -> float:
    """Median GPU ms of ``fn`` (do_bench's own default is the mean)."""
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def _launches(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def _fp8_wgrad_out_dtype(g, n, k, tokens_per_expert=384) -> None:
    """The FP8 wgrad (Triton variable-K, HYBRID: E5M2 grad x E4M3 act) writing bf16 vs fp32."""
    from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
        SCALE_ROWWISE,
        launch_grouped_gemm_variable_k,
    )

    m = g * tokens_per_expert
    grad_t = torch.randn(n, m, device="cuda").to(torch.float8_e5m2)  # token-contiguous copies
    act_t = torch.randn(k, m, device="cuda").to(torch.float8_e4m3fn)
    sx, sy = torch.rand(n, device="cuda"), torch.rand(k, device="cuda")
    lens = torch.full((g,), tokens_per_expert, device="cuda", dtype=torch.int64)
    for dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(g, n, k, device="cuda", dtype=dtype)

        def wgrad(out=out):
            return launch_grouped_gemm_variable_k(grad_t.t(), act_t.t(), out, lens, sx, sy, SCALE_ROWWISE)

        ms = _ms(wgrad)
        print(f"fp8 wgrad (M={m}) out {str(dtype):15s} {ms:8.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2816)
    parser.add_argument("--cols", type=int, default=2048)
    args = parser.parse_args()
    g, n, k = args.groups, args.rows, args.cols
    buffer = torch.zeros(g * n * k, dtype=torch.float32, device="cuda")
    # DDP order: weight0's main_grad is the LAST slot of the block
    main_grads = [buffer[(g - 1 - i) * n * k : (g - i) * n * k].view(n, k) for i in range(g)]
    wgrad = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    wgrad32 = wgrad.float()
    block_rev = buffer.view(g, n, k)  # slot j = weight{G-1-j}
    rows = {
        "per-expert add_ (today: DDP hook)": lambda: [m.add_(w) for m, w in zip(main_grads, wgrad)],
        "_foreach_add_ fp32 += bf16": lambda: torch._foreach_add_(main_grads, list(wgrad.unbind(0))),
        "cast to fp32 + _foreach_add_": lambda: torch._foreach_add_(
            main_grads, list(wgrad.float().unbind(0))
        ),
        "fp32 wgrad given: _foreach_add_": lambda: torch._foreach_add_(main_grads, list(wgrad32.unbind(0))),
        "block add_ fp32 += bf16 (no flip: ascending)": lambda: block_rev.add_(wgrad),
        "block add_ fp32 += bf16 (flip)": lambda: block_rev.add_(wgrad.flip(0)),
        "fp32 wgrad given: block add_ (flip)": lambda: block_rev.add_(wgrad32.flip(0)),
        "triton fused fp32 += bf16": lambda: launch_accumulate_grouped(main_grads[0], wgrad, -n * k),
    }
    elems = g * n * k
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"G={g} N={n} K={k}: {elems / 1e6:.1f}M elements")
    print(f"{'option':44s} {'ms':>8s} {'launches':>9s} {'B/elem':>7s} {'GB/s':>8s}")
    for name, fn in rows.items():
        bytes_per_elem = BYTES_PER_ELEM[name]
        ms = _ms(fn)
        gbps = elems * bytes_per_elem / ms / 1e6
        print(f"{name:44s} {ms:8.3f} {_launches(fn):9d} {bytes_per_elem:7d} {gbps:8.0f}")
    ref = torch.zeros_like(buffer)
    for i in range(g):
        ref[(g - 1 - i) * n * k : (g - i) * n * k] += wgrad[i].float().reshape(-1)
    buffer.zero_()
    launch_accumulate_grouped(main_grads[0], wgrad, -n * k)
    print("triton fused == reference:", torch.equal(buffer, ref))
    _fp8_wgrad_out_dtype(g, n, k)
    try:
        offs = torch.tensor([16 * (i + 1) for i in range(4)], device="cuda", dtype=torch.int32)
        x, y = torch.randn(64, 128, device="cuda").bfloat16(), torch.randn(64, 256, device="cuda").bfloat16()
        out = torch._grouped_mm(x.t(), y, offs=offs, out_dtype=torch.float32)
        print("torch._grouped_mm out_dtype=fp32:", out.dtype)
    except Exception as exc:  # noqa: BLE001
        print("torch._grouped_mm out_dtype=fp32: refused:", str(exc).splitlines()[0])


if __name__ == "__main__":
    main()
