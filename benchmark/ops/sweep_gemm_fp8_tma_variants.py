"""The FP8 Triton GEMM's TMA paths side by side: host descriptors (default) vs descriptors made in the kernel.

    python benchmark/ops/sweep_gemm_fp8_tma_variants.py [--quick] [--out DIR]

Per shape, the three GEMMs of an FP8 nn.Linear as the ops layer issues them (both operands K-major: fwd
M x N x K, dgrad M x K x N, wgrad N x K x M), rowwise-scaled E4M3: the GPU time (do_bench median us) of
``torch._scaled_mm`` (cuBLAS rowwise, the baseline) and of ``gemm_fp8_triton`` with ``variant="tma"`` and
``"tma_device"``, each autotuned on its own; the host us to issue one call of each (a loop without a sync);
and the first call's wall time per variant (compile, unless Triton's cache has it, plus the autotune timing:
what a training run's first step pays per new shape; the device variant's autotune choice is kept on disk,
so a second run of this script reads it). Every output is checked against the dequantized product.
Writes DIR/sweep_gemm_fp8_tma_variants.txt. Decides ``PRIMUS_TURBO_FP8_TRITON_TMA``'s default.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, host_ms, run_sweep, tflops  # noqa: E402

from primus_turbo.triton.gemm.gemm_fp8_kernel import SCALE_ROWWISE, gemm_fp8_triton  # noqa: E402

SHAPES = [(8192, 2048, 2048), (8192, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096),
          (8192, 4096, 14336), (16384, 7168, 2048), (4096, 2048, 2048)]  # fmt: skip
VARIANTS = ("tma", "tma_device")
E4M3 = torch.float8_e4m3fn


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale_inv = x.abs().amax(1, keepdim=True).float().clamp_min(1e-12) / torch.finfo(E4M3).max
    return (x.float() / scale_inv).to(E4M3), scale_inv


def _first_call_s(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def sweep_case(shape, report) -> None:
    m0, n0, k0 = shape
    report.write(f"\n## {m0}x{n0}x{k0}\n\n")
    report.write("| GEMM | cuBLAS us | tma us | tma_device us | tma_device speedup | cuBLAS TFLOP/s | ")
    report.write("tma_device TFLOP/s | host us cuBLAS | host us tma | host us tma_device | ")
    report.write("first call s tma | first call s tma_device |\n")
    report.write("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    for name, m, n, k in (("fwd", m0, n0, k0), ("dgrad", m0, k0, n0), ("wgrad", n0, k0, m0)):
        a, a_s = _rowwise(torch.randn(m, k, device="cuda"))
        b, b_s = _rowwise(torch.randn(n, k, device="cuda"))
        ref = (a.float() * a_s) @ (b.float() * b_s).T
        fns = {"cublas": lambda a=a, b=b, a_s=a_s, b_s=b_s: torch._scaled_mm(
            a, b.T, scale_a=a_s, scale_b=b_s.T, out_dtype=torch.bfloat16)}  # fmt: skip
        first = {}
        for variant in VARIANTS:
            fns[variant] = lambda a=a, b=b, a_s=a_s, b_s=b_s, v=variant: gemm_fp8_triton(
                a, a_s, b, b_s, SCALE_ROWWISE, 0, torch.bfloat16, variant=v)  # fmt: skip
            first[variant] = _first_call_s(fns[variant])
        for key, fn in fns.items():
            err = (fn().float() - ref).norm() / ref.norm()
            if not err < 1e-2:
                raise AssertionError(f"{name} {key}: relative error {err:.3g} vs the dequantized product")
        gpu = {key: bench_ms(fn, warmup_ms=25, rep_ms=200)[0] * 1e3 for key, fn in fns.items()}
        host = {key: host_ms(fn, n=200, warmup=10) * 1e3 for key, fn in fns.items()}
        flop = 2.0 * m * n * k
        report.write(
            f"| {name} | {gpu['cublas']:.1f} | {gpu['tma']:.1f} | {gpu['tma_device']:.1f} | "
            f"{gpu['tma'] / gpu['tma_device']:.3f}x | {tflops(flop, gpu['cublas'] / 1e3):.0f} | "
            f"{tflops(flop, gpu['tma_device'] / 1e3):.0f} | {host['cublas']:.1f} | {host['tma']:.1f} | "
            f"{host['tma_device']:.1f} | {first['tma']:.2f} | {first['tma_device']:.2f} |\n"
        )


if __name__ == "__main__":
    title = "Triton FP8 rowwise GEMM: host vs device TMA descriptors"
    run_sweep(__doc__, "sweep_gemm_fp8_tma_variants", title, [(s,) for s in SHAPES], sweep_case)
