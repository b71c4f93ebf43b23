"""Async-TP on 2 GPUs: all-gather+GEMM and GEMM+reduce-scatter, every backend vs unfused vs GEMM alone.

    torchrun --nproc_per_node=2 benchmark/ops/bench_async_tp.py --quick   # bf16, 4 shapes (< 60 s)
    BENCH_PROFILE=1 torchrun ...   # also the CUDA kernels + host time of 5 TURBO calls per shape
    torchrun --nproc_per_node=2 benchmark/ops/bench_async_tp.py           # + FP8 rowwise/tensorwise,
                                                                          #   TURBO num_splits sweep,
                                                                          #   Column+Row layers fwd/bwd

Shapes (M, K, N) are the global problem: AG+GEMM (column-parallel) gathers a [M/tp, K] shard and
multiplies by a [K, N/tp] weight shard; GEMM+RS (row-parallel) multiplies [M, K/tp] by
[K/tp, N] and reduce-scatters to [M/tp, N]. Per rank FLOPs: 2*M*K*N/tp for both.
Rows: "gemm only" (the rank's whole GEMM on random data, no comm: AG [M, K] x [K, N/tp], RS
[M, K/tp] x [K/tp, N]; the floor a fused op can approach), "comm only" (the NCCL collective alone),
"unfused" (NCCL backend: collective then GEMM, or GEMM then collective), SYMM_MEM (torch's fused
symm-mem ops), TURBO (push pipeline), TURBO splits=k (forced row blocks), dispatcher (backend=None).
Forward TFLOPS is per GPU. "vs unfused" = unfused time / row time. Check: PASS when the output
matches the unfused output of the same precision (bf16: rtol=atol=1e-2; FP8: SNR >= 25 dB).

Timing: collectives need the same call count on every rank, so instead of do_bench (which picks
its repetition count per rank) a fixed number of iterations is timed with CUDA events, 5 times;
the median is taken and the max over ranks reported. The GPU box must keep NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 (set here if absent).
Target (2x H200): TURBO >= 1.15x unfused for both ops at the first three shapes; the dispatcher row
(its label names the backend the default rule picked) never below unfused.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import GEMM_COLUMNS, bench_parser, out_dir, print_table, tflops, write_csv  # noqa: E402

from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import (  # noqa: E402
    AllGatherMatmulDispatcher,
    MatmulReduceScatterDispatcher,
)
from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from primus_turbo.pytorch.ops.async_tp import (  # noqa: E402
    fused_all_gather_matmul,
    fused_all_gather_scaled_matmul,
    fused_matmul_reduce_scatter,
    fused_scaled_matmul_reduce_scatter,
    quantize_for_async_tp,
)

SHAPES = [(8192, 4096, 14336), (8192, 8192, 8192), (16384, 7168, 2048), (4096, 4096, 4096)]
EXTRA_COLUMNS = ["op", "precision", "vs unfused", "vs gemm only", "host ms"]


def time_ms(fn, iters: int, host: list | None = None) -> float:
    """Median device ms per call (max over ranks); appends the host's enqueue ms per call to ``host``
    (a call whose host time is near its device time is launch-bound, not GPU-bound)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples, host_samples = [], []
    for _ in range(5):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host_samples.append((time.perf_counter() - t0) * 1e3 / iters)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    ms = torch.tensor([statistics.median(samples), statistics.median(host_samples)], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    if host is not None:
        host.append(round(float(ms[1]), 4))
    return float(ms[0])


def snr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.float(), out.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum().clamp_min(1e-30)))


def _check(ref: torch.Tensor, out: torch.Tensor, fp8: bool) -> tuple[str, float]:
    snr = snr_db(ref, out)
    if fp8:
        ok = snr >= 25.0
    else:
        ok = torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    ok_t = torch.tensor(int(ok), device="cuda")
    dist.all_reduce(ok_t, op=dist.ReduceOp.MIN)
    return ("PASS" if ok_t.item() else "FAIL"), snr


def _ag_case(M, K, N, world, precision):
    """Callables for AG+GEMM at one shape: {label: fn returning the output}, gemm-only, comm-only."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    a = torch.randn(M // world, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    b = torch.randn(K, N // world, device="cuda", dtype=torch.bfloat16) / K**0.5
    # random, not torch.empty: an all-zero operand (fresh allocations often are) lets the GEMM clock
    # higher (less switching power) -- "gemm only" once read 876 TFLOP/s, above cuBLAS's real ~730
    full = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    if precision == "bf16":
        run = lambda backend, splits=None: fused_all_gather_matmul(  # noqa: E731
            a, [b], 0, return_a=False, backend=backend, num_splits=splits
        )[1][0]
        gemm = lambda: full @ b  # noqa: E731
    else:
        rowwise = precision == "fp8 rowwise"
        a_q, a_s = quantize_for_async_tp(
            a, torch.float8_e4m3fn, 1 if rowwise else None, dist.group.WORLD.group_name
        )
        bt_q, b_s = quantize_for_async_tp(b.t().contiguous(), torch.float8_e4m3fn, 1 if rowwise else None)
        b_s = b_s.view(1, -1) if rowwise else b_s
        run = lambda backend, splits=None: fused_all_gather_scaled_matmul(  # noqa: E731
            a_q, [bt_q.t()], a_s, [b_s], 0, return_a=False, backend=backend, num_splits=splits
        )[2][0]
        fq = torch.randn(M, K, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        fs = torch.ones(M, 1, device="cuda") if rowwise else a_s
        gemm = lambda: torch._scaled_mm(fq, bt_q.t(), fs, b_s, out_dtype=torch.bfloat16)  # noqa: E731
        full = fq.view(torch.uint8)
        a = a_q.view(torch.uint8)
    comm = lambda: dist.all_gather_into_tensor(full, a)  # noqa: E731
    return run, gemm, comm


def _rs_case(M, K, N, world, precision):
    gen = torch.Generator(device="cuda").manual_seed(4321 + dist.get_rank())
    a = torch.randn(M, K // world, device="cuda", generator=gen, dtype=torch.bfloat16)
    b = torch.randn(K // world, N, device="cuda", generator=gen, dtype=torch.bfloat16) / K**0.5
    partial = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M // world, N, device="cuda", dtype=torch.bfloat16)
    if precision == "bf16":
        run = lambda backend, splits=None: fused_matmul_reduce_scatter(  # noqa: E731
            a, b, "sum", 0, backend=backend, num_splits=splits
        )
        gemm = lambda: a @ b  # noqa: E731
    else:
        rowwise = precision == "fp8 rowwise"
        a_q, a_s = quantize_for_async_tp(a, torch.float8_e4m3fn, 1 if rowwise else None)
        bt_q, b_s = quantize_for_async_tp(b.t().contiguous(), torch.float8_e4m3fn, 1 if rowwise else None)
        b_s = b_s.view(1, -1) if rowwise else b_s
        run = lambda backend, splits=None: fused_scaled_matmul_reduce_scatter(  # noqa: E731
            a_q, bt_q.t(), a_s, b_s, "sum", 0, backend=backend, num_splits=splits
        )
        gemm = lambda: torch._scaled_mm(a_q, bt_q.t(), a_s, b_s, out_dtype=torch.bfloat16)  # noqa: E731
    comm = lambda: dist.reduce_scatter_tensor(out, partial)  # noqa: E731
    return run, gemm, comm


def bench_shape(M, K, N, op, precision, quick, iters) -> list[dict]:
    world = dist.get_world_size()
    run, gemm, comm = (_ag_case if op == "AG+GEMM" else _rs_case)(M, K, N, world, precision)
    flop = 2 * M * K * N / world
    fp8 = precision != "bf16"
    ref = run("NCCL")
    variants = [("unfused", "NCCL", None), ("SYMM_MEM", "SYMM_MEM", None), ("TURBO", "TURBO", None)]
    if not quick:
        variants += [(f"TURBO splits={s}", "TURBO", s) for s in (1, 2, 4)]
    variants.append(("dispatcher", None, None))
    base = dict(B=1, M=M, N=N, K=K, op=op, precision=precision)
    gemm_ms, comm_ms = time_ms(gemm, iters), time_ms(comm, iters)
    rows = [
        dict(base, label=f"{op} gemm only (rank's full GEMM)", Check="", **{"Forward Time (ms)": gemm_ms}),
        dict(base, label=f"{op} comm only (NCCL)", Check="", **{"Forward Time (ms)": comm_ms}),
    ]
    unfused_ms = None
    for label, backend, splits in variants:
        try:
            out = run(backend, splits)
            check, snr = _check(ref, out, fp8)
            host = []
            ms = time_ms(lambda backend=backend, splits=splits: run(backend, splits), iters, host)
        except Exception as e:  # keep the table going; the failure is in the row
            if dist.get_rank() == 0:
                print(f"{op} {precision} {M}x{K}x{N} {label}: {type(e).__name__}: {e}")
            rows.append(dict(base, label=f"{op} {label}", Check=f"ERROR {type(e).__name__}"))
            continue
        unfused_ms = ms if backend == "NCCL" else unfused_ms
        if backend == "TURBO" and splits is None and os.environ.get("BENCH_PROFILE") == "1":
            _profile(f"{op} {precision} {M}x{K}x{N} TURBO", lambda backend=backend: run(backend))
        if backend is None:  # name the backend the default rule picked
            disp = AllGatherMatmulDispatcher if op == "AG+GEMM" else MatmulReduceScatterDispatcher
            label = f"{label} ({disp.last_backend.name if disp.last_backend else '?'})"
        rows.append(
            dict(
                base,
                label=f"{op} {label}",
                Check=check,
                out_snr=round(snr, 1),
                **{
                    "Forward TFLOPS": tflops(flop, ms),
                    "Forward Time (ms)": ms,
                    "vs unfused": (unfused_ms / ms) if unfused_ms else "",
                    "vs gemm only": gemm_ms / ms,
                    "host ms": host[0],
                },
            )
        )
    for r in rows[:2]:
        r["Forward TFLOPS"] = tflops(flop, r["Forward Time (ms)"]) if "gemm" in r["label"] else ""
    return rows


def _profile(title: str, fn) -> None:
    """BENCH_PROFILE=1: rank 0's CUDA kernels of 5 calls and Python hot spots of 20 (every rank runs)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    dist.barrier()
    host = cProfile.Profile()
    host.enable()
    for _ in range(20):
        fn()
    host.disable()
    torch.cuda.synchronize()
    if dist.get_rank() == 0:
        print(f"== profile {title}, 5 calls (totals over the 5)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
        print(f"== host hot spots {title}, 20 calls (cProfile)")
        pstats.Stats(host).sort_stats("tottime").print_stats(14)


def bench_layers(M, K, N, iters) -> list[dict]:
    """Column(K -> N) then Row(N -> K) with sequence parallel (an MLP without activation), fwd and
    fwd+bwd, per backend: what a transformer layer sees, including the overlapped backward."""
    world = dist.get_world_size()
    x = torch.randn(M // world, 1, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M // world, 1, K, device="cuda", dtype=torch.bfloat16)
    rows, base_ms = [], None
    for backend in ("NCCL", "TURBO", "SYMM_MEM"):
        kw = dict(sequence_parallel=True, backend=backend, device="cuda", dtype=torch.bfloat16)
        col, row = ColumnParallelLinear(K, N, bias=False, **kw), RowParallelLinear(N, K, bias=False, **kw)

        def fwd(col=col, row=row):
            return row(col(x))

        def fwd_bwd(col=col, row=row):
            row(col(x)).backward(dy)

        try:
            f_ms, fb_ms = time_ms(fwd, iters), time_ms(fwd_bwd, iters)
        except Exception as e:
            if dist.get_rank() == 0:
                print(f"layers {backend}: {type(e).__name__}: {e}")
            continue
        base_ms = base_ms or fb_ms
        flop = 2 * 2 * M * K * N / world
        rows.append(
            dict(
                label=f"Column+RowParallelLinear {backend}",
                B=1,
                M=M,
                N=N,
                K=K,
                op="layers fwd+bwd",
                precision="bf16",
                Check="",
                **{
                    "Forward TFLOPS": tflops(flop, f_ms),
                    "Forward Time (ms)": f_ms,
                    "Backward TFLOPS": tflops(2 * flop, fb_ms - f_ms),
                    "Backward Time (ms)": fb_ms - f_ms,
                    "vs unfused": base_ms / fb_ms,
                },
            )
        )
    return rows


def main() -> None:
    args = bench_parser(__doc__.splitlines()[0]).parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    precisions = ["bf16"] if args.quick else ["bf16", "fp8 rowwise", "fp8 tensorwise"]
    iters = 10 if args.quick else 30
    rows = []
    for precision in precisions:
        for M, K, N in SHAPES:
            for op in ("AG+GEMM", "GEMM+RS"):
                rows += bench_shape(M, K, N, op, precision, args.quick, iters)
    if not args.quick:
        for M, K, N in SHAPES[:2]:
            rows += bench_layers(M, K, N, iters)
    if dist.get_rank() == 0:
        columns = GEMM_COLUMNS + EXTRA_COLUMNS
        write_csv(out_dir(args) / "async_tp.csv", rows, columns)
        print_table(
            rows,
            [
                "label",
                "precision",
                "M",
                "K",
                "N",
                "Check",
                "Forward Time (ms)",
                "Forward TFLOPS",
                "vs unfused",
                "vs gemm only",
                "host ms",
                "out_snr",
            ],
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
