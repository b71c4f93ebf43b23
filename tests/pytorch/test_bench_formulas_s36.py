"""The benchmarks' FLOP / byte / timing formulas (benchmark/ops, benchmark/e2e), on the CPU.

The first tests pin fixes (each fails on the formula it replaced); the last ones are cross-checks of formulas
that were right, so that a later edit cannot silently change every reported number.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "ops"))
sys.path.insert(0, str(ROOT / "benchmark" / "e2e"))


# -- bench_expert_main_grad: bytes per element and the median ------------------------------------------------


def _add(grad_bytes: int) -> int:
    """main_grad (fp32) += gradient: read main_grad and the gradient, write main_grad."""
    return 4 + grad_bytes + 4


def _pass(read: int, written: int) -> int:
    """One elementwise pass (a cast or a flip): its input read, its output written."""
    return read + written


def test_expert_main_grad_bytes_per_element():
    """The "cast to fp32 + _foreach_add_" option is a bf16 -> fp32 cast (2 + 4) then an fp32 add (12):
    18 bytes, not 16 (its GB/s read 11% low, beside rows counted the same way: the flips)."""
    import bench_expert_main_grad as bench

    assert bench.BYTES_PER_ELEM == {
        "per-expert add_ (today: DDP hook)": _add(2),
        "_foreach_add_ fp32 += bf16": _add(2),
        "cast to fp32 + _foreach_add_": _pass(2, 4) + _add(4),
        "fp32 wgrad given: _foreach_add_": _add(4),
        "block add_ fp32 += bf16 (no flip: ascending)": _add(2),
        "block add_ fp32 += bf16 (flip)": _pass(2, 2) + _add(2),
        "fp32 wgrad given: block add_ (flip)": _pass(4, 4) + _add(4),
        "triton fused fp32 += bf16": _add(2),
    }
    assert bench.BYTES_PER_ELEM["cast to fp32 + _foreach_add_"] == 18


def test_expert_main_grad_times_the_median(monkeypatch):
    """The docstring promises do_bench's median; do_bench's default return_mode is the mean, which one slow
    sample (a clock dip, a context switch) pulls up."""
    import bench_expert_main_grad as bench
    import triton.testing

    samples = [1.0, 1.0, 1.0, 1.0, 9.0]

    def fake_do_bench(fn, warmup=25, rep=100, grad_to_none=None, quantiles=None, return_mode="mean"):
        fn()
        return {"median": statistics.median, "mean": statistics.fmean}[return_mode](samples)

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    assert bench._ms(lambda: None) == 1.0


# -- bench_quantization: the scales are part of the bytes ----------------------------------------------------


def test_quantization_bytes_count_the_scales():
    """bf16 read once + each FP8 copy and each scale tensor written once; a scale returned twice (tensorwise
    with the transpose) is one tensor."""
    import bench_quantization as bench

    m, k = 256, 512
    x = torch.empty(m, k, dtype=torch.bfloat16)
    q, qt = torch.empty(m, k, dtype=torch.float8_e4m3fn), torch.empty(k, m, dtype=torch.float8_e4m3fn)
    s_rows, s_cols = torch.empty(m, k // 128), torch.empty(k, m // 128)  # block 1x128 scales, fp32
    assert bench.io_bytes(x, (q, s_rows)) == 2 * m * k + m * k + 4 * m * k // 128
    assert bench.io_bytes(x, (q, s_rows, qt, s_cols)) == 2 * m * k + 2 * m * k + 2 * 4 * m * k // 128
    s = torch.empty(())
    assert bench.io_bytes(x, (q, s, qt, s)) == 4 * m * k + 4


def test_quantization_row_gbps_uses_the_scales(monkeypatch):
    """run_shape on the CPU with every quantizer on the torch backend and 1 ms per call: a row's GB/s is its
    logical bytes / 1e6, scales included (the block 1x128 rows read ~1-1.5% low without them)."""
    import bench_quantization as bench

    real = bench._quantizer
    monkeypatch.setattr(bench, "_quantizer", lambda spec, transpose, backend: real(spec, transpose, "torch"))
    monkeypatch.setattr(bench, "bench_ms", lambda fn, **kw: (fn(), (1.0, 0.0))[1])
    monkeypatch.setattr(bench, "_host_us", lambda fn, n=50: 0.0)
    monkeypatch.setattr(bench, "print_table", lambda *a, **kw: None)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    m, k = 256, 512
    rows = {r["label"]: r for r in bench.run_shape(m, k, quick=True)}
    scales = 4 * m * k // 128
    assert rows["block1x128"]["Forward GB/s"] * 1e6 == pytest.approx(3 * m * k + scales)
    assert rows["block1x128+transpose"]["Forward GB/s"] * 1e6 == pytest.approx(4 * m * k + 2 * scales)
    assert rows["rowwise"]["Forward GB/s"] * 1e6 == pytest.approx(3 * m * k + 4 * m)


# -- e2e report: which peak the MFU column is against -------------------------------------------------------


def test_report_says_which_peak_the_mfu_is_against(tmp_path):
    """FP8 rows' MFU is against the FP8 peak (1979), bf16 rows' against 989, in one column: the report must
    say so next to the table, not only in the targets lines of the turbo FP8 rows."""
    import report

    text = report.write_report(tmp_path, [], warmup=1, meta={}).read_text()
    header = text.split("| configuration")[0]
    assert "dense peak of the row's own precision: bf16 989, FP8 1979 TFLOP/s" in header


# -- cross-checks (right before this session; pinned) --------------------------------------------------------


def _megatron_flops_per_token(m) -> float:
    """Megatron-LM training.py ``num_floating_point_operations`` / (batch x seq), transcribed (the installed
    megatron-core wheel ships megatron/core only): SwiGLU MLPs, no MTP, vocab padded to 128 (TP 1)."""
    from primus_turbo.integrations.common.config import moe_layer_pattern

    h, layers, s, heads = m.hidden_size, m.num_layers, m.seq_length, m.num_attention_heads
    n_moe = sum(moe_layer_pattern(m))
    moe = m.moe
    moe_ffn, topk = (moe.ffn_hidden_size, moe.topk) if moe else (0, 0)
    shared = (moe.get("shared_expert_ffn_hidden_size") or 0) if moe else 0
    mlp = 3 * 2 * h * 3 * (m.ffn_hidden_size * (layers - n_moe) + (moe_ffn * topk + shared) * n_moe)
    if m.mla is not None:
        a = m.mla
        d_qk = a.qk_head_dim + a.qk_pos_emb_head_dim
        q = h * heads * d_qk if not a.q_lora_rank else a.q_lora_rank * (h + heads * d_qk + 1)
        kv = a.kv_lora_rank * (h + heads * (a.qk_head_dim + a.v_head_dim) + 1) + h * a.qk_pos_emb_head_dim
        core = s * heads * d_qk / 2 + s * heads * a.v_head_dim / 2
        attn = 3 * 2 * layers * (q + kv + heads * a.v_head_dim * h + core)
    else:
        d = m.kv_channels or h // heads
        qp, kp = d * heads, d * (m.num_query_groups or heads)
        attn = 3 * 2 * layers * (h * (qp + 2 * kp) + qp * s / 2 * 2 + qp * h)
    return mlp + attn + 3 * 2 * h * math.ceil(m.vocab_size / 128) * 128


RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "recipe").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_e2e_flops_per_token_match_megatron(recipe):
    """metrics.model_flops_per_token (what compare.py's TFLOP/s and MFU come from) vs Megatron's formula:
    equal up to the router GEMM (turbo counts 2*h*E per MoE layer, Megatron none) and Megatron's norm terms
    in the MLA low-rank projections (+1 per rank); within 0.25% on every recipe."""
    from primus_turbo.integrations.common.config import moe_layer_pattern
    from primus_turbo.integrations.common.metrics import model_flops_per_token
    from scaling_model import recipe_model

    m = recipe_model(recipe)
    ours, megatron = model_flops_per_token(m), _megatron_flops_per_token(m)
    router = 3 * 2 * m.hidden_size * m.moe.num_experts * sum(moe_layer_pattern(m)) if m.moe else 0
    norms = 3 * 2 * m.num_layers * m.mla.kv_lora_rank if m.mla is not None else 0
    assert ours == pytest.approx(megatron + router - norms, rel=1e-12)
    assert abs(ours / megatron - 1) < 2.5e-3


def test_attention_flops_convention():
    """bench_attention: fwd 4*B*H*S^2*D, bwd 2.5x fwd (recompute of QK^T counted), both halved for causal,
    q heads (GQA: the kv heads do not enter), MLA d_qk != d_v."""
    import bench_attention as bench

    b, s, hq, d = 2, 1024, 32, 128
    fwd, bwd = bench._flops(b, s, hq, d, d, False)
    assert fwd == 4 * b * hq * s * s * d and bwd == 2.5 * fwd
    assert bench._flops(b, s, hq, d, d, True) == (fwd / 2, bwd / 2)
    fwd, bwd = bench._flops(1, s, 16, 192, 128, False)
    assert fwd == 2 * 16 * s * s * (192 + 128) and bwd == 2 * 16 * s * s * (3 * 192 + 2 * 128)


@pytest.mark.parametrize("dist", ["balanced", "skewed"])
def test_grouped_gemm_rows_are_the_group_lens(dist):
    """bench_grouped_gemm's FLOPs use ``rows``: the group sizes must sum to exactly that (no padding)."""
    import bench_grouped_gemm as bench

    for rows, experts in ((4096 * 6, 64), (8192 * 8 + 5, 256), (4096 * 2, 8)):
        lens = bench.group_lens_for(rows, experts, dist, "cpu")
        assert int(lens.sum()) == rows and int(lens.min()) >= 0
