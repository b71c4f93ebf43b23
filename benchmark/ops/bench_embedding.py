"""Word-embedding backward into Megatron's fp32 main_grad, per micro-batch: turbo.ops.embedding (the token
gradient rows summed straight into main_grad, deterministic) vs the stock pair (F.embedding's dense [V, H]
weight gradient, then DDP's ``main_grad.add_(grad)``) and the same pair with ``index_add_`` (atomic, not
deterministic); same process, same bf16 gradient, plus the copy bandwidth.

    python benchmark/ops/bench_embedding.py --quick   # deepseek_moe (102400 x 2048, 4096 tokens)
    python benchmark/ops/bench_embedding.py           # + Llama-3 8B (128256 x 4096) and 16384 tokens

Time: one backward from a retained forward (embedding backward + accumulation), median of do_bench.
"Check": main_grad after one turbo backward vs the float64 sum, at the fp32 tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, copy_bandwidth, host_ms, out_dir, print_table, write_csv  # noqa: E402

from primus_turbo.pytorch.ops.embedding import embedding  # noqa: E402


def shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(tokens, vocab, hidden)."""
    full = [(4096, 102400, 2048), (4096, 128256, 4096), (16384, 102400, 2048)]
    return full[:1] if quick else full


def run_shape(tokens: int, vocab: int, hidden: int) -> list[dict]:
    weight = (torch.randn(vocab, hidden, device="cuda") * 0.02).bfloat16().requires_grad_(True)
    weight.main_grad = torch.zeros(vocab, hidden, device="cuda")
    weight.grad_added_to_main_grad = False
    ids = torch.randint(0, vocab, (1, tokens), device="cuda")
    grad = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16)

    turbo_out = embedding(ids, weight, accumulate_into_main_grad=True)
    stock_out = F.embedding(ids, weight)

    def turbo():
        torch.autograd.grad(turbo_out, weight, grad, retain_graph=True)

    def stock():
        (g,) = torch.autograd.grad(stock_out, weight, grad, retain_graph=True)
        weight.main_grad.add_(g)

    def index_add():
        weight.main_grad.index_add_(0, ids.view(-1), grad.view(-1, hidden).float())

    weight.main_grad.zero_()
    turbo()
    expect = torch.zeros(vocab, hidden, device="cuda", dtype=torch.float64)
    expect.index_add_(0, ids.view(-1), grad.view(-1, hidden).double())
    ok = torch.allclose(weight.main_grad.double(), expect, rtol=1e-5, atol=1e-5)
    rows = []
    for label, fn in (("turbo embedding -> main_grad", turbo), ("F.embedding bwd + main_grad.add_", stock),
                      ("index_add_ (atomic)", index_add)):  # fmt: skip
        ms, _ = bench_ms(fn)
        rows.append({
            "label": label, "shape": f"{tokens}x{vocab}x{hidden}", "Check": ("PASS" if ok else "FAIL")
            if label.startswith("turbo") else "", "Backward Time (ms)": ms, "host us": 1e3 * host_ms(fn),
        })  # fmt: skip
    stock_ms = rows[1]["Backward Time (ms)"]
    for r in rows:
        r["speedup vs stock"] = stock_ms / r["Backward Time (ms)"]
    return rows


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_embedding: needs a CUDA device")
    copy_gbps = copy_bandwidth()
    rows = []
    for shape in shapes(args.quick):
        rows += run_shape(*shape)
    for r in rows:  # the stock pair's floor: one fp32 += bf16 pass over [V, H] (10 bytes per element)
        tokens, vocab, hidden = map(int, r["shape"].split("x"))
        r["dense add floor (ms)"] = 10 * vocab * hidden / (copy_gbps * 1e6)
    columns = [
        "label",
        "shape",
        "Check",
        "Backward Time (ms)",
        "speedup vs stock",
        "dense add floor (ms)",
        "host us",
    ]
    write_csv(out_dir(args) / ("embedding_quick.csv" if args.quick else "embedding.csv"), rows, columns)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    print_table(rows, columns)


if __name__ == "__main__":
    main()
