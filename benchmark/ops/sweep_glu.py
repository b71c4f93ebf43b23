"""Launch-parameter sweep for the gated-activation kernels (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_glu.py [--out DIR]

GPU time per call (``triton.testing.do_bench_cudagraph``: no host overhead) of ``glu_fwd_kernel`` /
``glu_bwd_kernel`` with probs (SwiGLU) over (BLOCK_R, BLOCK_H, num_warps), at the MoE expert shapes
(DeepSeek-V3 4096 x top-8 tokens with I 2048, V2-Lite 8192 x top-6 with I 1408) and a dense FFN shape
(8192 tokens, I 14336, no probs); every variant's outputs are checked against the default's. The
same-run ceiling is the device-to-device copy of the row buffer, and ``launch_config``'s pick is
marked. Writes DIR/sweep_glu.txt.
"""

from __future__ import annotations

import io
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402

from primus_turbo.triton.activation.activation_kernel import (  # noqa: E402
    glu_bwd_kernel,
    glu_fwd_kernel,
    launch_config,
)

SHAPES = [(32768, 2048, True), (49152, 1408, True), (131072, 2048, True), (8192, 14336, False)]
VARIANTS = [
    (r, bh, w)
    for r, bh, w in itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8, 16))
    if r * bh <= 8192 and r * bh >= 32 * w
]


def _us(fn) -> float:
    return tt.do_bench_cudagraph(fn, return_mode="median") * 1e3


def sweep_shape(n: int, h: int, with_probs: bool, report: io.StringIO) -> None:
    x = torch.randn(n, 2 * h, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(n, device="cuda") if with_probs else x
    dy = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty_like(x)
    dp = torch.empty(n, device="cuda")
    fwd_bytes, bwd_bytes = 3 * n * h * 2, 5 * n * h * 2
    buf = torch.empty(n, 2 * h, device="cuda", dtype=torch.bfloat16)
    copy_us = _us(lambda: buf.copy_(x))
    copy_gbps = 2 * x.numel() * 2 / copy_us / 1e3

    def fwd(cfg):
        r, bh, w = cfg
        glu_fwd_kernel[(triton.cdiv(n, r),)](
            x,
            probs,
            out,
            n,
            h,
            x.stride(0),
            out.stride(0),
            ACT=0,
            HAS_PROBS=with_probs,
            BLOCK_R=r,
            BLOCK_H=bh,
            num_warps=w,
        )

    def bwd(cfg):
        r, bh, w = cfg
        glu_bwd_kernel[(triton.cdiv(n, r),)](
            dy,
            x,
            probs,
            dx,
            dp,
            n,
            h,
            dy.stride(0),
            x.stride(0),
            dx.stride(0),
            ACT=0,
            HAS_PROBS=with_probs,
            BLOCK_R=r,
            BLOCK_H=bh,
            num_warps=w,
        )

    picked = (launch_config(h), launch_config(h))  # forward, backward
    fwd(picked[0])
    bwd(picked[1])
    want = (out.clone(), dx.clone(), dp.clone())
    report.write(f"\n### {n} x {h} ({'probs' if with_probs else 'no probs'}); copy {copy_gbps:.0f} GB/s\n\n")
    report.write("| BLOCK_R | BLOCK_H | warps | fwd us | fwd %copy | bwd us | bwd %copy | equal | pick |\n")
    report.write("|---|---|---|---|---|---|---|---|---|\n")
    for cfg in VARIANTS:
        if cfg[1] > 2 * triton.next_power_of_2(h):
            continue
        try:
            out.zero_(), dx.zero_(), dp.zero_()
            fwd(cfg)
            bwd(cfg)
            ok = torch.equal(out, want[0]) and torch.equal(dx, want[1])
            ok = ok and (not with_probs or torch.allclose(dp, want[2], rtol=1e-5, atol=1e-3))
            f_us, b_us = _us(lambda cfg=cfg: fwd(cfg)), _us(lambda cfg=cfg: bwd(cfg))
        except Exception as exc:  # noqa: BLE001 (a variant that does not compile is a result too)
            report.write(f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {type(exc).__name__} | | | | | |\n")
            continue
        f_pct = 100 * fwd_bytes / f_us / 1e3 / copy_gbps
        b_pct = 100 * bwd_bytes / b_us / 1e3 / copy_gbps
        mark = "fwd" * (cfg == picked[0]) + "bwd" * (cfg == picked[1])
        report.write(
            f"| {cfg[0]} | {cfg[1]} | {cfg[2]} | {f_us:.1f} | {f_pct:.0f} | {b_us:.1f} | {b_pct:.0f} "
            f"| {ok} | {mark} |\n"
        )
        print(n, h, cfg, f"{f_us:.1f} {b_us:.1f}", ok, flush=True)


def main() -> None:
    run_sweep(__doc__, "sweep_glu", "glu kernel sweep", SHAPES, sweep_shape)


if __name__ == "__main__":
    main()
