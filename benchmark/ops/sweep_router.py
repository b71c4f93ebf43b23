"""Router GPU time vs op time (a diagnosis tool, not a benchmark of record).

    python benchmark/ops/sweep_router.py [--out DIR]

At the bench_moe_ops routing sizes: the fused router's forward and backward kernels alone
(``triton.testing.do_bench_cudagraph``, no host overhead) over BLOCK_T, against the op as training
calls it (autograd forward, ``torch.autograd.grad`` backward; ``do_bench``, host included) for turbo
and for torch.compile of the eager math, plus the host time to issue one call. Where the kernels take
a few microseconds and the op tens, the op is bound by its launch path, not the GPU.
Writes DIR/sweep_router.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import host_ms, run_sweep  # noqa: E402

from primus_turbo.pytorch.kernels.moe.router_impl import _score_code, _split, router_forward_eager  # noqa: E402
from primus_turbo.pytorch.ops.moe.router import fused_topk_routing  # noqa: E402
from primus_turbo.triton.moe.router_kernel import router_block_t, router_bwd_kernel, router_fwd_kernel  # noqa: E402

# (tokens, experts, top-k, groups, top groups): DeepSeek-V3 and V2-Lite routing
SHAPES = [(4096, 256, 8, 8, 4), (16384, 256, 8, 8, 4), (8192, 64, 6, 1, 1), (32768, 64, 6, 1, 1)]


def _us(fn, graph: bool = True) -> float:
    return (
        tt.do_bench_cudagraph(fn, return_mode="median") if graph else tt.do_bench(fn, return_mode="median")
    ) * 1e3


def sweep_shape(t: int, e: int, k: int, g: int, kg: int, report: io.StringIO) -> None:
    torch._dynamo.reset()
    logits = torch.randn(t, e, device="cuda", requires_grad=True)
    bias = torch.randn(e, device="cuda") * 0.1
    kw = dict(score_function="sigmoid", num_groups=g, topk_groups=kg, scaling_factor=2.5, expert_bias=bias,
              norm_topk=True)  # fmt: skip
    score = _score_code("sigmoid", False, norm_topk=True)
    base, norm = _split(score)
    grad = torch.randn(t, e, device="cuda")
    probs = torch.empty(t, e, device="cuda")
    rmap = torch.empty(t, e, dtype=torch.int8, device="cuda")
    idx = torch.empty(t, k, dtype=torch.int64, device="cuda")
    dlogits = torch.empty_like(probs)
    x = logits.detach()
    report.write(f"\n### {t} x {e}, top-{k}, groups {g}/{kg} (shipped BLOCK_T {router_block_t(e)})\n\n")
    report.write("| BLOCK_T | warps | fwd kernel us | bwd kernel us |\n|---|---|---|---|\n")
    for block_t in (4, 8, 16):
        if block_t * triton.next_power_of_2(e) > 8192:
            continue
        for warps in (2, 4, 8):

            def fwd(block_t=block_t, warps=warps):
                router_fwd_kernel[(triton.cdiv(t, block_t),)](
                    x, bias, probs, rmap, idx, t, e, 2.5, SCORE=base, NORM=norm, HAS_BIAS=True, K=k, G=g,
                    KG=kg, BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(e),
                    BLOCK_G=triton.next_power_of_2(g), num_warps=warps,
                )  # fmt: skip

            def bwd(block_t=block_t, warps=warps):
                router_bwd_kernel[(triton.cdiv(t, block_t),)](
                    grad, x, rmap, dlogits, t, e, 2.5, SCORE=base, NORM=norm, K=k, BLOCK_T=block_t,
                    BLOCK_E=triton.next_power_of_2(e), num_warps=warps,
                )  # fmt: skip

            try:
                fwd()
                f_us, b_us = _us(fwd), _us(bwd)
            except Exception as exc:  # noqa: BLE001 (a variant that does not compile is a result too)
                report.write(f"| {block_t} | {warps} | {type(exc).__name__} | |\n")
                continue
            report.write(f"| {block_t} | {warps} | {f_us:.1f} | {b_us:.1f} |\n")

    def turbo(inp):
        return fused_topk_routing(inp, k, **kw)[0]

    def eager(inp):
        return router_forward_eager(inp, k, score, g, kg, 2.5, bias)[0]

    compiled = torch.compile(eager)
    report.write("\n| op | fwd us | bwd us | host fwd us | host bwd us |\n|---|---|---|---|---|\n")
    for label, fn in (("turbo", turbo), ("torch.compile", compiled)):
        out = fn(logits)

        def bwd_op(out=out):
            return torch.autograd.grad(out, [logits], grad, retain_graph=True)

        f_us = _us(lambda fn=fn: fn(logits), graph=False)
        b_us = _us(bwd_op, graph=False)
        hf, hb = (
            host_ms(lambda fn=fn: fn(logits), n=50, warmup=3) * 1e3,
            host_ms(bwd_op, n=50, warmup=3) * 1e3,
        )
        report.write(f"| {label} | {f_us:.1f} | {b_us:.1f} | {hf:.1f} | {hb:.1f} |\n")


def main() -> None:
    torch._functorch.config.donated_buffer = False  # the backward is timed repeatedly on one graph
    run_sweep(__doc__, "sweep_router", "router sweep", SHAPES, sweep_shape)


if __name__ == "__main__":
    main()
