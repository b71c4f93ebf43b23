"""train.py under torch.profiler for a few steps after warm-up: the op table that says what dominates a step.

compare.py launches this instead of train.py when ``profile=true`` (same Hydra overrides). Steps are marked
by wrapping ``StepMetrics.record`` (called once per step on every rank), so train.py needs no hook. Rank 0
writes ``$E2E_PROFILE_OUT`` (JSON), per profiled step: the wall time, the summed GPU kernel time and the
top kernels (CUDA), the top host ops by self CPU time (both devices; on CPU runs they are ``top``), and the
blocking CUDA calls per step by the op that made them (``E2E_PROFILE_STACKS=1`` adds their Python callers).
``gpu_idle``: the GPU's idle time per step (gaps between kernels, streams merged) by the host op whose launch
ended each gap (with E2E_PROFILE_STACKS=1, its Python callers): where the GPU waits for the host.
``E2E_PROFILE_KERNEL=substr``: ``kernel_calls``, every profiled launch of the kernels whose name holds
``substr``, in launch order with its GPU time (which of a step's launches is slow), and ``adamw_launches``:
what each turbo AdamW's kept plans launch per step (``AdamW.launches()``: tensors, elements, dtypes,
alignment), so the two lists line up. ``E2E_PROFILE_TOP=N`` sets the rows per table (default 25).
``E2E_PROFILE_CENSUS=1`` adds ``census``: the aten ops issued from Python per step and the Python sites
issuing them (``op_census``; on a CPU-only machine too, e.g. the deepseek model at small dims).
``E2E_PROFILE_PY=1``: cProfile instead of torch.profiler over the same steps (where the host's Python time
goes: Megatron, turbo, torch); writes the top functions by own and by cumulative time to
``$E2E_PROFILE_OUT`` with ``.py.txt`` appended. cProfile slows Python calls, so read shares, not wall time.

    E2E_PROFILE_OUT=p.json E2E_PROFILE_WAIT=10 torchrun --nproc_per_node=1 benchmark/e2e/profile_entry.py \
        recipe=deepseek_moe_fp8 train.steps=20
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, REPO)
sys.argv[0] = os.path.join(REPO, "train.py")  # Hydra names the job after it

import hydra  # noqa: E402
from primus_turbo.integrations.common import metrics  # noqa: E402
from primus_turbo.integrations.hydra_main import RECIPES_DIR, run  # noqa: E402

WAIT = int(os.environ.get("E2E_PROFILE_WAIT", "5"))  # steps before the profiler warm-up step
ACTIVE = int(os.environ.get("E2E_PROFILE_STEPS", "3"))
CENSUS = os.environ.get("E2E_PROFILE_CENSUS", "0") == "1"
KERNEL = os.environ.get("E2E_PROFILE_KERNEL", "")
TOP = int(os.environ.get("E2E_PROFILE_TOP", "25"))  # rows per table


def _self_time_us(event, device: bool) -> float:
    if not device:
        return event.self_cpu_time_total
    for name in ("self_device_time_total", "self_cuda_time_total"):  # renamed across torch versions
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


def _is_kernel(event) -> bool:
    """A GPU-side event (kernel, memcpy, memset). A CPU op's self device time repeats the time of the
    kernels it launched, so summing every row would count each kernel twice."""
    return event.device_type != torch.autograd.DeviceType.CPU


def _top(events, steps: int, key, total: float) -> list[dict]:
    events = sorted(events, key=key, reverse=True)[:TOP]
    return [
        {"op": e.key, "ms_per_step": key(e) / 1e3 / steps, "share": key(e) / total,
         "calls_per_step": e.count / steps}
        for e in events
    ]  # fmt: skip


_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _walk_up(node, depth: int) -> tuple[str, list[str]]:
    """From ``node`` up: the first op's name and the first ``depth`` Python frames outside torch (with_stack
    records Python frames as ancestor events named ``file.py(line): function``)."""
    op, frames = "", []
    while node is not None and len(frames) < depth:
        name = node.name
        if "): " in name and name.split("(")[0].endswith(".py"):
            if not name.startswith(("torch/", "<")):
                frames.append(name.split("site-packages/")[-1])
        elif not op and not name.startswith("<"):
            op = name
        node = node.cpu_parent
    return op, frames


def _sync_site(event) -> str:
    """The op that made a blocking CUDA call and, with E2E_PROFILE_STACKS=1, its first Python callers."""
    op, frames = _walk_up(event.cpu_parent, 3)
    return " <- ".join([op or "(no op)", *frames])


def op_census(prof, steps: int, depth: int = 2) -> dict:
    """E2E_PROFILE_CENSUS=1: the aten ops a step issues from Python (those no other aten op called), per
    step, and the Python sites that issue them: where host time goes op by op (a 64-way split and cat with
    its backward's 64 narrows, per MoE layer and micro-batch, showed up this way). Works on CPU runs too."""
    ops: dict[str, int] = {}
    sites: dict[tuple[str, str], int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        ops[e.name] = ops.get(e.name, 0) + 1
        where = " <- ".join(_walk_up(parent, depth)[1]) or "(no Python frame)"
        sites[(e.name, where)] = sites.get((e.name, where), 0) + 1
    by_count = sorted(ops.items(), key=lambda kv: kv[1], reverse=True)[:TOP]
    by_site = sorted(sites.items(), key=lambda kv: kv[1], reverse=True)[: 3 * TOP]
    return {
        "aten_ops_per_step": sum(ops.values()) / steps,
        "ops": [{"op": k, "per_step": n / steps} for k, n in by_count],
        "sites": [{"op": op, "site": where, "per_step": n / steps} for (op, where), n in by_site],
    }


def sync_sites(prof, steps: int) -> tuple[float, list[dict]]:
    """Blocking CUDA runtime calls per step (each drains the GPU queue), grouped by the op that made them:
    these include the ones the sync debug mode does not see (made inside a library)."""
    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name in _SYNC_CALLS:
            site = _sync_site(e)
            counts[site] = counts.get(site, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:TOP]
    return sum(counts.values()) / steps, [{"site": k, "per_step": n / steps} for k, n in ordered]


def _short_kernel(name: str) -> str:
    """A readable kernel name: the template arguments and namespaces of a C++ kernel dropped."""
    name = name.split("<")[0].replace("void ", "").strip()
    return name.split("::")[-1][:60]


def kernel_sites(prof, steps: int) -> list[dict]:
    """GPU kernel time grouped by what launched it: the kernel, the aten op that launched it and the nearest
    enclosing non-aten range (an autograd function such as ``_GradIntoWeightsBackward``, an optimizer step,
    a module's record_function), plus, with E2E_PROFILE_STACKS=1, the first Python callers. The kernel
    table says a copy kernel costs 6 ms; this one says whose copy it is."""
    sites: dict[str, list[float]] = {}
    for e in prof.events():
        kernels = getattr(e, "kernels", None)
        if not kernels or _is_kernel(e) or e.name.startswith(("ProfilerStep", "Command Buffer Full")):
            continue  # a full launch queue is a CUPTI marker: kernels attach to it by a stray correlation id
        outer, node = "", e.cpu_parent
        while node is not None and not outer:
            name = node.name
            if not name.startswith(("aten::", "<", "ProfilerStep")) and ".py(" not in name:
                outer = name
            node = node.cpu_parent
        frames = _walk_up(e.cpu_parent, 2)[1]
        for k in kernels:
            site = " | ".join(filter(None, [_short_kernel(k.name), e.name, outer, " <- ".join(frames)]))
            entry = sites.setdefault(site, [0.0, 0])
            entry[0] += k.duration
            entry[1] += 1
    ordered = sorted(sites.items(), key=lambda kv: kv[1][0], reverse=True)[: 2 * TOP]
    return [{"site": k, "ms_per_step": t / 1e3 / steps, "calls_per_step": n / steps} for k, (t, n) in ordered]


_LAUNCHES = ("LaunchKernel", "Memcpy", "Memset", "LaunchCooperativeKernel", "GraphLaunch")


def gpu_idle(prof, steps: int, min_gap_us: float = 20.0) -> dict:
    """The GPU's idle time between the first and the last kernel (all streams as one timeline), and the gaps
    of at least ``min_gap_us`` grouped by the launch that ended them: the runtime call (cudaLaunchKernel, a
    memcpy, ...) made last before the kernel that closed the gap, named by its op and Python callers."""
    events = [e for e in prof.events() if getattr(e, "time_range", None) is not None]
    # a record_function range (ProfilerStep#N, Optimizer.step#...) has a GPU-timeline twin under its CPU
    # name spanning the kernels it launched: not a kernel (counted, it hid every gap of the step)
    cpu_names = {e.name for e in events if not _is_kernel(e)}
    gpu, launches = [], []
    for e in events:
        if _is_kernel(e):
            if e.name not in cpu_names:
                gpu.append((e.time_range.start, e.time_range.end))
        elif e.name.startswith("cu") and any(k in e.name for k in _LAUNCHES):
            launches.append((e.time_range.start, e))
    if not gpu:
        return {}
    gpu.sort()
    launches.sort(key=lambda t: t[0])
    starts = [t for t, _ in launches]
    idle, sites, busy_end = 0.0, {}, gpu[0][1]
    for start, end in gpu[1:]:
        gap = start - busy_end
        if gap > 0:
            idle += gap
            if gap >= min_gap_us:
                i = bisect.bisect_right(starts, start) - 1
                site = _sync_site(launches[i][1]) if i >= 0 else "(no launch)"
                n, total = sites.get(site, (0, 0.0))
                sites[site] = (n + 1, total + gap)
        busy_end = max(busy_end, end)
    span = busy_end - gpu[0][0]
    ordered = sorted(sites.items(), key=lambda kv: kv[1][1], reverse=True)[:TOP]
    return {
        "idle_ms_per_step": idle / 1e3 / steps,
        "span_ms_per_step": span / 1e3 / steps,
        "gaps": [
            {"site": k, "gaps_per_step": n / steps, "ms_per_step": t / 1e3 / steps} for k, (n, t) in ordered
        ],
    }


def kernel_calls(prof, substr: str) -> list[dict]:
    """E2E_PROFILE_KERNEL: each GPU launch of a kernel whose name holds ``substr``, in start order."""
    calls = [e for e in prof.events() if _is_kernel(e) and substr in e.name and e.time_range is not None]
    calls.sort(key=lambda e: e.time_range.start)
    return [{"kernel": _short_kernel(e.name), "us": round(e.time_range.elapsed_us(), 1)} for e in calls]


def adamw_launches() -> list[list[dict]]:
    """``launches()`` of every live turbo AdamW (the trainer holds it; found by the garbage collector)."""
    import gc

    from primus_turbo.pytorch.optim import AdamW

    return [obj.launches() for obj in gc.get_objects() if isinstance(obj, AdamW)]


def summarize(prof, steps: int, wall_ms: list[float] | None = None) -> dict:
    """Per profiled step: on CUDA, the top GPU kernels by time (``top``, shares of the summed kernel
    time), the summed kernel time against the wall time (the rest is the GPU waiting on the host, or
    overlap between streams), and the top host ops by self CPU time (``top_host``); on CPU, ``top``
    holds the ops by self CPU time."""
    device = torch.cuda.is_available()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    host = [e for e in events if not _is_kernel(e)]
    host_total = sum(e.self_cpu_time_total for e in host) or 1.0
    out = {"clock": "GPU kernel time" if device else "self CPU time", "steps": steps, "first_step": WAIT + 2}
    if wall_ms:
        out["wall_ms_per_step"] = sum(wall_ms) / len(wall_ms)
    if not device:
        out["total_ms_per_step"] = host_total / 1e3 / steps
        out["top"] = _top(host, steps, lambda e: e.self_cpu_time_total, host_total)
        return out
    # a record_function range (e.g. Optimizer.step#AdamW.step) also shows up on the GPU timeline, under
    # its CPU name, spanning the kernels it launched: not a kernel
    cpu_names = {e.key for e in host}
    kernels = [e for e in events if _is_kernel(e) and e.key not in cpu_names]
    total = sum(_self_time_us(e, True) for e in kernels) or 1.0
    out["total_ms_per_step"] = total / 1e3 / steps  # summed kernel time
    out["top"] = _top(kernels, steps, lambda e: _self_time_us(e, True), total)
    out["top_host"] = _top(host, steps, lambda e: e.self_cpu_time_total, host_total)
    out["syncs_per_step"], out["sync_sites"] = sync_sites(prof, steps)
    out["gpu_idle"] = gpu_idle(prof, steps)
    out["kernel_sites"] = kernel_sites(prof, steps)
    return out


def _run_with_step_hook(cfg, on_step) -> list[float]:
    """run(cfg) with ``on_step(steps_done)`` called after every step's metrics record; returns the wall clock
    at the end of every step."""
    record, stamps = metrics.StepMetrics.record, []

    def record_and_step(self, *args, **kwargs):
        row = record(self, *args, **kwargs)
        stamps.append(time.perf_counter())
        on_step(len(stamps))
        return row

    metrics.StepMetrics.record = record_and_step
    try:
        run(cfg)
    finally:
        metrics.StepMetrics.record = record
    return stamps


def _python_profile(cfg) -> None:
    """E2E_PROFILE_PY=1: cProfile over the steps after WAIT + 1, top functions to $E2E_PROFILE_OUT.py.txt."""
    import cProfile
    import io
    import pstats

    active = max(1, min(ACTIVE, cfg.train.steps - WAIT - 1))
    prof = cProfile.Profile()

    def on_step(done: int) -> None:
        if done == WAIT + 1:
            prof.enable()
        elif done == WAIT + 1 + active:
            prof.disable()

    try:
        stamps = _run_with_step_hook(cfg, on_step)
    finally:
        prof.disable()
    out = os.environ.get("E2E_PROFILE_OUT")
    if out and os.environ.get("RANK", "0") == "0" and len(stamps) > WAIT + 1:
        last = min(WAIT + 1 + active, len(stamps))
        wall = 1e3 * (stamps[last - 1] - stamps[WAIT]) / (last - WAIT - 1)
        buf = io.StringIO()
        buf.write(f"cProfile over {last - WAIT - 1} steps after step {WAIT + 1}: {wall:.1f} ms per step\n")
        stats = pstats.Stats(prof, stream=buf)
        for key in ("tottime", "cumulative"):
            stats.sort_stats(key).print_stats(45)
        with open(out + ".py.txt", "w") as f:
            f.write(buf.getvalue())


@hydra.main(version_base="1.3", config_path=RECIPES_DIR, config_name="config")
def _entry(cfg) -> None:
    if os.environ.get("E2E_PROFILE_PY", "0") == "1":
        return _python_profile(cfg)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    active = max(1, min(ACTIVE, cfg.train.steps - WAIT - 1))
    prof = profile(
        activities=activities,
        schedule=schedule(wait=WAIT, warmup=1, active=active, repeat=1),
        # Python callers of the host syncs / of every op (the census)
        with_stack=os.environ.get("E2E_PROFILE_STACKS", "0") == "1" or CENSUS,
    )
    stamps: list[float] = []  # wall clock at the end of every step
    launches: list = []  # E2E_PROFILE_KERNEL: the optimizers' launches at the last profiled step

    def on_step(done: int) -> None:
        prof.step()
        if KERNEL and done == WAIT + 1 + active:
            launches.append(adamw_launches())

    prof.start()
    try:
        stamps = _run_with_step_hook(cfg, on_step)
    finally:
        prof.stop()
    out = os.environ.get("E2E_PROFILE_OUT")
    if out and os.environ.get("RANK", "0") == "0":
        try:
            first = WAIT + 2  # 1-based: the first recorded step (after wait + one warm-up step)
            ends = range(first, min(first + active, len(stamps) + 1))
            wall = [1e3 * (stamps[i - 1] - stamps[i - 2]) for i in ends]
            summary = summarize(prof, active, wall)
            if CENSUS:
                summary["census"] = op_census(prof, active)
            if KERNEL:
                summary["kernel_calls"] = kernel_calls(prof, KERNEL)
                summary["adamw_launches"] = launches[0] if launches else []
        except (AssertionError, RuntimeError) as err:  # the run ended before the profiled steps
            summary = {"error": f"no profile: {err or type(err).__name__}"}
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    _entry()
