"""Context-parallel attention (Ulysses, ring with zigzag) against single-process attention.

CPU: 2 gloo ranks, TORCH backend (and TRITON in the interpreter), fwd and bwd. GPU (multigpu): 2
NCCL ranks, bf16, TRITON, SNR gates.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

# (name, b, s, hq, hk, d, dv, causal, sink, mode)
CPU_CASES = [
    ("ring_causal", 2, 32, 2, 2, 16, 16, True, False, "ring"),
    ("ring_full_gqa_mla", 1, 24, 4, 2, 24, 16, False, False, "ring"),
    ("ring_causal_sink", 1, 32, 2, 1, 16, 16, True, True, "ring"),
    ("ulysses_causal_sink", 2, 16, 4, 2, 16, 16, True, True, "ulysses"),
]


def _body(rank, world_size, device, cases, backend, dtype, shape_scale):
    """Several cases per spawn: process start-up (torch + triton import) dominates CPU time."""
    for case in cases:
        _one_case(rank, world_size, device, case, backend, dtype, shape_scale)


def _one_case(rank, world_size, device, case, backend, dtype, shape_scale):
    from test_utils import SNR_ATTENTION_BF16_DB, assert_close, assert_snr

    from primus_turbo.pytorch.core.backend import GlobalBackendManager
    from primus_turbo.pytorch.ops.attention import flash_attn_func
    from primus_turbo.pytorch.ops.attention.attention_cp import (
        flash_attn_usp_func,
        gather_sequence_for_cp,
        split_sequence_for_cp,
    )

    _, b, s, hq, hk, d, dv, causal, use_sink, mode = case
    s *= shape_scale
    torch.manual_seed(0)  # the same full tensors on every rank
    q = torch.randn(b, s, hq, d, device=device, dtype=dtype)
    k = torch.randn(b, s, hk, d, device=device, dtype=dtype)
    v = torch.randn(b, s, hk, dv, device=device, dtype=dtype)
    sink = torch.randn(hq, device=device) if use_sink else None
    dout = torch.randn(b, s, hq, dv, device=device, dtype=dtype)
    GlobalBackendManager.set_attention_backend(backend)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [sink.clone().requires_grad_()] if use_sink else []
    )
    ref = flash_attn_func(*leaves[:3], causal=causal, sink=leaves[3] if use_sink else None)
    ref_grads = torch.autograd.grad(ref, leaves, dout)

    ring = mode == "ring"
    if ring:
        split = dict(seq_dim=1, ring_size=world_size, ring_rank=rank, ulysses_size=1, ulysses_rank=0)
    else:
        split = dict(seq_dim=1, ring_size=1, ring_rank=0, ulysses_size=world_size, ulysses_rank=rank)
    split["causal"] = causal
    local = [split_sequence_for_cp(t, **split).clone().requires_grad_() for t in (q, k, v)]
    local_sink = sink.clone().requires_grad_() if use_sink else None
    groups = dict(ring_group=dist.group.WORLD) if ring else dict(ulysses_group=dist.group.WORLD)
    out = flash_attn_usp_func(*local, causal=causal, sink=local_sink, **groups)
    grads = torch.autograd.grad(
        out, local + ([local_sink] if use_sink else []), split_sequence_for_cp(dout, **split)
    )

    def gathered(t):
        shards = [torch.empty_like(t) for _ in range(world_size)]
        dist.all_gather(shards, t.contiguous())
        return gather_sequence_for_cp(shards, 1, split["ring_size"], split["ulysses_size"], causal)

    results = [gathered(out)] + [gathered(g) for g in grads[:3]]
    if use_sink:
        dsink = grads[3].clone()
        dist.all_reduce(dsink)  # each rank holds its rows' (ring) or its heads' (Ulysses) share
        results.append(dsink)
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsink"), results, (ref, *ref_grads)):
        if dtype == torch.bfloat16:
            assert_snr(got, want, SNR_ATTENTION_BF16_DB, f"{case[0]} {name}")
        else:
            assert_close(got, want, dtype, f"{case[0]} {name} rank {rank}")


def test_cp_gloo_cpu():
    """TORCH backend on every case, then TRITON (interpreter) on the causal ring with a sink."""
    run_distributed(_body, world_size=2, backend="gloo", args=(CPU_CASES, "TORCH", torch.float32, 1))
    run_distributed(_body, world_size=2, backend="gloo", args=(CPU_CASES[2:3], "TRITON", torch.float32, 1))


def test_zigzag_split_roundtrip():
    from primus_turbo.pytorch.ops.attention.attention_cp import gather_sequence_for_cp, split_sequence_for_cp

    x = torch.arange(32).view(1, 32)
    shards = [split_sequence_for_cp(x, 1, 2, r, 2, u, causal=True) for r in range(2) for u in range(2)]
    assert shards[0].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]] and shards[1].tolist() == [
        [24, 25, 26, 27, 28, 29, 30, 31]
    ]
    assert torch.equal(gather_sequence_for_cp(shards, 1, 2, 2, causal=True), x)


@pytest.mark.multigpu
def test_cp_triton_nccl_bf16():
    """2 GPUs, bf16, S = 64x the CPU shapes, head dims 128 (MLA case: 128/64), SNR >= 40 dB."""
    cases = [(*c[:5], 128, 128 if c[6] == c[5] else 64, *c[7:]) for c in CPU_CASES]
    run_distributed(_body, world_size=2, backend="nccl", args=(cases, "TRITON", torch.bfloat16, 64))
