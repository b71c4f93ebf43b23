"""One optimizer step with gradient clipping at deepseek_moe_fp8 parameter shapes (fp32 parameters, gradients
and moments, as TorchTitan keeps them on one GPU):

  torch fused AdamW + clip    torch.nn.utils.get_total_norm + clip_grads_with_norm_ (a _foreach_mul_ over the
                              gradients) + torch.optim.AdamW(fused=True).step()   (TorchTitan's step)
  turbo AdamW, clip fused     the same norm, then turbo.optim.AdamW.step(grad_scale=factor): one Triton pass
                              over every parameter (one launch), the gradients read once and never written

Also each step without the clip, and Megatron's mixed-precision step (fp32 masters, bf16 model weights):

  torch ... + bf16 cast       the clip and fused step, then the masters cast into the bf16 weights, one
                              copy_ each (Megatron's DistributedOptimizer)
  turbo ..., cast fused       set_param_copies: the same pass writes the bf16 weights (+2 bytes per element)

GB/s counts the ideal traffic (28 bytes per element for AdamW, + 8 for the clip's multiply, + 6 for a
separate cast or 2 for a fused one; the norm's 4 bytes per element are in both rows' time, not in their
bytes). "host ms": the time to issue one step, against "ms" on the GPU. The same rows then run on 426
tensors of 64K elements (Megatron's parameter count for the deepseek proxy; small: bound by the launches).

    python benchmark/ops/bench_adamw.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    bench_ms,
    bench_parser,
    copy_bandwidth,
    gbps,
    host_ms,
    out_dir,
    print_table,
    write_csv,
)

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


def _rows(shapes, label: str) -> list[dict]:
    elems = sum(torch.Size(s).numel() for s in shapes)
    ref, ours = _params(shapes), _params(shapes)
    torch_opt = torch.optim.AdamW(ref, fused=True, **KW)
    turbo_opt = AdamW(ours, **KW)
    ref_bf16 = [p.detach().to(torch.bfloat16) for p in ref]
    ours_bf16 = [p.detach().to(torch.bfloat16) for p in ours]

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

    def torch_clip_step_cast():
        torch_clip_step()
        for model, master in zip(ref_bf16, ref):  # as Megatron's DistributedOptimizer: one copy_ each
            model.copy_(master)

    # one step each from the same start: the same parameters up to fp32 rounding
    torch_clip_step()
    turbo_clip_step()
    err = max(((p - q).abs().max() / q.abs().max()).item() for p, q in zip(ours, ref))
    check = "PASS" if err < 1e-5 and turbo_opt.turbo_steps == len(ours) else f"FAIL {err:.1e}"
    turbo_opt.set_param_copies(zip(ours, ours_bf16))
    torch_clip_step_cast()
    turbo_clip_step()
    exact = all(torch.equal(c, p.detach().to(torch.bfloat16)) for p, c in zip(ours, ours_bf16))
    cast_check = check if exact else "FAIL cast"
    turbo_opt.set_param_copies([])
    candidates = {
        "torch fused AdamW + clip (TorchTitan)": (torch_clip_step, 36, ""),
        "turbo AdamW, clip fused": (turbo_clip_step, 28, check),
        "torch fused AdamW (no clip)": (lambda: torch_opt.step(), 28, ""),
        "turbo AdamW (no clip)": (lambda: turbo_opt.step(), 28, ""),
        "torch fused AdamW + clip + bf16 cast (Megatron)": (torch_clip_step_cast, 42, ""),
        "turbo AdamW, clip and bf16 cast fused": (turbo_clip_step, 30, cast_check),
    }
    rows, base = [], None
    for name, (fn, nbytes, status) in candidates.items():
        if name.startswith("turbo AdamW, clip and"):
            turbo_opt.set_param_copies(zip(ours, ours_bf16))
        ms, std = bench_ms(fn, warmup_ms=50, rep_ms=300)
        base = base or ms
        rows.append({"label": f"{name}{label}", "elements (M)": elems / 1e6, "tensors": len(shapes),
                     "Check": status, "ms": ms, "ms_stddev": std, "host ms": host_ms(fn),
                     "GB/s": gbps(elems * nbytes, ms), "speedup vs TorchTitan": base / ms})  # fmt: skip
    return rows


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    rows = _rows(SHAPES[:6] if args.quick else SHAPES, "")
    rows += _rows([(65536,)] * 426, " [426 x 64K]")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_bandwidth():.0f} GB/s")
    columns = ["label", "elements (M)", "tensors", "Check", "ms", "host ms", "GB/s", "speedup vs TorchTitan"]
    print_table(rows, columns)
    write_csv(out_dir(args) / f"adamw{'_quick' if args.quick else ''}.csv", rows)


if __name__ == "__main__":
    main()
