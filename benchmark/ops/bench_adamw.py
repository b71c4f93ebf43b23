"""One optimizer step with gradient clipping at deepseek_moe_fp8 parameter shapes (fp32 parameters, gradients
and moments, as TorchTitan keeps them on one GPU):

  torch fused AdamW + clip    torch.nn.utils.get_total_norm + clip_grads_with_norm_ (a _foreach_mul_ over the
                              gradients) + torch.optim.AdamW(fused=True).step()   (TorchTitan's step)
  turbo AdamW, clip fused     the same norm, then turbo.optim.AdamW.step(grad_scale=factor): one Triton pass
                              per parameter, the gradients read once and never written

Also each step without the clip. GB/s counts the ideal traffic (28 bytes per element for AdamW, + 8 for the
clip's multiply; the norm's 4 bytes per element are in both rows' time, not in their bytes).

    python benchmark/ops/bench_adamw.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, copy_bandwidth, gbps, out_dir, print_table, write_csv  # noqa: E402

from primus_turbo.pytorch.optim import AdamW  # noqa: E402

# one MoE layer's experts (w1, w2, w3), attention and shared-expert weights, the embedding, norms
SHAPES = [(64, 1408, 2048), (64, 2048, 1408), (64, 1408, 2048), (102400, 2048), (3072, 2048), (2048, 2048),
          (576, 2048), (4096, 512), (2048, 2816), (2816, 2048), (2048,), (512,), (2048,)]  # fmt: skip
KW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 1.0


def _params(shapes):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    return params


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    shapes = SHAPES[:6] if args.quick else SHAPES
    elems = sum(torch.Size(s).numel() for s in shapes)
    ref, ours = _params(shapes), _params(shapes)
    torch_opt = torch.optim.AdamW(ref, fused=True, **KW)
    turbo_opt = AdamW(ours, **KW)

    def factor(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        return norm, (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)

    def torch_clip_step():
        norm, _ = factor(ref)
        torch.nn.utils.clip_grads_with_norm_(ref, MAX_NORM, norm, foreach=True)
        torch_opt.step()

    def turbo_clip_step():
        _, scale = factor(ours)
        turbo_opt.step(grad_scale=scale)

    # one step each from the same start: the same parameters up to fp32 rounding
    torch_clip_step()
    turbo_clip_step()
    err = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(ours, ref))
    check = "PASS" if err < 1e-5 and turbo_opt.turbo_steps == len(ours) else f"FAIL {err:.1e}"
    candidates = {
        "torch fused AdamW + clip (TorchTitan)": (torch_clip_step, 36, ""),
        "turbo AdamW, clip fused": (turbo_clip_step, 28, check),
        "torch fused AdamW (no clip)": (lambda: torch_opt.step(), 28, ""),
        "turbo AdamW (no clip)": (lambda: turbo_opt.step(), 28, ""),
    }
    rows, base = [], None
    for label, (fn, nbytes, status) in candidates.items():
        ms, std = bench_ms(fn, warmup_ms=50, rep_ms=300)
        base = base or ms
        rows.append({"label": label, "elements (M)": elems / 1e6, "Check": status, "ms": ms, "ms_stddev": std,
                     "GB/s": gbps(elems * nbytes, ms), "speedup vs TorchTitan": base / ms})  # fmt: skip
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_bandwidth():.0f} GB/s")
    print_table(rows, ["label", "elements (M)", "Check", "ms", "GB/s", "speedup vs TorchTitan"])
    write_csv(out_dir(args) / f"adamw{'_quick' if args.quick else ''}.csv", rows)


if __name__ == "__main__":
    main()
