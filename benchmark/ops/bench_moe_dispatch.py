"""Expert-parallel dispatch/combine bandwidth per rank: TURBO (symmetric memory) vs NCCL all_to_all.

    torchrun --nproc_per_node=2 benchmark/ops/bench_moe_dispatch.py --quick   # DeepSeek-V3 size only
    torchrun --nproc_per_node=2 benchmark/ops/bench_moe_dispatch.py           # + V2-Lite, more tokens

Rows per backend: "raw" = moe_dispatch / moe_combine alone; "+permute" = TokenDispatcher
token_dispatch / token_combine (all-to-all plus the local permute/unpermute to expert order: the
full cost a MoE layer pays). Forward columns are dispatch, Backward columns are combine. GB/s =
bytes of the token rows this rank sends (bf16, self-sends included) / time. Fixed iteration counts
on every rank (do_bench's adaptive count could differ across ranks and deadlock a collective).
Runs on gloo/CPU too (smoke only: timings meaningless).

    BENCH_EP_SMS=16,32,64,132   also time TURBO raw dispatch/combine at these SM (program) counts
    BENCH_PROFILE=1             print rank 0's top CUDA kernels of 5 full dispatch+combine rounds per backend
                                and its Python hot spots (cProfile) of 20 raw dispatch+combine calls

TURBO sizes its receive buffers for PRIMUS_TURBO_EP_MAX_TOKENS tokens per rank (no host sync, so a
worst case; DeepEP's num_worst_tokens). Unless that variable is set, each case sets it to its own
token count, as a training run configured with its micro-batch would.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import MEMORY_COLUMNS, bench_parser, gbps, out_dir, print_table, write_csv  # noqa: E402

from primus_turbo.pytorch.core.backend import GlobalBackendManager  # noqa: E402
from primus_turbo.pytorch.kernels.moe.dispatch_impl import DispatchTurbo, dispatch_layout  # noqa: E402
from primus_turbo.pytorch.modules.token_dispatcher import TokenDispatcher  # noqa: E402
from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch  # noqa: E402

WARMUP, ITERS = 5, 20
USER_MAX_TOKENS = "PRIMUS_TURBO_EP_MAX_TOKENS" in os.environ


def _time_ms(fn, device) -> float:
    for _ in range(WARMUP):
        fn()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ITERS):
            fn()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / ITERS
    else:
        t0 = time.perf_counter()
        for _ in range(ITERS):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / ITERS
    # report the slowest rank: a collective is as fast as its slowest participant
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _inputs(t, h, e, k, device, rank):
    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    scores = torch.rand(t, e, generator=g) + torch.linspace(0.3, 0.0, e)  # mildly skewed routing
    probs, indices = scores.topk(k, dim=-1)
    x = torch.randn(t, h, generator=g).to(device=device, dtype=torch.bfloat16)
    return x, indices.to(device), (probs / probs.sum(-1, keepdim=True)).to(device)


def bench_case(name, t, h, e, k, device, backends):
    world, rank = dist.get_world_size(), dist.get_rank()
    if not USER_MAX_TOKENS:
        os.environ["PRIMUS_TURBO_EP_MAX_TOKENS"] = str(t)
    x, indices, probs = _inputs(t, h, e, k, device, rank)
    send_rows = int(dispatch_layout(indices, e, world)[0].sum())
    nbytes = send_rows * h * x.element_size()
    rows, results = [], {}
    shape = f"{name} T{t} H{h} E{e} top{k} W{world}"
    for backend in backends:
        rows += _bench_backend(backend, x, indices, probs, e, k, device, nbytes, shape, results, backends[0])
    GlobalBackendManager.set_moe_dispatch_combine_backend(None)
    return rows


def _bench_backend(backend, x, indices, probs, e, k, device, nbytes, shape, results, reference):
    GlobalBackendManager.set_moe_dispatch_combine_backend(backend)
    recv_x, _, _, _, handle = moe_dispatch(x, indices, probs, e)
    out = moe_combine(recv_x, None, handle)
    results[backend] = out
    d_ms = _time_ms(lambda: moe_dispatch(x, indices, probs, e), device)
    c_ms = _time_ms(lambda: moe_combine(recv_x, None, handle), device)
    check = "PASS" if torch.equal(out, results[reference]) else "FAIL"
    rows = [_row(f"{backend} raw", shape, check, nbytes, d_ms, c_ms)]
    if backend == "TURBO" and os.environ.get("BENCH_EP_SMS"):
        from primus_turbo.pytorch.kernels.moe import ep_turbo

        default = ep_turbo.NUM_PROGRAMS
        for sms in (int(v) for v in os.environ["BENCH_EP_SMS"].split(",")):
            ep_turbo.NUM_PROGRAMS = sms
            sd = _time_ms(lambda: moe_dispatch(x, indices, probs, e), device)
            sc = _time_ms(lambda: moe_combine(recv_x, None, handle), device)
            rows.append(_row(f"TURBO raw {sms} SMs", shape, check, nbytes, sd, sc))
        ep_turbo.NUM_PROGRAMS = default

    disp = TokenDispatcher(e, k, dist.group.WORLD)
    expert_in, _, _ = disp.token_dispatch(x, probs, indices)
    disp.token_combine(expert_in)

    def full_dispatch():
        disp.token_dispatch(x, probs, indices)
        disp._state = None

    fd_ms = _time_ms(full_dispatch, device)
    disp.token_dispatch(x, probs, indices)
    state = dict(disp._state)

    def full_combine():
        disp._state = dict(state)
        disp.token_combine(expert_in)

    fc_ms = _time_ms(full_combine, device)
    rows.append(_row(f"{backend} +permute", shape, check, nbytes, fd_ms, fc_ms))
    if os.environ.get("BENCH_PROFILE") == "1" and device.type == "cuda":
        _profile(backend, shape, full_dispatch, full_combine)
        _host_profile(backend, lambda: moe_combine(moe_dispatch(x, indices, probs, e)[0], None, handle))
    return rows


def _host_profile(backend, fn):
    """Python hot spots of 20 raw dispatch+combine calls (cProfile on every rank, rank 0 prints)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    dist.barrier()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(20):
        fn()
    prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / 20
    torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(
            f"== host profile {backend} raw dispatch+combine: {host_ms:.3f} ms per call (host, cProfile on)"
        )
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def _profile(backend, shape, full_dispatch, full_combine):
    """Top CUDA kernels of 5 full dispatch+combine rounds (every rank profiles, rank 0 prints)."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            full_dispatch()
            full_combine()
        torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"== profile {backend} +permute, {shape}, 5 rounds (times are totals over the 5)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


def _row(label, shape, check, nbytes, d_ms, c_ms):
    return {
        "label": label,
        "shape": shape,
        "dtype": "bfloat16",
        "Check": check,
        "Forward GB/s": gbps(nbytes, d_ms),
        "Forward Time (ms)": d_ms,
        "Backward GB/s": gbps(nbytes, c_ms),
        "Backward Time (ms)": c_ms,
    }


def main():
    args = bench_parser(__doc__).parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    cases = [("DeepSeek-V3", 4096, 7168, 256, 8)]
    if not args.quick:
        cases += [
            ("V2-Lite", 4096, 2048, 64, 6),
            ("DeepSeek-V3", 8192, 7168, 256, 8),
            ("V2-Lite", 8192, 2048, 64, 6),
        ]
    if not on_gpu:
        cases = [("smoke", 64, 128, 16, 4)]
    probe = torch.zeros(1, 8, device=device)
    turbo_ok = DispatchTurbo.can_handle(kind="dispatch", x=probe, group=dist.group.WORLD)
    backends = ["NCCL"] + (["TURBO"] if turbo_ok else [])
    rows = []
    for case in cases:
        rows += bench_case(*case, device, backends)
    if dist.get_rank() == 0:
        name = "bench_moe_dispatch_quick.csv" if args.quick else "bench_moe_dispatch.csv"
        write_csv(out_dir(args) / name, rows, MEMORY_COLUMNS)
        print_table(rows, MEMORY_COLUMNS)
        main_rows = [r for r in rows if "SMs" not in r["label"]]  # the SM sweep rows are extra
        for i in range(0, len(main_rows), 2 * len(backends)):
            group = main_rows[i : i + 2 * len(backends)]
            if len(group) == 4:  # NCCL raw, NCCL +permute, TURBO raw, TURBO +permute
                nccl = group[1]["Forward Time (ms)"] + group[1]["Backward Time (ms)"]
                turbo = group[3]["Forward Time (ms)"] + group[3]["Backward Time (ms)"]
                print(
                    f"{group[0]['shape']}: TURBO dispatch+combine (+permute) "
                    f"{nccl / turbo:.2f}x the NCCL path"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
