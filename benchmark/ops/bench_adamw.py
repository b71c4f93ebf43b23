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

``--recipe``: only turbo's Megatron step (clip and bf16 cast fused, 30 bytes per element) over the real
parameter list of Megatron ``deepseek_moe_fp8`` on one GPU (426 tensors, 2.25B elements: 384 per-expert
weights of 5.8M / 2.9M, the embedding and LM head of 210M), once as separate tensors and once with every
state kind (masters, gradients, moments, bf16 weights) as views of one buffer, then the same elements as 13
large tensors, and torch's Megatron step (fused AdamW, clip, one cast per parameter) over the recipe's list as
the baseline: whether the kernel's 63% of copy in that recipe's profile (25.3 ms per step, session 36,
against ~80% in the rows above) comes from the tensor list, the buffer layout or the recipe's GPU state.
Then the kernel alone over the separate-tensor state at 2048 / 4096 / 8192 elements per program.
``--variants ROUNDS``: only those kernel rows, ROUNDS times in turn, and torch's Megatron step as the baseline
(session 37 chose 2048 with them; a
per-block tensor index in place of the table search, measured then too, was 2-4% slower and is gone).

    python benchmark/ops/bench_adamw.py [--quick | --recipe | --variants ROUNDS]
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
from primus_turbo.triton.optim import adamw_kernel as ak  # noqa: E402

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


def recipe_shapes() -> list[tuple[int, ...]]:
    """Megatron ``deepseek_moe_fp8``'s parameters on one GPU, in model order: 4 layers (the first dense), MLA
    without a q LoRA, 64 experts of 1408 (fc1 gated) and two shared ones as one 2816 MLP per MoE layer."""
    attention = [(2048,), (3072, 2048), (576, 2048), (512,), (4096, 512), (2048, 2048), (2048,)]
    shapes = [(102400, 2048)]
    for layer in range(4):
        shapes += attention
        if layer == 0:
            shapes += [(21888, 2048), (2048, 10944)]
        else:
            shapes += [(64, 2048)] + [(2816, 2048), (2048, 1408)] * 64 + [(5632, 2048), (2048, 2816)]
    return shapes + [(2048,), (102400, 2048)]


def _turbo_state(shapes, flat: bool, device: str = "cuda", turbo: bool = True):
    """Turbo's AdamW with clip + bf16 copies over fresh random state, allocated per tensor or as views of one
    buffer per kind (Megatron's grad buffer and distributed-optimizer shards are views). ``turbo=False``:
    torch's fused AdamW over the same state, the bf16 copies returned for the caller's cast (the baseline)."""
    sizes = [torch.Size(s).numel() for s in shapes]
    gen = torch.Generator(device=device).manual_seed(0)

    def tensors(dtype):
        if not flat:
            return [torch.randn(s, device=device, generator=gen).to(dtype) for s in shapes]
        buf = torch.randn(sum(sizes), device=device, generator=gen).to(dtype)
        return [t.view(s) for t, s in zip(buf.split(sizes), shapes)]

    params = [torch.nn.Parameter(t) for t in tensors(torch.float32)]
    for p, g in zip(params, tensors(torch.float32)):
        p.grad = g
    opt = AdamW(params, **KW) if turbo else torch.optim.AdamW(params, fused=True, **KW)
    step = torch.tensor(1.0, device="cpu" if turbo else device)  # torch's fused step reads it on the device
    for p, m, v in zip(params, tensors(torch.float32), tensors(torch.float32)):
        opt.state[p].update(exp_avg=m.abs_(), exp_avg_sq=v.square_(), step=step.clone())
    copies = tensors(torch.bfloat16)
    if turbo:
        opt.set_param_copies(zip(params, copies))
        return params, opt
    return params, opt, copies


def _torch_recipe_row(shapes) -> dict:
    """The baseline in the same run: Megatron's step as torch does it (norm, clip's foreach multiply, fused
    AdamW, one bf16 copy_ per parameter), 42 bytes per element as in the rows above."""
    params, opt, copies = _turbo_state(shapes, False, turbo=False)

    def step():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm, foreach=True)
        opt.step()
        for copy, master in zip(copies, params):
            copy.copy_(master)

    ms, std = bench_ms(step, warmup_ms=50, rep_ms=300)
    n = sum(p.numel() for p in params)
    return {"label": "torch fused AdamW + clip + bf16 cast (Megatron) [recipe, separate tensors]",
            "elements (M)": n / 1e6, "tensors": len(params), "Check": "", "ms": ms, "ms_stddev": std,
            "host ms": host_ms(step), "GB/s": gbps(n * 42, ms)}  # fmt: skip


def _recipe_row(label: str, shapes, flat: bool) -> dict:
    params, opt = _turbo_state(shapes, flat)
    scale = torch.full((1,), 0.5, device="cuda")

    def step():
        opt.step(grad_scale=scale)

    step()
    status = "PASS" if opt.turbo_steps == len(params) else "FAIL (torch fallback)"
    ms, std = bench_ms(step, warmup_ms=50, rep_ms=300)
    n = sum(p.numel() for p in params)
    return {"label": f"turbo AdamW, clip and bf16 cast fused [{label}]", "elements (M)": n / 1e6,
            "tensors": len(params), "Check": status, "ms": ms, "ms_stddev": std, "host ms": host_ms(step),
            "GB/s": gbps(n * 30, ms)}  # fmt: skip


BLOCKS = (2048, 4096, 8192)  # elements per program


def _kernel_variant_rows(shapes, device: str = "cuda", rounds: int = 1) -> list[dict]:
    """``launch_adamw`` alone over the recipe's state (separate tensors, with clip factor and bf16 copies) at
    each of ``BLOCKS`` elements per program; the variants step the same state in turn (the numbers move, the
    bytes do not). ``rounds``: the variants run in turn that many times (one row each per round: the spread
    between rounds is the clock's)."""
    params, opt = _turbo_state(shapes, False, device)
    scale = torch.full((1,), 0.5, device=device)
    states = [opt.state[p] for p in params]
    copies = [opt._copies[p] for p in params]
    grads = [p.grad for p in params]
    n = sum(p.numel() for p in params)
    dtypes = (torch.float32, torch.float32, torch.float32, torch.bfloat16)
    hyper = {"lr": KW["lr"], "beta1": KW["betas"][0], "beta2": KW["betas"][1], "eps": KW["eps"],
             "weight_decay": KW["weight_decay"]}  # fmt: skip
    steps = []
    for block in BLOCKS:
        moments = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        table_rows, blocks, aligned = ak.adamw_table(params, grads, *moments, copies, block=block)
        table = torch.tensor(table_rows, dtype=torch.int64, device=device)

        def step(table=table, blocks=blocks, aligned=aligned, block=block):
            ak.launch_adamw(table, len(params), blocks, dtypes, scale, **hyper, step=10, aligned=aligned,
                            block=block)  # fmt: skip

        steps.append((f"kernel only, {block} per program [recipe, separate tensors]", step))
    rows = []
    for round_ in range(rounds):
        for label, step in steps:
            ms, std = bench_ms(step, warmup_ms=50, rep_ms=300)
            suffix = f" round {round_ + 1}" if rounds > 1 else ""
            rows.append({"label": label + suffix, "elements (M)": n / 1e6, "tensors": len(params),
                         "Check": "", "ms": ms, "ms_stddev": std, "host ms": host_ms(step),
                         "GB/s": gbps(n * 30, ms)})  # fmt: skip
    return rows


def _recipe_rows() -> list[dict]:
    shapes = recipe_shapes()
    elems = sum(torch.Size(s).numel() for s in shapes)
    rows = []
    for label, layout, flat in (
        ("recipe, separate tensors", shapes, False),
        ("recipe, views of one buffer", shapes, True),
        ("same elements, 13 tensors", [(elems // 13,)] * 13, False),
    ):
        rows.append(_recipe_row(label, layout, flat))
        torch.cuda.empty_cache()
    rows += _kernel_variant_rows(shapes)
    torch.cuda.empty_cache()
    rows.append(_torch_recipe_row(shapes))  # state allocated after turbo's is freed: ~50 GB at a time
    return rows


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--recipe", action="store_true", help="only the deepseek_moe_fp8 parameter list rows")
    parser.add_argument("--variants", type=int, default=0, metavar="ROUNDS",
                        help="only the kernel variants over the recipe's tensors, ROUNDS times in turn")
    args = parser.parse_args()
    if args.variants:
        rows = _kernel_variant_rows(recipe_shapes(), rounds=args.variants)
        torch.cuda.empty_cache()
        rows.append(_torch_recipe_row(recipe_shapes()))  # the same-run baseline
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_bandwidth():.0f} GB/s")
        print_table(rows, ["label", "ms", "host ms", "GB/s"])
        write_csv(out_dir(args) / "adamw_variants.csv", rows)
        return
    if args.recipe:
        rows = _recipe_rows()
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_bandwidth():.0f} GB/s")
        print_table(rows, ["label", "elements (M)", "tensors", "Check", "ms", "host ms", "GB/s"])
        write_csv(out_dir(args) / "adamw_recipe.csv", rows)
        return
    rows = _rows(SHAPES[:6] if args.quick else SHAPES, "")
    rows += _rows([(65536,)] * 426, " [426 x 64K]")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy {copy_bandwidth():.0f} GB/s")
    columns = ["label", "elements (M)", "tensors", "Check", "ms", "host ms", "GB/s", "speedup vs TorchTitan"]
    print_table(rows, columns)
    write_csv(out_dir(args) / f"adamw{'_quick' if args.quick else ''}.csv", rows)


if __name__ == "__main__":
    main()
