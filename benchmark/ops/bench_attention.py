"""Attention fwd / bwd / fwd+bwd TFLOP/s: turbo (dispatcher, TRITON) vs every SDPA backend, same run.

Shapes: Llama3-8B (32 q heads, 8 kv heads, d128) and DeepSeek-V2-Lite MLA (16 heads, q/k 192, v 128),
causal, S in {2048, 4096, 8192, 16384} with B * S = 16384 tokens. For MLA the torch paths are SDPA
with v zero-padded to 192 (output sliced back), plus SDPA on the raw 192/128 shapes where a backend
takes them. FLOPs: fwd 2*B*H*S^2*(d_qk + d_v), bwd 2*B*H*S^2*(3*d_qk + 2*d_v) (recompute of QK^T,
dV, dP, dQ, dK), halved for causal.

    python benchmark/ops/bench_attention.py --quick     # 2 shapes, < 60 s on an H200
    python benchmark/ops/bench_attention.py             # 8 shapes, < 4 min
    torchrun --nproc_per_node=2 benchmark/ops/bench_attention.py --cp   # ring CP efficiency, S=16384
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, out_dir, print_table, tflops, write_csv  # noqa: E402

from primus_turbo.pytorch.core.backend import GlobalBackendManager  # noqa: E402
from primus_turbo.pytorch.kernels.attention.attention_impl import AttentionDispatcher  # noqa: E402
from primus_turbo.pytorch.ops.attention import flash_attn_func  # noqa: E402

COLUMNS = [
    "label", "backend", "B", "S", "Hq", "Hk", "D_qk", "D_v", "causal", "Check",
    "Forward TFLOPS", "Forward TFLOPS_stddev", "Backward TFLOPS", "Backward TFLOPS_stddev",
    "Fwd+Bwd TFLOPS", "Forward Time (ms)", "Backward Time (ms)", "out_snr", "dq_snr", "dk_snr", "dv_snr",
]  # fmt: skip
MODELS = {"llama3_8b": (32, 8, 128, 128), "dsv2_lite_mla": (16, 16, 192, 128)}
TOKENS = 16384
SNR_GATE_DB = 40.0


def _flops(b, s, hq, d_qk, d_v, causal):
    scale = 0.5 if causal else 1.0
    return 2 * b * hq * s * s * (d_qk + d_v) * scale, 2 * b * hq * s * s * (3 * d_qk + 2 * d_v) * scale


def _sdpa_fn(backend, pad_v_to=None):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        d_v = v.shape[-1]
        vv = F.pad(v, (0, pad_v_to - d_v)) if pad_v_to else v
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), vv.transpose(1, 2), is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2],
            )  # fmt: skip
        return out.transpose(1, 2)[..., :d_v]

    return run


def _turbo_fn(pin, auto_tune=False):
    def run(q, k, v):
        GlobalBackendManager.set_attention_backend(pin)
        GlobalBackendManager.set_auto_tune(auto_tune)
        try:
            return flash_attn_func(q, k, v, causal=True)
        finally:
            GlobalBackendManager.set_attention_backend(None)
            GlobalBackendManager.set_auto_tune(None)

    return run


def _candidates(d_qk, d_v):
    from torch.nn.attention import SDPBackend

    fns = {
        "turbo": _turbo_fn(None),
        "turbo_autotune": _turbo_fn(None, True),
        "turbo_triton": _turbo_fn("TRITON"),
    }
    sdpa = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    for name, backend in sdpa.items():
        fns[f"sdpa_{name}"] = _sdpa_fn(backend)
        if d_v != d_qk:
            fns[f"sdpa_{name}_padv"] = _sdpa_fn(backend, pad_v_to=d_qk)
    return fns


def _reference(q, k, v):
    """fp32 memory-efficient SDPA (no S x S matrix) as the accuracy reference."""
    from torch.nn.attention import SDPBackend

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    # The fused SDPA kernels of torch 2.11 take no GQA in fp32: repeat the kv heads (autograd sums
    # their gradients back); fall back to the math kernel where mem-efficient does not serve the dims.
    rep = q.shape[2] // k.shape[2]
    kk, vv = (t.repeat_interleave(rep, dim=2) for t in leaves[1:])
    try:
        out = _sdpa_fn(SDPBackend.EFFICIENT_ATTENTION)(leaves[0], kk, vv)
    except RuntimeError:
        out = _sdpa_fn(SDPBackend.MATH)(leaves[0], kk, vv)
    return out, leaves


def _snr(ref, out):
    err = (out.double() - ref.double()).pow(2).sum()
    return float(10 * torch.log10(ref.double().pow(2).sum() / err.clamp_min(1e-30)))


def bench_shape(model, s, check):
    hq, hk, d_qk, d_v = MODELS[model]
    b = max(1, TOKENS // s)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, s, hq, d_qk, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, s, hk, d_qk, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, s, hk, d_v, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(b, s, hq, d_v, device=dev, dtype=dt)
    fwd_flop, bwd_flop = _flops(b, s, hq, d_qk, d_v, True)
    ref = _reference(q, k, v) if check else None
    ref_grads = torch.autograd.grad(ref[0], ref[1], dout.float()) if check else None
    rows = []
    for name, fn in _candidates(d_qk, d_v).items():
        try:
            out = fn(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        except Exception as exc:  # a backend that does not serve the shape
            print(f"  {model} S={s} {name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
            continue
        used = AttentionDispatcher.last_backend.name if name.startswith("turbo") else name
        fwd_ms, fwd_sd = bench_ms(lambda fn=fn: fn(q, k, v))
        bwd_ms, bwd_sd = bench_ms(
            lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        )
        row = dict(label=model, backend=f"{name}({used})" if name.startswith("turbo") else name, B=b, S=s,
                   Hq=hq, Hk=hk, D_qk=d_qk, D_v=d_v, causal=True,
                   **{"Forward TFLOPS": tflops(fwd_flop, fwd_ms), "Backward TFLOPS": tflops(bwd_flop, bwd_ms),
                      "Forward TFLOPS_stddev": tflops(fwd_flop, fwd_ms) * fwd_sd / fwd_ms,
                      "Backward TFLOPS_stddev": tflops(bwd_flop, bwd_ms) * bwd_sd / bwd_ms,
                      "Fwd+Bwd TFLOPS": tflops(fwd_flop + bwd_flop, fwd_ms + bwd_ms),
                      "Forward Time (ms)": fwd_ms, "Backward Time (ms)": bwd_ms})  # fmt: skip
        if check:
            snrs = [_snr(r, x) for r, x in zip((ref[0], *ref_grads), (out, *grads))]
            row.update(out_snr=snrs[0], dq_snr=snrs[1], dk_snr=snrs[2], dv_snr=snrs[3])
            row["Check"] = "PASS" if min(snrs) >= SNR_GATE_DB else "FAIL"
        rows.append(row)
        del out, grads
    return rows


def _fixed_iters_ms(fn, iters=10, warmup=3):
    """Same iteration count on every rank (do_bench adapts its count per rank and would hang CP)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def bench_ring_cp(args):
    """Ring CP (zigzag, causal, TRITON blocks) vs single-GPU TRITON on the full sequence, Llama3-8B."""
    import os

    import torch.distributed as dist

    from primus_turbo.pytorch.ops.attention import flash_attn_usp_func, split_sequence_for_cp

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    hq, hk, d_qk, d_v = MODELS["llama3_8b"]
    rows = []
    for s in [16384] if args.quick else [8192, 16384, 32768]:
        torch.manual_seed(0)
        full = [
            torch.randn(1, s, h, dd, device="cuda", dtype=torch.bfloat16)
            for h, dd in ((hq, d_qk), (hk, d_qk), (hk, d_v))
        ]
        dout = torch.randn(1, s, hq, d_v, device="cuda", dtype=torch.bfloat16)
        local = [split_sequence_for_cp(t, 1, world, rank).contiguous().requires_grad_() for t in full]
        local_dout = split_sequence_for_cp(dout, 1, world, rank).contiguous()

        def ring_step(local=local, local_dout=local_dout):
            out = flash_attn_usp_func(*local, causal=True, ring_group=dist.group.WORLD)
            torch.autograd.grad(out, local, local_dout)

        ring_ms = _fixed_iters_ms(ring_step)
        leaves = [t.clone().requires_grad_() for t in full]
        GlobalBackendManager.set_attention_backend("TRITON")

        def single_step(leaves=leaves, dout=dout):
            out = flash_attn_func(*leaves, causal=True)
            torch.autograd.grad(out, leaves, dout)

        single_ms = _fixed_iters_ms(single_step)
        GlobalBackendManager.set_attention_backend(None)
        fwd_flop, bwd_flop = _flops(1, s, hq, d_qk, d_v, True)
        row = {"S": s, "world": world, "ring fwd+bwd ms": ring_ms, "single fwd+bwd ms": single_ms,
               "ring TFLOPS/GPU": tflops((fwd_flop + bwd_flop) / world, ring_ms),
               "single TFLOPS": tflops(fwd_flop + bwd_flop, single_ms),
               "per-GPU efficiency": single_ms / (ring_ms * world)}  # fmt: skip
        rows.append(row)
    if rank == 0:
        write_csv(out_dir(args) / "attention_ring_cp.csv", rows)
        print_table(rows, list(rows[0]))
    dist.destroy_process_group()


def main():
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--cp", action="store_true", help="ring context-parallel run (under torchrun)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device")
    if args.cp:
        return bench_ring_cp(args)
    seqs = [4096] if args.quick else [2048, 4096, 8192, 16384]
    rows = []
    for model in MODELS:
        for s in seqs:
            rows += bench_shape(model, s, check=True)
            torch.cuda.empty_cache()
    write_csv(out_dir(args) / "attention.csv", rows, COLUMNS)
    print_table(
        rows, ["label", "backend", "S", "Check", "Forward TFLOPS", "Backward TFLOPS", "Fwd+Bwd TFLOPS"]
    )
    _print_ratios(rows)


def _print_ratios(rows):
    """Turbo dispatcher and TRITON vs the best torch path per shape (targets in the module issue)."""
    print("\nspeedup vs best torch (SDPA) path, fwd+bwd:")
    for key in sorted({(r["label"], r["S"]) for r in rows}):
        group = [r for r in rows if (r["label"], r["S"]) == key]
        torch_best = max((r["Fwd+Bwd TFLOPS"] for r in group if r["backend"].startswith("sdpa")), default=0.0)
        for r in group:
            if r["backend"].startswith("turbo") and torch_best > 0:
                ratio = r["Fwd+Bwd TFLOPS"] / torch_best
                print(f"  {key[0]:>14} S={key[1]:>5} {r['backend']:>22}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
