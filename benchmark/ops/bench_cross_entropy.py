"""Cross-entropy over the vocabulary, forward and backward: turbo.ops.cross_entropy vs Megatron-Core's
vocab_parallel_cross_entropy (the stock Megatron loss, TP=1), torch eager F.cross_entropy on the fp32 logits
(what TorchTitan runs) and torch.compile of it; same process, same bf16 logits, plus the copy bandwidth.

    python benchmark/ops/bench_cross_entropy.py --quick   # 2 shapes
    python benchmark/ops/bench_cross_entropy.py           # 4 shapes

Bytes: forward reads the logits once; backward reads them and writes the gradient (the floor of a fused
kernel; the unfused paths move several times that). "Check": turbo loss and gradient vs the fp32 math at
the bf16 tolerance. Backward time is (forward + backward from a fresh forward) - forward.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    MEMORY_COLUMNS,
    bench_ms,
    bench_parser,
    copy_bandwidth,
    gbps,
    host_ms,
    out_dir,
    print_table,
    write_csv,
)

from primus_turbo.pytorch.ops.cross_entropy import cross_entropy  # noqa: E402


def shapes(quick: bool) -> list[tuple[int, int]]:
    """(tokens, vocab): DeepSeek-V2-Lite (102400) and Llama-3 (128256) at 4096 tokens, Llama-2 (32000)
    and GPT-2 (50257) at 8192."""
    full = [(4096, 102400), (4096, 128256), (8192, 32000), (8192, 50257)]
    return full[:2] if quick else full


def _megatron_loss():
    """Megatron-Core's vocab_parallel_cross_entropy on a 1-rank group, or None without megatron."""
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    except ImportError:
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return vocab_parallel_cross_entropy


def candidates() -> dict:
    def torch_eager(x, t):
        return F.cross_entropy(x.float(), t, reduction="none")

    out = {"turbo cross_entropy": lambda x, t: cross_entropy(x, t)}
    megatron = _megatron_loss()
    if megatron is not None:
        out["megatron vocab_parallel_cross_entropy"] = megatron
    out["torch eager (F.cross_entropy fp32)"] = torch_eager
    out["torch.compile"] = torch.compile(torch_eager, dynamic=False)
    return out


def run_shape(tokens: int, vocab: int) -> list[dict]:
    torch._dynamo.reset()
    logits = (torch.randn(tokens, vocab, device="cuda") * 4).to(torch.bfloat16).requires_grad_(True)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    grad = torch.rand(tokens, device="cuda")
    ref_x = logits.detach().float().requires_grad_(True)
    ref = F.cross_entropy(ref_x, target, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref, ref_x, grad)
    elem = logits.element_size()
    fwd_bytes, bwd_bytes = tokens * vocab * elem, 2 * tokens * vocab * elem
    rows = []
    for label, fn in candidates().items():
        x = logits.detach().clone().requires_grad_(True)
        loss = fn(x, target)
        status = ""
        if label.startswith("turbo"):
            (g,) = torch.autograd.grad(loss, x, grad, retain_graph=True)
            ok = torch.allclose(loss, ref, rtol=1e-2, atol=1e-2)
            ok = ok and torch.allclose(g.float(), ref_grad, rtol=1e-2, atol=1e-2)
            status = "PASS" if ok else "FAIL"
        fwd_ms, _ = bench_ms(lambda fn=fn, x=x: fn(x, target))
        # fwd+bwd from a fresh forward each time: Megatron's backward updates its saved softmax in place,
        # so a retained graph cannot be replayed; backward = (fwd+bwd) - fwd
        total_ms, _ = bench_ms(lambda fn=fn, x=x: torch.autograd.grad(fn(x, target), x, grad))
        bwd_ms = total_ms - fwd_ms
        rows.append(
            {
                "label": label,
                "shape": f"{tokens}x{vocab}",
                "dtype": "bfloat16",
                "Check": status,
                "Forward GB/s": gbps(fwd_bytes, fwd_ms),
                "Forward Time (ms)": fwd_ms,
                "Backward GB/s": gbps(bwd_bytes, bwd_ms),
                "Backward Time (ms)": bwd_ms,
                "fwd+bwd (ms)": total_ms,
                "host fwd us": 1e3 * host_ms(lambda fn=fn, x=x: fn(x, target)),
                "peak MB": _peak_mb(fn, x, target, grad),
            }
        )
        del loss, x
    base = {r["label"]: r["fwd+bwd (ms)"] for r in rows}
    stock = base.get("megatron vocab_parallel_cross_entropy", base["torch eager (F.cross_entropy fp32)"])
    for r in rows:
        r["speedup vs stock"] = stock / r["fwd+bwd (ms)"]
        r["speedup vs compile"] = base["torch.compile"] / r["fwd+bwd (ms)"]
    return rows


def _peak_mb(fn, x, target, grad) -> float:
    """Peak memory above the inputs during one forward + backward (saved state + temporaries)."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fn(x, target)
    torch.autograd.grad(loss, x, grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - start) / 2**20


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cross_entropy: needs a CUDA device")
    copy_gbps = copy_bandwidth()
    rows = []
    for tokens, vocab in shapes(args.quick):
        rows += run_shape(tokens, vocab)
    for r in rows:
        r["fwd %copy"] = 100 * r["Forward GB/s"] / copy_gbps
        r["bwd %copy"] = 100 * r["Backward GB/s"] / copy_gbps
    extra = ["fwd+bwd (ms)", "speedup vs stock", "speedup vs compile", "fwd %copy", "bwd %copy", "peak MB"]
    name = "cross_entropy_quick.csv" if args.quick else "cross_entropy.csv"
    write_csv(out_dir(args) / name, rows, MEMORY_COLUMNS + extra + ["host fwd us"])
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    table = ["label", "shape", "Check", "Forward Time (ms)", "Backward Time (ms)", "fwd %copy", "bwd %copy"]
    print_table(rows, table + ["speedup vs stock", "speedup vs compile", "peak MB"])


if __name__ == "__main__":
    main()
