"""TorchTitan's DeepSeek MLA glue, forward and backward: turbo.ops.apply_rotary_emb_complex (q: split + RoPE +
cat) and turbo.ops.mla_key_value (keys / values: split + cat of k_nope with k_pe over heads) vs TorchTitan's
eager code and torch.compile of it; same process, same bf16 inputs, plus the copy bandwidth.

    python benchmark/ops/bench_mla_titan.py --quick   # deepseek_moe_fp8 (V2-Lite), mbs 2: 2 x 4096, 16 heads
    python benchmark/ops/bench_mla_titan.py           # + DeepSeek-V3 heads (128) at 1 x 4096

"Check": turbo outputs and input gradients vs the eager code at the bf16 tolerance. Backward time is
(forward + backward) - forward. "Bytes": what an ideal kernel moves (inputs read and outputs written once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, copy_bandwidth, gbps, host_ms, out_dir, print_table, write_csv  # noqa: E402

from primus_turbo.pytorch.ops.mla import mla_key_value  # noqa: E402
from primus_turbo.pytorch.ops.rope import apply_rotary_emb_complex  # noqa: E402

NOPE, ROPE, VD = 128, 64, 128


def _freqs_cis(seq):
    inv = 1.0 / (10000.0 ** (torch.arange(0, ROPE, 2, device="cuda", dtype=torch.float32) / ROPE))
    angles = torch.outer(torch.arange(seq, device="cuda", dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def _titan_q(q, freqs_cis):
    from torchtitan.models.deepseek_v3.model.model import apply_rotary_emb

    q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
    return torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis)], dim=-1)


def _titan_kv(kv, k_pe):
    k_nope, v = torch.split(kv, [NOPE, VD], dim=-1)
    return torch.cat([k_nope, k_pe.expand(-1, -1, kv.shape[2], -1)], dim=-1), v


def _rows(name, candidates, inputs, grads, nbytes):
    ref = candidates["torchtitan eager"](*inputs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    want = torch.autograd.grad(ref, inputs, grads)
    rows = []
    for label, fn in candidates.items():

        def step(fn=fn):
            out = fn(*inputs)
            return torch.autograd.grad(out if isinstance(out, tuple) else (out,), inputs, grads)

        status = ""
        if label.startswith("turbo"):
            out = fn(*inputs)
            out = out if isinstance(out, tuple) else (out,)
            pairs = [*zip(out, ref), *zip(step(), want)]
            ok = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2) for a, b in pairs)
            status = "PASS" if ok else "FAIL"
        fwd_ms, _ = bench_ms(lambda fn=fn: fn(*inputs))
        total_ms, _ = bench_ms(step)
        rows.append({
            "label": label, "shape": name, "Check": status, "Forward Time (ms)": fwd_ms,
            "Backward Time (ms)": total_ms - fwd_ms, "fwd+bwd (ms)": total_ms,
            "Forward GB/s": gbps(nbytes, fwd_ms),
            "host fwd+bwd us": 1e3 * host_ms(step),
        })  # fmt: skip
    base = {r["label"]: r["fwd+bwd (ms)"] for r in rows}
    for r in rows:
        r["speedup vs eager"] = base["torchtitan eager"] / r["fwd+bwd (ms)"]
        r["speedup vs compile"] = base["torch.compile(eager)"] / r["fwd+bwd (ms)"]
    return rows


def run_shape(batch, seq, heads) -> list[dict]:
    freqs = _freqs_cis(seq)
    q = torch.randn(batch, seq, heads, NOPE + ROPE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q_rows = _rows(
        f"q {batch}x{seq}x{heads}x{NOPE + ROPE}",
        {"turbo apply_rotary_emb_complex": lambda t: apply_rotary_emb_complex(t, freqs, ROPE),
         "torchtitan eager": lambda t: _titan_q(t, freqs),
         "torch.compile(eager)": torch.compile(lambda t: _titan_q(t, freqs), dynamic=False)},
        (q,), (torch.randn_like(q),), 2 * q.numel() * 2,
    )  # fmt: skip
    kv = torch.randn(batch, seq, heads, NOPE + VD, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_pe = torch.randn(batch, seq, 1, ROPE, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k_shape, v_shape = (batch, seq, heads, NOPE + ROPE), (batch, seq, heads, VD)
    grads = (torch.randn(k_shape, device="cuda", dtype=torch.bfloat16),
             torch.randn(v_shape, device="cuda", dtype=torch.bfloat16))  # fmt: skip
    kv_bytes = 2 * (kv.numel() + k_pe.numel()) + 2 * (grads[0].numel() + grads[1].numel())
    kv_rows = _rows(
        f"k/v {batch}x{seq}x{heads}x{NOPE}+{VD}",
        {"turbo mla_key_value": lambda a, b: mla_key_value(a, b, NOPE), "torchtitan eager": _titan_kv,
         "torch.compile(eager)": torch.compile(_titan_kv, dynamic=False)},
        (kv, k_pe), grads, kv_bytes,
    )  # fmt: skip
    return q_rows + kv_rows


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_titan: needs a CUDA device")
    copy_gbps = copy_bandwidth()
    rows = run_shape(2, 4096, 16)
    if not args.quick:
        rows += run_shape(1, 4096, 128)
    for r in rows:
        r["fwd %copy"] = 100 * r["Forward GB/s"] / copy_gbps
    columns = ["label", "shape", "Check", "Forward Time (ms)", "Backward Time (ms)", "speedup vs eager",
               "speedup vs compile", "fwd %copy", "host fwd+bwd us"]  # fmt: skip
    write_csv(out_dir(args) / ("mla_titan_quick.csv" if args.quick else "mla_titan.csv"), rows, columns)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    print_table(rows, columns)


if __name__ == "__main__":
    main()
