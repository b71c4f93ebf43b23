"""Rotary position embedding, forward and backward: turbo.ops.apply_rotary_pos_emb vs Megatron-Core's eager
``_apply_rotary_pos_emb_bshd`` (what Megatron runs without Transformer Engine) and torch.compile of it; same
process, same bf16 input, plus the copy bandwidth.

    python benchmark/ops/bench_rope.py --quick   # deepseek MLA q / k rotary parts (4096 tokens, 16 heads, 64)
    python benchmark/ops/bench_rope.py           # + Llama-3 8B q (32 x 128) at 8192 tokens

Bytes: the input read and the output written once each way. "Check": turbo output and input gradient vs the
eager function in float64 at the bf16 tolerance. Backward time is (forward + backward) - forward.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, copy_bandwidth, gbps, host_ms, out_dir, print_table, write_csv  # noqa: E402

from primus_turbo.pytorch.ops.rope import apply_rotary_pos_emb  # noqa: E402


def shapes(quick: bool) -> list[tuple[str, tuple[int, int, int, int], bool]]:
    """(label, [S, B, H, D], MLA interleaved input)."""
    full = [("mla q_pos", (4096, 1, 16, 64), True), ("mla k_pos", (4096, 1, 1, 64), True),
            ("llama3 q", (8192, 1, 32, 128), False)]  # fmt: skip
    return full[:2] if quick else full


def _freqs(seq, dim):
    inv = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, device="cuda", dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device="cuda", dtype=torch.float32), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def run_shape(name, shape, mla) -> list[dict]:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    def eager(t, f):
        return _apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=False, multi_latent_attention=mla)

    candidates = {
        "turbo apply_rotary_pos_emb": lambda t, f: apply_rotary_pos_emb(t, f, interleaved_input=mla),
        "megatron eager": eager,
        "torch.compile(megatron eager)": torch.compile(eager, dynamic=False),
    }
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    freqs = _freqs(shape[0], shape[-1])
    grad = torch.randn_like(x)
    ref_x = x.double().requires_grad_(True)
    ref = eager(ref_x, freqs.double())
    (ref_grad,) = torch.autograd.grad(ref, ref_x, grad.double())
    nbytes = 2 * x.numel() * x.element_size()
    rows = []
    for label, fn in candidates.items():
        t = x.clone().requires_grad_(True)
        status = ""
        if label.startswith("turbo"):
            out = fn(t, freqs)
            (g,) = torch.autograd.grad(out, t, grad)
            ok = torch.allclose(out.double(), ref, rtol=1e-2, atol=1e-2)
            status = "PASS" if ok and torch.allclose(g.double(), ref_grad, rtol=1e-2, atol=1e-2) else "FAIL"
        fwd_ms, _ = bench_ms(lambda fn=fn, t=t: fn(t, freqs))
        total_ms, _ = bench_ms(lambda fn=fn, t=t: torch.autograd.grad(fn(t, freqs), t, grad))
        rows.append({
            "label": label, "shape": f"{name} {'x'.join(map(str, shape))}", "Check": status,
            "Forward Time (ms)": fwd_ms, "Backward Time (ms)": total_ms - fwd_ms, "fwd+bwd (ms)": total_ms,
            "Forward GB/s": gbps(nbytes, fwd_ms), "host fwd+bwd us": 1e3 * host_ms(
                lambda fn=fn, t=t: torch.autograd.grad(fn(t, freqs), t, grad)),
        })  # fmt: skip
    base = {r["label"]: r["fwd+bwd (ms)"] for r in rows}
    for r in rows:
        r["speedup vs eager"] = base["megatron eager"] / r["fwd+bwd (ms)"]
        r["speedup vs compile"] = base["torch.compile(megatron eager)"] / r["fwd+bwd (ms)"]
    return rows


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_rope: needs a CUDA device")
    copy_gbps = copy_bandwidth()
    rows = []
    for shape in shapes(args.quick):
        rows += run_shape(*shape)
    for r in rows:
        r["fwd %copy"] = 100 * r["Forward GB/s"] / copy_gbps
    columns = ["label", "shape", "Check", "Forward Time (ms)", "Backward Time (ms)", "speedup vs eager",
               "speedup vs compile", "fwd %copy", "host fwd+bwd us"]  # fmt: skip
    write_csv(out_dir(args) / ("rope_quick.csv" if args.quick else "rope.csv"), rows, columns)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s")
    print_table(rows, columns)


if __name__ == "__main__":
    main()
