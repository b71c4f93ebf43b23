"""Attention forward candidate with Q/K/V tiles through TMA descriptors (a diagnosis tool, not a benchmark
of record).

    python benchmark/ops/sweep_attention_fwd.py [--out DIR]

The shipped TRITON forward (primus_turbo/triton/attention/attention_kernel.py) loads its tiles with pointer
arithmetic. Triton's Hopper attention tutorial loads them through host-side tensor descriptors (TMA), which
frees the address registers and lets the copy engine feed shared memory. ``attn_fwd_tma_kernel`` does that
for the bench case only: fixed-length BSHD, contiguous, head dim 64 / 128, no window / sink / varlen, the
sequence a multiple of the tiles. It is timed over (BLOCK_M, BLOCK_N, num_warps, num_stages) against the
shipped (autotuned) forward and cuDNN SDPA in one process, the best config then in 3 interleaved rounds;
every output is checked against the shipped kernel's. Session 21 measured the atomic dQ backward and the
causal block order (benchmark/NOTES.md): this is the lever left untried for the own kernel's forward.
Writes DIR/sweep_attention_fwd.txt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import run_sweep  # noqa: E402

from primus_turbo.pytorch.kernels.attention import attention_triton_impl as impl  # noqa: E402

LOG2E = 1.4426950408889634
# (B, S, Hq, Hk, D, causal): Llama3-8B at 16384 tokens, the bench_attention shapes
CASES = [(4, 4096, 32, 8, 128, True), (2, 8192, 32, 8, 128, True), (4, 4096, 32, 8, 128, False)]
CONFIGS = [
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 128, 8, 3),
    (128, 64, 4, 3),
    (64, 64, 4, 4),
]


@triton.jit
def _tma_block(acc, l_i, m_i, q, desc_k, desc_v, row0, col_kv, lo, hi, rows, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    for n in range(lo, hi, BLOCK_N):
        k = desc_k.load([row0 + n, col_kv])
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:  # causal diagonal: query i sees key j <= i
            cols = n + tl.arange(0, BLOCK_N)
            qk = tl.where(cols[None, :] <= rows[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([row0 + n, col_kv])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_tma_kernel(desc_q, desc_k, desc_v, Out, LSE, seqlen, num_heads_q, group_size, qk_scale,
                        stride_os, stride_oh, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr):  # fmt: skip
    """Grid (seqlen // BLOCK_M, B * Hq); descriptors over [B * S, H * D] views, blocks [BLOCK_M | BLOCK_N, D].
    Key blocks below the diagonal run unmasked, the diagonal ones masked (causal rows always see their own
    key first, so no row's running max is -inf when it meets a fully masked block)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    col_kv = (h // group_size) * D
    m_start = pid_m * BLOCK_M
    row0 = b * seqlen
    rows = m_start + tl.arange(0, BLOCK_M)
    q = desc_q.load([row0 + m_start, h * D])
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if CAUSAL:
        full_hi = (m_start // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _tma_block(acc, l_i, m_i, q, desc_k, desc_v, row0, col_kv, 0, full_hi, rows, qk_scale,
                                   BLOCK_N, False)  # fmt: skip
        acc, l_i, m_i = _tma_block(acc, l_i, m_i, q, desc_k, desc_v, row0, col_kv, full_hi, m_start + BLOCK_M,
                                   rows, qk_scale, BLOCK_N, True)  # fmt: skip
    else:
        acc, l_i, m_i = _tma_block(acc, l_i, m_i, q, desc_k, desc_v, row0, col_kv, 0, seqlen, rows, qk_scale,
                                   BLOCK_N, False)  # fmt: skip
    offs_d = tl.arange(0, D)
    o_ptrs = Out + (row0 + rows)[:, None].to(tl.int64) * stride_os + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen + rows, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


def tma_forward(q, k, v, causal, config):
    """out [B, S, Hq, D], lse [B, Hq, S] through attn_fwd_tma_kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, warps, stages = config
    b, s, hq, d = q.shape
    hk = k.shape[2]
    if s % bm or s % bn or not all(t.is_contiguous() for t in (q, k, v)):
        raise ValueError("the candidate takes contiguous BSHD with S a multiple of the tiles")
    views = [t.view(b * s, t.shape[2] * d) for t in (q, k, v)]
    descs = [
        TensorDescriptor(x, list(x.shape), list(x.stride()), [blk, d]) for x, blk in zip(views, (bm, bn, bn))
    ]
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
    attn_fwd_tma_kernel[(s // bm, b * hq)](
        *descs, out, lse, s, hq, hq // hk, d**-0.5 * LOG2E, out.stride(1), out.stride(2),
        D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


def shipped_forward(q, k, v, causal):
    s, d = q.shape[1], q.shape[-1]
    return impl.triton_attn_fwd(q, k, v, None, None, s, s, None, d**-0.5, -1, 0 if causal else -1)


def cudnn_forward(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            enable_gqa=q.shape[2] != k.shape[2],
        )  # fmt: skip


def sweep_case(b, s, hq, hk, d, causal, report: io.StringIO) -> None:
    q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    flop = 4 * b * hq * s * s * d / (2 if causal else 1)
    want, want_lse = shipped_forward(q, k, v, causal)

    def tflops(fn):
        return flop / tt.do_bench(fn, return_mode="median") / 1e9

    def shipped():
        return shipped_forward(q, k, v, causal)

    def cudnn():
        return cudnn_forward(q, k, v, causal)

    report.write(f"\n### B={b} S={s} Hq={hq} Hk={hk} d={d} causal={causal}\n\n")
    report.write("| kernel | TFLOP/s | check |\n|---|---|---|\n")
    report.write(f"| shipped TRITON (autotuned) | {tflops(shipped):.0f} | |\n")
    report.write(f"| cuDNN SDPA | {tflops(cudnn):.0f} | |\n")
    best = None
    for cfg in CONFIGS:
        try:
            out, lse = tma_forward(q, k, v, causal, cfg)
            ok = torch.allclose(out.float(), want.float(), atol=2e-2)
            ok = ok and torch.allclose(lse, want_lse, atol=1e-3)
            rate = tflops(lambda c=cfg: tma_forward(q, k, v, causal, c))
        except Exception as exc:  # noqa: BLE001 (a config that does not compile is a result too)
            report.write(f"| TMA {cfg} | {type(exc).__name__}: {str(exc).splitlines()[0][:60]} | |\n")
            continue
        report.write(f"| TMA {cfg} | {rate:.0f} | {'ok' if ok else 'MISMATCH'} |\n")
        if ok and (best is None or rate > best[1]):
            best = (cfg, rate)
        print(b, s, causal, cfg, f"{rate:.0f}", ok, flush=True)
    if best is None:
        return
    for rnd in range(3):
        rates = [tflops(shipped), tflops(lambda: tma_forward(q, k, v, causal, best[0])), tflops(cudnn)]
        joined = " / ".join(f"{r:.0f}" for r in rates)
        report.write(f"| round {rnd}: shipped / TMA {best[0]} / cuDNN | {joined} | |\n")


def main() -> None:
    run_sweep(__doc__, "sweep_attention_fwd", "Attention forward, TMA candidate", CASES, sweep_case)


if __name__ == "__main__":
    main()
