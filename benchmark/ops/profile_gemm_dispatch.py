"""Where the bf16 GEMM dispatcher loses to torch.matmul at the small bench shapes: a diagnosis tool.

    python benchmark/ops/profile_gemm_dispatch.py [--out DIR]

1. Host us to issue one call (a 1024^3 GEMM: the GPU time is below the host's, so the loop measures the
   host), forward and forward+backward, for torch.matmul, turbo pinned CUBLAS, turbo pinned TRITON (with and
   without the direct relaunch of ``primus_turbo/triton/launch.py``: a same-process A/B) and the dispatcher
   with autotune.
2. Host us inside ``GemmFunction.backward`` (autograd's device thread) and its two GEMM calls, against the
   whole fwd+bwd step, CUBLAS and TRITON pinned.
3. Host us per ``gemm_forward`` call for the forward, dgrad and wgrad layouts, from the main thread and from
   another thread, CUBLAS and TRITON pinned.
4. At the bench shapes where the dispatcher or TRITON fell below target (session 32, 2x H200): the backend
   the autotuner picked for each of the three GEMMs (forward, dgrad, wgrad), and each GEMM alone on CUBLAS
   and TRITON (do_bench median us, the Triton config its autotuner chose).

Writes DIR/profile_gemm_dispatch.txt. Not a benchmark of record (bench_gemm.py is).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import bench_ms, bench_parser, host_ms, out_dir  # noqa: E402

import primus_turbo.pytorch as turbo  # noqa: E402
from primus_turbo.pytorch.core.backend import GlobalBackendManager  # noqa: E402
from primus_turbo.pytorch.kernels.gemm.gemm_impl import GemmDispatcher  # noqa: E402
from primus_turbo.triton.gemm import gemm_kernel  # noqa: E402
from primus_turbo.triton.launch import set_relaunch  # noqa: E402

SHAPES = [(4096, 2048, 2048), (4096, 2048, 4096), (4096, 4096, 2048), (8192, 2048, 2048), (8192, 2048, 4096)]
MODES = ("torch", "CUBLAS", "TRITON", "auto")


def _mode(mode: str) -> None:
    GlobalBackendManager.reset()
    if mode in ("CUBLAS", "TRITON"):
        GlobalBackendManager.set_gemm_backend(mode)
    GlobalBackendManager.set_auto_tune(mode == "auto")


def _fns(mode, x, w, g):
    if mode == "torch":
        fwd = lambda: x @ w.T  # noqa: E731
    else:
        fwd = lambda: turbo.ops.gemm(x, w, trans_b=True)  # noqa: E731
    return fwd, lambda: torch.autograd.grad(fwd(), (x, w), g)


def host_table(report: io.StringIO) -> None:
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    report.write("## host us per call, 1024^3 bf16 (the loop issues without a sync)\n\n")
    report.write("| path | fwd us | fwd+bwd us |\n|---|---|---|\n")
    rows = [(mode, True) for mode in MODES] + [("TRITON", False)]
    for mode, relaunch in rows:
        _mode(mode)
        set_relaunch(relaunch)
        fwd, step = _fns(mode, x, w, g)
        step()
        f_us = host_ms(fwd, n=300, warmup=20) * 1e3
        s_us = host_ms(step, n=300, warmup=20) * 1e3
        label = mode if relaunch else f"{mode} without the relaunch (PRIMUS_TURBO_TRITON_RELAUNCH=0)"
        report.write(f"| {label} | {f_us:.1f} | {s_us:.1f} |\n")
    set_relaunch(True)
    GlobalBackendManager.reset()


def backward_table(report: io.StringIO) -> None:
    """Host time inside ``GemmFunction.backward`` (on autograd's device thread, which cProfile does not see)
    against the whole step, TRITON and CUBLAS pinned: session 33 found a TRITON backward GEMM costing the host
    ~2x a forward one. Counters start after the warm-up (the first calls autotune)."""
    import time

    gemm_mod = sys.modules["primus_turbo.pytorch.ops.gemm"]
    acc = {"bwd": 0.0, "gemm": 0.0, "n": 0, "inside": False}
    orig_bwd, orig_fwd = gemm_mod.GemmFunction.backward, gemm_mod.gemm_forward

    def timed_bwd(ctx, grad):
        start = time.perf_counter()
        acc["inside"] = True
        try:
            out = orig_bwd(ctx, grad)
        finally:
            acc["inside"] = False
        acc["bwd"] += time.perf_counter() - start
        acc["n"] += 1
        return out

    def timed_gemm(*args, **kwargs):  # counts the backward's GEMM calls only
        start = time.perf_counter()
        out = orig_fwd(*args, **kwargs)
        if acc["inside"]:
            acc["gemm"] += time.perf_counter() - start
        return out

    report.write("\n## host us per fwd+bwd step through GemmFunction, 1024^3 bf16\n\n")
    report.write("| backend | step us | in backward us | in its 2 GEMM calls us | rest of the step us |\n")
    report.write("|---|---|---|---|---|\n")
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    try:
        gemm_mod.GemmFunction.backward = staticmethod(timed_bwd)
        for backend in ("CUBLAS", "TRITON"):
            _mode(backend)

            def step():
                out = gemm_mod.GemmFunction.apply(x, w, False, True, bf16, False, None)
                return torch.autograd.grad(out, (x, w), g)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            gemm_mod.gemm_forward = timed_gemm
            acc.update(bwd=0.0, gemm=0.0, n=0)
            step_us = host_ms(step, n=200, warmup=0) * 1e3
            gemm_mod.gemm_forward = orig_fwd
            bwd_us, gemm_us = (acc[k] / acc["n"] * 1e6 for k in ("bwd", "gemm"))
            row = (backend, step_us, bwd_us, gemm_us, step_us - bwd_us)
            report.write("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n".format(*row))
    finally:
        gemm_mod.GemmFunction.backward = orig_bwd
        gemm_mod.gemm_forward = orig_fwd
        GlobalBackendManager.reset()


def thread_table(report: io.StringIO) -> None:
    """Host us per ``gemm_forward`` call (the dispatcher and the kernel launch, no autograd), TRITON and
    CUBLAS pinned, 1024^3 bf16, for the three layouts of nn.Linear's GEMMs, issued from the main thread and
    from a plain ``threading.Thread``: separates "the backward's layouts cost more" from "autograd's thread
    costs more" (session 34: a TRITON backward GEMM call took ~121 us, the whole TRITON forward op 114)."""
    import threading

    from primus_turbo.pytorch.kernels.gemm.gemm_impl import gemm_forward

    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    layouts = {
        "fwd (NT)": (x, w, False, True),
        "dgrad (NN)": (g, w, False, False),
        "wgrad (TN)": (g, x, True, False),
    }
    report.write("\n## host us per gemm_forward call by layout and thread, 1024^3 bf16\n\n")
    report.write("| backend | layout | main thread us | other thread us |\n|---|---|---|---|\n")
    for backend in ("CUBLAS", "TRITON"):
        _mode(backend)
        for name, (a, b, ta, tb) in layouts.items():
            call = lambda a=a, b=b, ta=ta, tb=tb: gemm_forward(a, b, ta, tb, torch.bfloat16)  # noqa: E731
            main_us = host_ms(call, n=300, warmup=20) * 1e3
            result = {}

            def on_thread(call=call, result=result):
                result["us"] = host_ms(call, n=300, warmup=20) * 1e3

            worker = threading.Thread(target=on_thread)
            worker.start()
            worker.join()
            report.write(f"| {backend} | {name} | {main_us:.1f} | {result['us']:.1f} |\n")
    GlobalBackendManager.reset()


def _triton_cfg() -> str:
    """The config the default (device-descriptor TMA) kernel's autotuner chose ("pointer": none ran)."""
    for kernel in (gemm_kernel.gemm_tma_device_persistent_kernel, gemm_kernel.gemm_tma_persistent_kernel):
        best = getattr(kernel, "best_config", None)
        if best is not None:
            kw = best.kwargs
            return f"{kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']} w{best.num_warps} s{best.num_stages}"
    return "pointer"


def shape_table(report: io.StringIO) -> None:
    report.write("\n## per GEMM at the small bench shapes (do_bench median us)\n\n")
    report.write("| M,N,K | GEMM | autotune pick | CUBLAS us | TRITON us | TRITON / CUBLAS ")
    report.write("| Triton config |\n")
    report.write("|---|---|---|---|---|---|---|\n")
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_()
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        # the three GEMMs of nn.Linear as ops.gemm issues them: (a, b, trans_a, trans_b)
        gemms = {
            "fwd": (x.detach(), w.detach(), False, True),
            "dgrad": (g, w.detach(), False, False),
            "wgrad": (g, x.detach(), True, False),
        }
        _mode("auto")
        torch.autograd.grad(turbo.ops.gemm(x, w, trans_b=True), (x, w), g)
        picks = {}
        for name, (a, b, ta, tb) in gemms.items():
            kw = {"a": a, "b": b, "trans_a": ta, "trans_b": tb, "out_dtype": torch.bfloat16}
            picks[name] = GemmDispatcher.resolve(**kw).name
        for name, (a, b, ta, tb) in gemms.items():
            row = {}
            for backend in ("CUBLAS", "TRITON"):
                _mode(backend)
                fn = lambda a=a, b=b, ta=ta, tb=tb: turbo.ops.gemm(a, b, trans_a=ta, trans_b=tb)  # noqa: E731
                fn()
                row[backend] = bench_ms(fn, warmup_ms=10, rep_ms=100)[0] * 1e3
                if backend == "TRITON":
                    row["cfg"] = _triton_cfg()
            report.write(
                f"| {m}x{n}x{k} | {name} | {picks[name]} | {row['CUBLAS']:.1f} | {row['TRITON']:.1f} | "
                f"{row['CUBLAS'] / row['TRITON']:.2f}x | {row['cfg']} |\n"
            )
    GlobalBackendManager.reset()


def main() -> None:
    args = bench_parser(__doc__).parse_args()
    report = io.StringIO()
    report.write(f"# GEMM dispatch diagnosis on {torch.cuda.get_device_name()}\n\n")
    host_table(report)
    backward_table(report)
    thread_table(report)
    shape_table(report)
    text = report.getvalue()
    print(text)
    (out_dir(args) / "profile_gemm_dispatch.txt").write_text(text)


if __name__ == "__main__":
    main()
