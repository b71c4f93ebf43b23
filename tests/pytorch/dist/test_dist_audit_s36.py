"""Session 36 audit of the distributed pieces (async-TP ops, parallel linears, CP attention, TokenDispatcher).

CPU, gloo, 2 ranks (3 for the odd-world-size regression), one spawn per test: process start-up dominates.
Numerics against fp64 references built from the full (unsharded) tensors on every rank; argument checks
raise on every rank that got a bad argument, never a hang, an abort or a silent wrong answer.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_utils import assert_snr, fp8_snr_gate

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity

ROWWISE = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)


def _per_rank_rows(rank_scale: float, world: int, k: int, seed: int) -> list[torch.Tensor]:
    """One [1, k] fp64 row per rank, rank r's scaled by rank_scale**r: a row-wise scale per rank differs."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, k, generator=gen, dtype=torch.float64) * rank_scale**r for r in range(world)]


def _body_fp8_rowwise_one_row_shards(rank, world, device):
    """Row-wise FP8 all-gather with one row per rank (1 token per rank). The shard's row-wise scale [1, 1] has
    one element, and was taken for a tensor-wise one: not gathered, so every gathered row was dequantized by
    this rank's scale (other ranks' rows off by their scale ratio: SNR < 0 dB)."""
    from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear
    from primus_turbo.pytorch.ops.async_tp import (
        fused_all_gather_matmul,
        fused_all_gather_scaled_matmul,
        quantize_for_async_tp,
    )

    gate = fp8_snr_gate(ROWWISE.format)
    rows = _per_rank_rows(100.0, world, 32, seed=11)
    b = torch.randn(32, 24, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    ref = torch.cat(rows) @ b
    _, (out,) = fused_all_gather_matmul(rows[rank].float(), [b.float()], 0, fp8_config=ROWWISE)
    for r in range(world):  # per gathered row: one wrong row hides behind a larger one in a global SNR
        assert_snr(out[r].double(), ref[r], gate, msg=f"AG fp8 row-wise, rank {r}'s row")

    # the scaled variant: a [1, 1] a_scale is the row-wise scale of a [1, K] shard, gathered with it
    a_q, a_scale = quantize_for_async_tp(rows[rank].float(), torch.float8_e4m3fn, 1)
    bt_q, b_scale = quantize_for_async_tp(b.t().contiguous().float(), torch.float8_e4m3fn, 1)
    a_full, scale_full, (out,) = fused_all_gather_scaled_matmul(
        a_q, [bt_q.t()], a_scale, [b_scale.view(1, -1)], 0, out_dtypes=torch.float32
    )
    assert scale_full.shape == (world, 1), scale_full.shape
    want_scales = torch.cat([quantize_for_async_tp(r.float(), torch.float8_e4m3fn, 1)[1] for r in rows])
    torch.testing.assert_close(scale_full, want_scales, rtol=0, atol=0)
    for r in range(world):
        assert_snr(out[r].double(), ref[r], gate, msg=f"scaled AG row-wise, rank {r}'s row")

    # ColumnParallelLinear, sequence parallel, FP8 row-wise, one token per rank: out, dx, dw, db
    x = torch.cat(rows).view(world, 1, 32).to(torch.bfloat16).double().requires_grad_()
    w = (torch.randn(16, 32, generator=torch.Generator().manual_seed(13), dtype=torch.float64) / 8).to(
        torch.bfloat16
    )
    w = w.double().requires_grad_()
    bias = torch.randn(16, dtype=torch.float64).to(torch.bfloat16).double().requires_grad_()
    g = torch.randn(world, 1, 16, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    y = x @ w.t() + bias
    y.backward(g)
    layer = ColumnParallelLinear(32, 16, sequence_parallel=True, fp8_config=ROWWISE, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(world, 0)[rank])
        layer.bias.copy_(bias.chunk(world, 0)[rank])
    x_local = x.detach()[rank : rank + 1].to(torch.bfloat16).requires_grad_()
    out = layer(x_local)
    out.backward(g.chunk(world, -1)[rank].to(torch.bfloat16))
    checks = [
        ("out", out, y.detach().chunk(world, -1)[rank]),
        ("dx", x_local.grad, x.grad[rank : rank + 1]),
        ("dw", layer.weight.grad, w.grad.chunk(world, 0)[rank]),
        ("db", layer.bias.grad, bias.grad.chunk(world, 0)[rank]),
    ]
    for name, got, want in checks:
        for r in range(got.shape[0]):  # per sequence position (rank's token) where there is one per rank
            assert_snr(got[r].double(), want[r], gate, msg=f"ColumnParallelLinear fp8 row-wise {name}[{r}]")


def test_fp8_rowwise_all_gather_with_one_row_per_rank():
    run_distributed(_body_fp8_rowwise_one_row_shards, world_size=2, timeout_s=60)


def _body_bad_groups(rank, world, device):
    """A group the rank is not in, a non-group, or one group passed as both CP groups: a clear error. Before:
    flash_attn_usp_func on a non-member ran plain local attention (its group size read as -1), TokenDispatcher
    took EP size -1, the async-TP ops said 'expected a ProcessGroup ... got int', a str group raised
    AttributeError, and ulysses_group is ring_group returned garbage. Plus bad layer sizes, a backend typo and
    FP8 GEMM+RS output dtypes."""
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear, RowParallelLinear
    from primus_turbo.pytorch.modules.token_dispatcher import TokenDispatcher
    from primus_turbo.pytorch.ops.async_tp import (
        fused_all_gather_matmul,
        fused_matmul_reduce_scatter,
        fused_scaled_matmul_reduce_scatter,
        quantize_for_async_tp,
    )
    from primus_turbo.pytorch.ops.attention.attention_cp import flash_attn_usp_func

    GlobalBackendManager.set_attention_backend("TORCH")
    only_rank0 = dist.new_group([0])  # the other ranks get GroupMember.NON_GROUP_MEMBER
    q = torch.randn(1, 4, 2, 8)
    if rank != 0:
        for kw in (dict(ring_group=only_rank0), dict(ulysses_group=only_rank0)):
            with pytest.raises(ValueError, match="not a member"):
                flash_attn_usp_func(q, q, q, causal=True, **kw)
        with pytest.raises(ValueError, match="ep_group: .*not a member"):
            TokenDispatcher(4, 2, only_rank0)
        with pytest.raises(ValueError, match="tp_group: .*not a member"):
            ColumnParallelLinear(8, 8, tp_group=only_rank0)
        with pytest.raises(ValueError, match="group: .*not a member"):
            fused_all_gather_matmul(torch.randn(2, 8), [torch.randn(8, 4)], 0, only_rank0)
    for kw in (dict(ring_group="world"), dict(ulysses_group=0)):
        with pytest.raises(TypeError, match="must be a ProcessGroup or None"):
            flash_attn_usp_func(q, q, q, **kw)
    with pytest.raises(ValueError, match="same group"):
        flash_attn_usp_func(q, q, q, ulysses_group=dist.group.WORLD, ring_group=dist.group.WORLD)
    with pytest.raises(TypeError, match="ep_group must be a ProcessGroup"):
        TokenDispatcher(4, 2, "world")
    with pytest.raises(ValueError, match="in_features: expected a positive int"):
        RowParallelLinear(0, 8)  # was ZeroDivisionError
    with pytest.raises(ValueError, match="out_features: expected a positive int"):
        ColumnParallelLinear(8, -2)  # was 'negative dimension'
    with pytest.raises(ValueError, match="unknown backend 'SYMMMEM'"):
        RowParallelLinear(8, 8, backend="SYMMMEM")  # a typo; ignored until now without sequence parallel
    # FP8 GEMM+RS output dtypes: int32 truncated the reduced sums silently, fp8 raised 'Invalid scalar type'
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    a_q, a_scale = quantize_for_async_tp(a, torch.float8_e4m3fn, None)
    bt_q, b_scale = quantize_for_async_tp(b.t().contiguous(), torch.float8_e4m3fn, None)
    for out_dtype in (torch.int32, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="out_dtype: FP8 GEMMs return bfloat16, float16 or float32"):
            fused_matmul_reduce_scatter(a, b, "sum", 0, fp8_config=ROWWISE, out_dtype=out_dtype)
        with pytest.raises(ValueError, match="out_dtype: FP8 GEMMs return bfloat16, float16 or float32"):
            fused_scaled_matmul_reduce_scatter(a_q, bt_q.t(), a_scale, b_scale, "sum", 0, out_dtype=out_dtype)


def test_bad_groups_and_arguments_raise_clearly():
    run_distributed(_body_bad_groups, world_size=2, timeout_s=60)


def _body_rank_mismatch_debug_checks(rank, world, device):
    """PRIMUS_TURBO_DEBUG_CHECKS=1: ranks called with different shapes, dtypes or flags all raise ValueError.
    Without the check gloo aborted one rank (SIGABRT) and the other got a connection reset, or (a dtype or a
    causal flag that differs) a rank returned another rank's bytes read as its layout."""
    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear
    from primus_turbo.pytorch.ops.async_tp import fused_all_gather_matmul, fused_matmul_reduce_scatter
    from primus_turbo.pytorch.ops.attention.attention_cp import flash_attn_usp_func

    GlobalBackendManager.set_attention_backend("TORCH")
    os.environ["PRIMUS_TURBO_DEBUG_CHECKS"] = "1"
    b = torch.randn(8, 4)
    mismatched = {
        "AG rows": lambda: fused_all_gather_matmul(torch.randn(2 + rank, 8), [b], 0),
        "AG dtype": lambda: fused_all_gather_matmul(
            torch.randn(4, 8, dtype=(torch.float32, torch.bfloat16)[rank % 2]),
            [b.to((torch.float32, torch.bfloat16)[rank % 2])],
            0,
        ),
        "RS N": lambda: fused_matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 4 + rank), "sum", 0),
        "AG pinned backend": lambda: fused_all_gather_matmul(
            torch.randn(2, 8), [b], 0, backend=("NCCL", None)[rank % 2]
        ),
        "Ulysses seq": lambda: flash_attn_usp_func(
            *[torch.randn(1, 4 + 2 * rank, 2, 8)] * 3, ulysses_group=dist.group.WORLD
        ),
        "ring causal": lambda: flash_attn_usp_func(
            *[torch.randn(1, 4, 2, 8)] * 3, causal=bool(rank), ring_group=dist.group.WORLD
        ),
        "column non-SP rows": lambda: ColumnParallelLinear(8, 4 * world)(torch.randn(3 + rank, 8)),
    }
    for name, call in mismatched.items():
        with pytest.raises(ValueError, match="different arguments"):
            call()
            raise AssertionError(f"{name}: the ranks' mismatch was not caught")
        dist.barrier()  # every rank raised before any data moved: the group is still in step
    # two groups over the same ranks (not one object) are not orthogonal CP groups
    same_ranks = dist.new_group(list(range(world)))
    with pytest.raises(ValueError, match="share ranks"):
        flash_attn_usp_func(
            *[torch.randn(1, 4, 2, 8)] * 3, ulysses_group=dist.group.WORLD, ring_group=same_ranks
        )
    # agreeing ranks still run, and right
    gen = torch.Generator().manual_seed(5)
    shards = [torch.randn(2, 8, generator=gen) for _ in range(world)]
    _, (out,) = fused_all_gather_matmul(shards[rank], [b], 0, backend="nccl")
    torch.testing.assert_close(out, torch.cat(shards) @ b)


def test_rank_mismatch_raises_on_every_rank_with_debug_checks():
    run_distributed(_body_rank_mismatch_debug_checks, world_size=2, timeout_s=60)


def test_cp_layout_helpers_reject_out_of_range_ranks_and_wrong_shard_counts():
    """A global rank passed as the ring rank (ring_rank=3 of 2) returned chunks (3, 0) silently (chunk ids
    wrap around), ulysses_rank=-1 the last piece, and a surplus shard was ignored by the gather."""
    from primus_turbo.pytorch.ops.attention.attention_cp import gather_sequence_for_cp, split_sequence_for_cp

    x = torch.randn(1, 8, 2)
    with pytest.raises(ValueError, match=r"ring_rank=3 must be an int in \[0, 2\)"):
        split_sequence_for_cp(x, 1, ring_size=2, ring_rank=3)
    with pytest.raises(ValueError, match=r"ulysses_rank=-1 must be an int in \[0, 2\)"):
        split_sequence_for_cp(x, 1, ulysses_size=2, ulysses_rank=-1)
    with pytest.raises(ValueError, match="ring_size=0: expected a positive int"):
        split_sequence_for_cp(x, 1, ring_size=0)
    shards = [split_sequence_for_cp(x, 1, 2, r) for r in range(2)]
    torch.testing.assert_close(gather_sequence_for_cp(shards, 1, 2), x, rtol=0, atol=0)
    with pytest.raises(ValueError, match="expected ring_size x ulysses_size = 2 shards, got 3"):
        gather_sequence_for_cp(shards + shards[:1], 1, 2)


def _attention_ref(q, k, v, causal, sink):
    """fp64 attention on full BSHD tensors (GQA by repeating k/v heads; bottom-right causal; sink logits)."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1)[..., :-1], v)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def _cp_case(rank, world, mode, qkv, sink, dout):
    """Causal CP attention with a sink on ``qkv`` (full fp64 tensors): out and dq, dk, dv, dsink vs fp64."""
    from test_utils import assert_close

    from primus_turbo.pytorch.ops.attention.attention_cp import (
        flash_attn_usp_func,
        gather_sequence_for_cp,
        split_sequence_for_cp,
    )

    leaves = [t.clone().requires_grad_() for t in (*qkv, sink)]
    ref = _attention_ref(*leaves[:3], True, leaves[3])
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    ring = mode == "ring"
    r_size, u_size = (world, 1) if ring else (1, world)
    sizes = dict(ring_size=r_size, ring_rank=rank % r_size, ulysses_size=u_size, ulysses_rank=rank % u_size)
    sizes["causal"] = ring  # the zigzag split is for the causal ring only
    local = [split_sequence_for_cp(t, 1, **sizes).float().requires_grad_() for t in qkv]
    local.append(sink.float().requires_grad_())
    group = dict(ring_group=dist.group.WORLD) if ring else dict(ulysses_group=dist.group.WORLD)
    out = flash_attn_usp_func(*local[:3], causal=True, sink=local[3], **group)
    grads = torch.autograd.grad(out, local, split_sequence_for_cp(dout, 1, **sizes).float())
    dsink = grads[3].clone()
    dist.all_reduce(dsink)  # each rank holds its rows' (ring) or its heads' (Ulysses) share
    results = []
    for t in (out, *grads[:3]):
        shards = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(shards, t.contiguous())
        results.append(gather_sequence_for_cp(shards, 1, r_size, u_size, causal=ring))
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsink"), (*results, dsink), (ref, *ref_grads)):
        assert_close(got, want, torch.float32, msg=f"{mode} world {world} {name}")


def _body_world3(rank, world, device):
    """World size 3 (odd: zigzag pairs (r, 5 - r)), GQA, sinks, Sq != Sk (Ulysses), 1-2 tokens per rank."""
    from test_utils import assert_close

    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear, RowParallelLinear
    from primus_turbo.pytorch.ops.async_tp import fused_all_gather_matmul, fused_matmul_reduce_scatter

    GlobalBackendManager.set_attention_backend("TORCH")
    gen = torch.Generator().manual_seed(21)  # the same full tensors on every rank

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    # ring causal: 2 tokens per rank (one per zigzag chunk); Ulysses: 1 query token per rank, Sq != Sk
    for mode, sq, sk, hq, hk in [("ring", 6, 6, 2, 1), ("ulysses", 3, 6, 6, 3)]:
        _cp_case(rank, world, mode, [rand(1, sq, hq, 8), rand(1, sk, hk, 8), rand(1, sk, hk, 8)], rand(hq),
                 rand(1, sq, hq, 8))  # fmt: skip

    # async TP: one row per rank (AG), gather/scatter dims other than 0
    shards = [rand(2, 1, 8) for _ in range(world)]
    b = rand(8, 5)
    a_full, (out,) = fused_all_gather_matmul(shards[rank].float(), [b.float()], 1)
    assert_close(out, torch.cat(shards, 1) @ b, torch.float32, msg="AG world 3 dim 1")
    a_all, b_all = [rand(2, 3, 8) for _ in range(world)], [rand(8, 5) for _ in range(world)]
    out = fused_matmul_reduce_scatter(a_all[rank].float(), b_all[rank].float(), "avg", 1)
    want = (sum(a @ b for a, b in zip(a_all, b_all)) / world).chunk(world, 1)[rank]
    assert_close(out, want, torch.float32, msg="RS world 3 avg dim 1")

    # parallel linears, sequence parallel, one token per rank, no bias: out and every gradient
    x, w, g = rand(world, 2, 6).requires_grad_(), rand(9, 6).requires_grad_(), rand(world, 2, 9)
    y = x @ w.t()
    dx, dw = torch.autograd.grad(y, [x, w], g)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        column = cls is ColumnParallelLinear
        layer = cls(6, 9, bias=False, sequence_parallel=True, dtype=torch.float32)
        with torch.no_grad():
            layer.weight.copy_(w.chunk(world, 0 if column else 1)[rank])
        x_in = (x.detach().chunk(world, 0) if column else x.detach().chunk(world, -1))[rank]
        x_in = x_in.float().requires_grad_()
        out = layer(x_in)
        out.backward((g.chunk(world, -1) if column else g.chunk(world, 0))[rank].float())
        checks = [
            ("out", out, (y.detach().chunk(world, -1) if column else y.detach().chunk(world, 0))[rank]),
            ("dx", x_in.grad, (dx.chunk(world, 0) if column else dx.chunk(world, -1))[rank]),
            ("dw", layer.weight.grad, dw.chunk(world, 0 if column else 1)[rank]),
        ]
        for name, got, want in checks:
            assert_close(got, want, torch.float32, msg=f"{cls.__name__} world 3 {name}")


def test_world_size_3_cp_attention_async_tp_and_parallel_linears():
    run_distributed(_body_world3, world_size=3, timeout_s=90)
