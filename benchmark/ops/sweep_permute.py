"""Launch-parameter sweep for the permute's helper kernels (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_permute.py [--out DIR]

GPU time per call with ``triton.testing.do_bench_cudagraph`` (no host overhead), each variant checked
against the default's output:
- the row-id map (``_build_row_id_map_triton``) at DeepSeek-V3 / V2-Lite routing sizes vs the torch reference;
- ``unpermute_bwd_probs_kernel`` (BLOCK_K x BLOCK_H tile, routes per program, num_warps) at DeepSeek-V3
  and V2-Lite sizes.
Writes DIR/sweep_permute.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402

import primus_turbo.pytorch.kernels.moe.permute_impl as pi  # noqa: E402
from primus_turbo.triton.moe.permute_kernel import unpermute_bwd_probs_kernel  # noqa: E402


def _us(fn) -> float:
    return tt.do_bench_cudagraph(fn, return_mode="median") * 1e3


def sweep_map(report: io.StringIO) -> None:
    report.write("| T, E, K | torch us | triton us | csrc us | equal |\n|---|---|---|---|---|\n")
    for t, e, k in [(4096, 256, 8), (16384, 256, 8), (4096, 64, 6), (32768, 64, 6), (16384, 8, 2)]:
        idx = torch.rand(t, e, device="cuda").topk(k, -1).indices
        want = pi._build_row_id_map_torch(idx, e, t * k, 0, None)[0]
        args = (idx, e, t * k, 0, None)
        ref_us = _us(lambda args=args: pi._build_row_id_map_torch(*args))
        ok = torch.equal(pi._build_row_id_map_triton(*args)[0], want)
        us = _us(lambda args=args: pi._build_row_id_map_triton(*args))
        cpp_us = "n/a"
        if pi._cpp_map_can_run(idx, e):
            ok = ok and torch.equal(pi._build_row_id_map_cpp(*args)[0], want)
            cpp_us = f"{_us(lambda args=args: pi._build_row_id_map_cpp(*args)):.1f}"
        report.write(f"| {t}, {e}, {k} | {ref_us:.1f} | {us:.1f} | {cpp_us} | {ok} |\n")


def sweep_unpermute_bwd(report: io.StringIO) -> None:
    for t, e, k, h in [(4096, 256, 8, 7168), (16384, 256, 8, 7168), (8192, 64, 6, 2048)]:
        _sweep_unpermute_bwd_shape(report, t, e, k, h)


def _sweep_unpermute_bwd_shape(report: io.StringIO, t: int, e: int, k: int, h: int) -> None:
    idx = torch.rand(t, e, device="cuda").topk(k, -1).indices
    rid, _, n = pi.build_row_id_map(idx, e, t * k, 0, None)
    y = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(t, k, device="cuda")
    want_y, want_p = pi.moe_unpermute_bwd_probs(g, y, rid, probs)
    nbytes = t * h * 2 + 2 * n * h * 2
    shipped = pi.unpermute_bwd_probs_config(k, h)
    report.write(f"\n### unpermute+probs backward kernel, {t} x {h}, E{e} top-{k} (shipped: {shipped})\n\n")
    report.write("| BLOCK_K | BLOCK_H | routes/program | warps | us | GB/s | equal |\n")
    report.write("|---|---|---|---|---|---|---|\n")
    full_h = triton.next_power_of_2(h)
    variants = [shipped, (8, 512, k, 4), (8, 1024, k, 8), (2, 2048, 2, 8), (2, 2048, 4, 8),
                (4, 1024, 4, 8), (1, 4096, 1, 8), (1, full_h, 1, 8), (1, full_h, 1, 16),
                (2, full_h // 2, 2, 8), (1, 2048, 1, 4), (2, 4096, 2, 16), (4, 2048, 4, 16)]  # fmt: skip
    for block_k, block_h, routes, warps in dict.fromkeys(variants):
        if block_k > triton.next_power_of_2(k) or block_h > full_h:
            continue
        gy = torch.empty_like(y)
        gp = torch.empty(rid.shape, dtype=torch.float32, device="cuda")
        cov = torch.zeros(n, dtype=torch.int8, device="cuda")

        def run(block_k=block_k, block_h=block_h, routes=routes, warps=warps, gy=gy, gp=gp, cov=cov):
            unpermute_bwd_probs_kernel[(t, triton.cdiv(k, routes))](
                g, y, rid, probs, gy, gp, cov, h, k, g.stride(0), y.stride(0), routes,
                BLOCK_K=block_k, BLOCK_H=block_h, num_warps=warps,
            )  # fmt: skip

        try:
            run()
            ok = torch.equal(gy[cov.bool()], want_y[cov.bool()])
            ok = ok and torch.allclose(gp, want_p, rtol=1e-5, atol=1e-3)
            us = _us(run)
        except Exception as exc:  # noqa: BLE001 (a variant that does not compile is a result too)
            report.write(f"| {block_k} | {block_h} | {routes} | {warps} | {type(exc).__name__} | | |\n")
            continue
        gbps = nbytes / us / 1e3
        report.write(f"| {block_k} | {block_h} | {routes} | {warps} | {us:.1f} | {gbps:.0f} | {ok} |\n")
    full_us = _us(lambda: pi.moe_unpermute_bwd_probs(g, y, rid, probs))
    report.write(f"\nmoe_unpermute_bwd_probs as shipped (kernel, flags, zeroing): {full_us:.1f} us\n")


def main() -> None:
    torch.manual_seed(0)
    parts = [(sweep_map,), (sweep_unpermute_bwd,)]
    run_sweep(__doc__, "sweep_permute", "permute helper kernels", parts, lambda part, report: part(report))


if __name__ == "__main__":
    main()
