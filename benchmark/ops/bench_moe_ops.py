"""MoE memory-bound ops: router, permute/unpermute, swiglu_with_probs / geglu_with_probs, in GB/s.

turbo (Triton; permute also the csrc TURBO kernel) vs eager PyTorch (Megatron-Core's formulation)
vs torch.compile of the same eager code, plus a device-copy line (the bandwidth ceiling).

    python benchmark/ops/bench_moe_ops.py --quick      # one shape per op, < 60 s on H200
    python benchmark/ops/bench_moe_ops.py              # DeepSeek-V3 and V2-Lite shapes

Bytes counted are the minimum an ideal kernel moves (inputs read once, outputs written once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (  # noqa: E402
    MEMORY_COLUMNS,
    bench_ms,
    bench_parser,
    gbps,
    host_ms,
    out_dir,
    print_table,
    write_csv,
)

from primus_turbo.pytorch.kernels.moe.permute_impl import (  # noqa: E402
    PermuteTriton,
    PermuteTurbo,
    build_row_id_map,
)
from primus_turbo.pytorch.kernels.moe.router_impl import _score_code, router_forward_eager  # noqa: E402
from primus_turbo.pytorch.ops.activation import geglu_with_probs, swiglu_with_probs  # noqa: E402
from primus_turbo.pytorch.ops.moe.permute import token_permute, token_unpermute  # noqa: E402
from primus_turbo.pytorch.ops.moe.router import fused_topk_routing  # noqa: E402

QUICK = False  # --quick: torch.compile baselines only for permute and swiglu (compile time budget)


def _row(label, shape, dtype, check, fwd_bytes, fwd_ms, bwd_bytes=None, bwd_ms=None, host_us=None):
    return {
        "label": label,
        "shape": shape,
        "dtype": str(dtype).replace("torch.", ""),
        "Check": check,
        "Forward GB/s": gbps(fwd_bytes, fwd_ms),
        "Forward Time (ms)": fwd_ms,
        "Backward GB/s": gbps(bwd_bytes, bwd_ms) if bwd_ms else "",
        "Backward Time (ms)": bwd_ms if bwd_ms else "",
        "host fwd us": host_us if host_us is not None else "",
    }


def _fwd_bwd(fn, inputs, grad):
    """(fwd ms, bwd ms, host us per forward) of fn(*inputs) -> tensor; backward with retain_graph on one
    forward."""
    fwd, _ = bench_ms(lambda: fn(*inputs))
    host_us = host_ms(lambda: fn(*inputs), n=50, warmup=3) * 1e3
    out = fn(*inputs)
    bwd, _ = bench_ms(lambda: torch.autograd.grad(out, [i for i in inputs if i.requires_grad], grad,
                                                  retain_graph=True))  # fmt: skip
    return fwd, bwd, host_us


def _check(a, b, atol=2e-2):
    return "PASS" if torch.allclose(a.float(), b.float(), atol=atol, rtol=2e-2) else "FAIL"


def bench_copy(t, h):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms, _ = bench_ms(lambda: y.copy_(x))
    # write-only and read-only streams of the same buffer: the permute forward writes top_k x what it
    # reads, the unpermute reads top_k x what it writes, so their ceilings lie between these and copy
    fill_ms, _ = bench_ms(lambda: y.fill_(1.0))
    read_ms, _ = bench_ms(lambda: torch.sum(x, dtype=torch.float32))
    return [
        _row("copy (bw ceiling)", f"{t}x{h}", x.dtype, "PASS", 2 * x.numel() * 2, ms),
        _row("fill (write-only ceiling)", f"{t}x{h}", x.dtype, "PASS", x.numel() * 2, fill_ms),
        _row("sum (read-only ceiling)", f"{t}x{h}", x.dtype, "PASS", x.numel() * 2, read_ms),
    ]


def bench_router(t, e, k, groups, topk_groups):
    logits = torch.randn(t, e, device="cuda", requires_grad=True)
    bias = torch.randn(e, device="cuda") * 0.1
    kw = dict(score_function="sigmoid", num_groups=groups, topk_groups=topk_groups, scaling_factor=2.5,
              expert_bias=bias, norm_topk=True)  # fmt: skip  (DeepSeek-V3)
    score = _score_code("sigmoid", False, norm_topk=True)

    def turbo(x):
        return fused_topk_routing(x, k, **kw)[0]

    def eager(x):  # the same math in eager PyTorch
        return router_forward_eager(x, k, score, groups, topk_groups, 2.5, bias)[0]

    compiled = torch.compile(eager)
    fwd_b = t * e * (4 + 4 + 1) + t * k * 8
    bwd_b = t * e * (4 + 4 + 1 + 4)
    grad = torch.randn(t, e, device="cuda")
    rows = []
    ref = eager(logits)
    impls = [("router/turbo", turbo), ("router/eager", eager)] + (
        [] if QUICK else [("router/torch.compile", compiled)]
    )
    for label, fn in impls:
        f, b, host = _fwd_bwd(fn, (logits,), grad)
        rows.append(_row(label, f"{t}x{e} top{k} g{groups}/{topk_groups}", logits.dtype,
                         _check(fn(logits), ref), fwd_b, f, bwd_b, b, host))  # fmt: skip
    return rows


def _megatron_permute(x, routing_map, num_out):
    t = x.shape[0]
    rmap = routing_map.T.contiguous()
    idx = torch.arange(t, device=x.device).unsqueeze(0).expand_as(rmap).masked_select(rmap)
    return x.index_select(0, idx), idx


def _megatron_unpermute(y, sorted_idx, probs_t, t):
    y = y * probs_t.unsqueeze(-1)
    out = torch.zeros(t, y.shape[1], dtype=y.dtype, device=y.device)
    return out.scatter_add_(0, sorted_idx.unsqueeze(1).expand(-1, y.shape[1]), y)


def bench_permute(t, h, e, k):
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    scores = torch.rand(t, e, device="cuda")
    probs, indices = scores.topk(k, dim=-1)
    probs = probs / probs.sum(-1, keepdim=True)
    routing_map = torch.zeros(t, e, dtype=torch.bool, device="cuda").scatter_(1, indices, True)
    n = t * k
    p_bytes = n * h * 2 + t * h * 2  # read T*H, write N*H (bf16)
    rows = []

    # Forward + backward of the full ops (map construction included).
    def turbo_perm(inp):
        return token_permute(inp, indices, num_experts=e, num_out_tokens=n)[0]

    def eager_perm(inp):
        return _megatron_permute(inp, routing_map, n)[0]

    compiled_perm = torch.compile(eager_perm)
    grad = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    ref_sorted = eager_perm(x)
    # turbo groups by expert with tokens in order: same order as Megatron's routing-map permute
    for label, fn in (("permute/turbo", turbo_perm), ("permute/eager", eager_perm),
                      ("permute/torch.compile", compiled_perm)):  # fmt: skip
        f, b, host = _fwd_bwd(fn, (x,), grad)
        rows.append(_row(label, f"{t}x{h} E{e} top{k}", x.dtype, _check(fn(x), ref_sorted, 0), p_bytes, f,
                         p_bytes, b, host))  # fmt: skip

    # The row-id map alone: what token_permute runs (csrc when built), the Triton kernels, the torch path.
    from primus_turbo.pytorch.kernels.moe.permute_impl import (
        _build_row_id_map_torch,
        _build_row_id_map_triton,
    )

    map_bytes = t * k * (indices.element_size() + 4)  # read the indices, write the int32 map
    want = _build_row_id_map_torch(indices, e, n, 0, None)[0]
    builders = (("row-id-map/turbo", build_row_id_map), ("row-id-map/triton", _build_row_id_map_triton),
                ("row-id-map/torch", _build_row_id_map_torch))  # fmt: skip  (turbo: the csrc op when built)
    for label, build in builders:
        ms, _ = bench_ms(lambda build=build: build(indices, e, n, 0, None))
        host = host_ms(lambda build=build: build(indices, e, n, 0, None), n=50, warmup=3) * 1e3
        check = "PASS" if torch.equal(build(indices, e, n, 0, None)[0], want) else "FAIL"
        rows.append(_row(label, f"{t}x{k} E{e}", indices.dtype, check, map_bytes, ms, host_us=host))

    # Kernel-only: Triton vs csrc on the same row-id map (the benchmark's TRITON-vs-TURBO dispatch).
    row_id_map, _, num_rows = build_row_id_map(indices, e, n, 0, None)
    kw = dict(
        kind="permute", x=x.detach(), row_id_map=row_id_map, probs=probs, num_rows=num_rows, zero_fill=False
    )
    ukw = dict(kind="unpermute", y=ref_sorted.detach(), row_id_map=row_id_map, probs=probs, num_tokens=t)
    ref_out = PermuteTriton.execute(**kw)[0]
    for label, impl in (("permute-kernel/triton", PermuteTriton), ("permute-kernel/csrc", PermuteTurbo)):
        if not impl.can_handle(**kw):
            continue
        f, _ = bench_ms(lambda impl=impl: impl.execute(**kw))
        rows.append(_row(label, f"{t}x{h} E{e} top{k}", x.dtype, _check(impl.execute(**kw)[0], ref_out, 0),
                         p_bytes, f))  # fmt: skip
        u, _ = bench_ms(lambda impl=impl: impl.execute(**ukw))
        rows.append(_row(label.replace("permute", "unpermute"), f"{t}x{h} E{e} top{k}", x.dtype, "PASS",
                         p_bytes, u))  # fmt: skip

    # Unpermute with merging probs, fwd + bwd.
    y = ref_sorted.detach().clone().requires_grad_(True)
    probs_g = probs.clone().requires_grad_(True)
    _, _, rid, _ = token_permute(x.detach(), indices, num_experts=e, num_out_tokens=n)
    _, sorted_idx = _megatron_permute(x.detach(), routing_map, n)
    expert_major = routing_map.T.contiguous()

    def turbo_unperm(inp, w):
        return token_unpermute(inp, rid, w)

    def eager_unperm(inp, w):
        # Megatron's layout of the probs (expert-major, one per routed row), differentiable in w: training
        # needs the probs gradient (the router learns through it), so every label computes both gradients
        dense = torch.zeros(t, e, device="cuda", dtype=w.dtype).scatter(1, indices, w)
        probs_t = dense.T.contiguous().masked_select(expert_major).to(torch.bfloat16)
        return _megatron_unpermute(inp, sorted_idx, probs_t, t)

    compiled_unperm = torch.compile(eager_unperm)
    gout = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ref = turbo_unperm(y, probs_g)
    impls = [("unpermute+probs/turbo", turbo_unperm), ("unpermute+probs/eager", eager_unperm)]
    if not QUICK:
        impls.append(("unpermute+probs/torch.compile", compiled_unperm))
    for label, fn in impls:
        ins = (y, probs_g)
        f, _ = bench_ms(lambda fn=fn, ins=ins: fn(*ins))
        host = host_ms(lambda fn=fn, ins=ins: fn(*ins), n=50, warmup=3) * 1e3
        out = fn(*ins)
        b, _ = bench_ms(lambda out=out: torch.autograd.grad(out, [y, probs_g], gout, retain_graph=True))
        # backward: read the token gradients and the expert rows (for the probs gradient), write the rows'
        rows.append(_row(label, f"{t}x{h} E{e} top{k}", x.dtype, _check(out, ref, 0.1), p_bytes, f,
                         p_bytes + n * h * 2, b, host))  # fmt: skip
    return rows


def bench_permute_convert(t, h, e, k):
    """fp32 tokens in, bf16 expert rows out, and back (TorchTitan's fp32 residual stream under autocast):
    ``out_dtype`` converting inside the permute / unpermute vs the same ops in fp32 plus the two casts over
    the top_k-times larger permuted buffer (what TurboMoE ran before). Forward + backward, one row each."""
    x = torch.randn(t, h, device="cuda", requires_grad=True)
    indices = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
    probs = torch.rand(t, k, device="cuda")
    n = t * k

    def converting(inp):
        rows_, _, rid, _ = token_permute(inp, indices, num_experts=e, out_dtype=torch.bfloat16)
        # "* 1.0": a stand-in for the experts, whose bf16 output the unpermute reads
        return token_unpermute(rows_ * 1.0, rid, probs, out_dtype=torch.float32)

    def casting(inp):
        rows_, _, rid, _ = token_permute(inp, indices, num_experts=e)
        return token_unpermute((rows_.to(torch.bfloat16) * 1.0).float(), rid, probs)

    grad = torch.randn(t, h, device="cuda")
    ref = casting(x)
    # ideal bytes of the converting pair: read fp32 tokens, write / read bf16 rows, write fp32 tokens; the
    # "* 1.0" stand-in for the experts (a bf16 read and write) is in both rows
    fwd_b = t * h * 4 + n * h * 2 + n * h * 2 + t * h * 4
    rows = []
    for label, fn in (("permute+unpermute fp32<->bf16/converting", converting),
                      ("permute+unpermute fp32<->bf16/fp32 + casts", casting)):  # fmt: skip
        f, b, host = _fwd_bwd(fn, (x,), grad)
        rows.append(_row(label, f"{t}x{h} E{e} top{k}", "float32", _check(fn(x), ref, 0), fwd_b, f, fwd_b, b,
                         host))  # fmt: skip
    return rows


def bench_glu(n, inter, kind="swiglu"):
    """``swiglu_with_probs`` (silu) or ``geglu_with_probs`` (exact erf GeLU) vs eager and torch.compile."""
    x = torch.randn(n, 2 * inter, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    p = torch.rand(n, device="cuda", requires_grad=True)
    act, turbo_fn = (F.silu, swiglu_with_probs) if kind == "swiglu" else (F.gelu, geglu_with_probs)

    def eager(a, w):
        g, u = a.chunk(2, dim=-1)
        return (act(g.float()) * u.float() * w.unsqueeze(-1)).to(a.dtype)

    torch._dynamo.reset()  # one code object for both kinds and every shape: stay clear of the recompile limit
    compiled = torch.compile(eager)
    grad = torch.randn(n, inter, device="cuda", dtype=torch.bfloat16)
    fwd_b = n * 2 * inter * 2 + n * inter * 2 + n * 4
    bwd_b = n * inter * 2 + 2 * (n * 2 * inter * 2) + 2 * n * 4
    ref = eager(x, p)
    rows = []
    for label, fn in ((f"{kind}_with_probs/turbo", turbo_fn), (f"{kind}_with_probs/eager", eager),
                      (f"{kind}_with_probs/torch.compile", compiled)):  # fmt: skip
        f, b, host = _fwd_bwd(fn, (x, p), grad)
        rows.append(_row(label, f"{n}x{2 * inter}", x.dtype, _check(fn(x, p), ref), fwd_b, f, bwd_b, b,
                         host))  # fmt: skip
    return rows


def main():
    global QUICK
    args = bench_parser(__doc__).parse_args()
    QUICK = args.quick
    # the backward is timed repeatedly on one graph (retain_graph): compiled backwards must not donate
    torch._functorch.config.donated_buffer = False
    torch.manual_seed(0)
    rows = []
    if args.quick:
        shapes = [(4096, 7168, 256, 8, 8, 4, 2048)]
    else:  # DeepSeek-V3 (E256 top8, H7168, I2048) and V2-Lite (E64 top6, H2048, I1408)
        shapes = [(4096, 7168, 256, 8, 8, 4, 2048), (16384, 7168, 256, 8, 8, 4, 2048),
                  (8192, 2048, 64, 6, 1, 1, 1408), (32768, 2048, 64, 6, 1, 1, 1408)]  # fmt: skip
    for t, h, e, k, g, kg, inter in shapes:
        rows += bench_copy(t * k, h)
        rows += bench_router(t, e, k, g, kg)
        rows += bench_permute(t, h, e, k)
        rows += bench_permute_convert(t, h, e, k)
        rows += bench_glu(t * k, inter, "swiglu")
        rows += bench_glu(t * k, inter, "geglu")
    path = out_dir(args) / ("bench_moe_ops_quick.csv" if args.quick else "bench_moe_ops.csv")
    write_csv(path, rows, MEMORY_COLUMNS + ["host fwd us"])
    print_table(rows, MEMORY_COLUMNS + ["host fwd us"])


if __name__ == "__main__":
    main()
