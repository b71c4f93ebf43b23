"""The bf16 Triton GEMM's two TMA kernels side by side: host descriptors vs descriptors made in the kernel.

    python benchmark/ops/sweep_gemm_tma_variants.py [--quick] [--out DIR]

Per shape and layout (the three GEMMs of nn.Linear as ``ops.gemm`` issues them: fwd NT, dgrad NN, wgrad TN),
each autotuned on its own: the GPU time (do_bench median us) and TFLOP/s of ``gemm_triton`` with
``variant="tma"`` and ``variant="tma_device"``, with ``torch.mm`` (cuBLAS) in the same process, and the host
us to issue one call of each (a loop without a sync: the number a host-bound training step pays). Every
variant's output is checked against torch.mm's first. Writes DIR/sweep_gemm_tma_variants.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, host_ms, run_sweep, tflops  # noqa: E402

from primus_turbo.triton.gemm.gemm_kernel import gemm_triton  # noqa: E402

SHAPES = [(8192, 2048, 2048), (8192, 4096, 2048), (8192, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096),
          (16384, 7168, 14336), (4096, 2048, 2048)]  # fmt: skip
VARIANTS = ("tma", "tma_device")


def _layouts(m: int, n: int, k: int):
    """(name, logical A, logical B) of the forward, dgrad and wgrad GEMMs of x[m, k] @ w[n, k]^T."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return [("fwd", x, w.T, m, n, k), ("dgrad", g, w, m, k, n), ("wgrad", g.T, x, n, k, m)]


def sweep_case(shape, report) -> None:
    report.write(f"\n## {shape[0]}x{shape[1]}x{shape[2]}\n\n")
    report.write("| GEMM | torch us | tma us | tma_device us | tma_device speedup | torch TFLOP/s | ")
    report.write("tma_device TFLOP/s | host us torch | host us tma | host us tma_device |\n")
    report.write("|---|---|---|---|---|---|---|---|---|---|\n")
    for name, a, b, m, n, k in _layouts(*shape):
        ref = torch.mm(a, b)
        fns = {"torch": lambda a=a, b=b: torch.mm(a, b)}
        for variant in VARIANTS:
            fns[variant] = lambda a=a, b=b, v=variant: gemm_triton(a, b, torch.bfloat16, variant=v)
            out = fns[variant]().float()  # autotunes this variant for the shape
            err = (out - ref.float()).norm() / ref.float().norm()
            if not err < 1e-2:
                raise AssertionError(f"{name} {variant}: relative error {err:.3g} against torch.mm")
        gpu = {key: bench_ms(fn, warmup_ms=25, rep_ms=200)[0] * 1e3 for key, fn in fns.items()}
        host = {key: host_ms(fn, n=200, warmup=10) * 1e3 for key, fn in fns.items()}
        flop = 2.0 * m * n * k
        report.write(
            f"| {name} | {gpu['torch']:.1f} | {gpu['tma']:.1f} | {gpu['tma_device']:.1f} | "
            f"{gpu['tma'] / gpu['tma_device']:.3f}x | {tflops(flop, gpu['torch'] / 1e3):.0f} | "
            f"{tflops(flop, gpu['tma_device'] / 1e3):.0f} | {host['torch']:.1f} | {host['tma']:.1f} | "
            f"{host['tma_device']:.1f} |\n"
        )


if __name__ == "__main__":
    run_sweep(__doc__, "sweep_gemm_tma_variants", "Triton bf16 GEMM: host vs device TMA descriptors",
              [(s,) for s in SHAPES], sweep_case)  # fmt: skip
