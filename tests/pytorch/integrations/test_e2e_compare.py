"""benchmark/e2e/compare.py: the report writer on synthetic metrics, argument handling, and one real CPU run.

The real run is the CI-sized matrix (tiny_moe, 2 gloo ranks, megatron x turbo off/on x bf16/fp8, 3 steps):
bf16 rows must train and get speedups; stock fp8 is skipped with its reason; turbo fp8 fails on a CPU (no
FP8 device) and must show up in the table with its error, never dropped.
"""

import json
import math
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import compare  # noqa: E402
import loss_gaps  # noqa: E402
import report  # noqa: E402


def _rows(step_ms: float, loss_offset: float, steps: int = 20, mem: float = 10.0) -> list[dict]:
    # Step 1 is a slow warm-up step that the median must skip.
    return [
        {"step": i, "loss": 5.0 * math.exp(-i / 10) + 1.0 + loss_offset,
         "step_time_ms": 10 * step_ms if i == 1 else step_ms + (i % 3),
         "tokens_per_s_per_gpu": 8192e3 / step_ms, "tflops_per_gpu": 400.0 * 500 / step_ms,
         "mfu": 0.4 * 500 / step_ms, "max_mem_gb": mem + i / 100}
        for i in range(1, steps + 1)
    ]  # fmt: skip


def _results() -> list[report.RunResult]:
    stock = report.RunResult("megatron", False, "bf16", status="ok", rows=_rows(1000.0, 0.0))
    turbo = report.RunResult("megatron", True, "bf16", status="ok", rows=_rows(500.0, 0.001))
    fp8 = report.RunResult("megatron", True, "fp8", status="ok", rows=_rows(400.0, 0.02))
    failed = report.RunResult(
        "torchtitan", True, "bf16", status="failed", returncode=1, command="torchrun .. framework=torchtitan",
        error="RuntimeError: CUDA out of memory", error_tail="line a\nRuntimeError: CUDA out of memory",
    )  # fmt: skip
    skipped = report.RunResult(
        "megatron", False, "fp8", status="skipped", error=compare.NO_STOCK_FP8["megatron"]
    )
    return [stock, skipped, turbo, fp8, failed]


def _table(text: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| megatron")]
    rows += [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| torchtitan")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_summarize_takes_medians_after_warmup_and_peak_memory():
    rows = _rows(500.0, 0.0, steps=7)
    s = report.summarize(rows, warmup=1)
    assert s["step_time_ms"] == pytest.approx(501.0)  # steps 2..7 -> 502,500,501,502,500,501
    assert s["max_mem_gb"] == pytest.approx(10.07)
    assert s["final_loss"] == pytest.approx(rows[-1]["loss"])
    assert s["timed_steps"] == 6
    assert s["first_step_s"] == pytest.approx(5.0)  # step 1 (10 x 500 ms), kept apart from the median
    assert report.summarize(rows, warmup=50)["timed_steps"] == 7  # run shorter than warm-up: all steps


def test_load_metrics_sorts_and_ignores_a_truncated_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [json.dumps({"step": 2, "loss": 2.0}), json.dumps({"step": 1, "loss": 3.0}), '{"st']
    path.write_text("\n".join(rows))
    assert [r["step"] for r in report.load_metrics(path)] == [1, 2]
    assert report.load_metrics(tmp_path / "missing.jsonl") == []


def test_report_keeps_failed_and_skipped_rows_and_computes_speedups(tmp_path):
    results = _results()
    path = report.write_report(tmp_path, results, warmup=1, meta={"recipe": "deepseek_moe_fp8"}, parity=True)
    text = path.read_text()
    table = _table(text)
    assert set(table) == {r.label for r in results}
    assert table["megatron stock bf16"][-1] == "1.00x"
    assert table["megatron turbo bf16"][-1] == "2.00x"  # 1001 / 501 ms (medians after warm-up)
    assert table["megatron turbo fp8"][-1] == "2.50x"  # 1001 / 401
    assert table["megatron turbo bf16"][4] == "40.0%"  # MFU column
    # final loss: the mean of the last 10% of steps (one step's loss is noise), not the last step's
    assert table["megatron turbo bf16"][6] == f"{report.smoothed_final_loss(results[2].rows):.4f}"
    assert "final loss (last 10%)" in text
    assert table["megatron turbo bf16"][7] == "5.00"  # first step (s): 10 x 500 ms, compiles and autotune
    assert table["torchtitan turbo bf16"][0] == "FAILED: RuntimeError: CUDA out of memory"
    assert table["torchtitan turbo bf16"][-1] == "n/a"
    assert table["megatron stock fp8"][0].startswith("SKIPPED: stock Megatron-Core")
    failures = text.split("## Failures")[1]
    assert "torchtitan turbo bf16 (failed, rc=1" in failures and "line a" in failures
    assert "framework=torchtitan" in failures
    # Parity: fp8 is 0.02 above bf16 on a ~1.9 tail loss -> ~+1.1% -> FAIL against the 1% target.
    parity = json.loads((tmp_path / "results.json").read_text())["parity"]
    bf16_tail = report.smoothed_final_loss(results[2].rows)
    assert parity["relative_gap"] == pytest.approx((0.02 - 0.001) / bf16_tail, rel=1e-6)
    assert not parity["pass"] and "**FAIL**" in text
    saved = json.loads((tmp_path / "results.json").read_text())["configurations"]
    assert [c["status"] for c in saved] == ["ok", "skipped", "ok", "ok", "failed"]
    assert len(saved[0]["losses"]) == 20


def test_speedup_is_na_without_a_successful_stock_bf16_row(tmp_path):
    results = _results()[2:]  # no stock rows
    table = _table(report.write_report(tmp_path, results, warmup=1, meta={}).read_text())
    assert table["megatron turbo bf16"][-1] == "n/a" and table["megatron turbo bf16"][1] == "501.0"


def test_parse_args_splits_options_from_train_overrides():
    opts, overrides = compare.parse_args(["recipe=deepseek_moe_fp8", "nproc=2", "parallel.ep=2", "turbo=on"])
    assert opts["recipe"] == "deepseek_moe_fp8" and opts["nproc"] == "2" and opts["turbo"] == ["on"]
    assert overrides == ["parallel.ep=2"] and opts["steps"] == 30
    opts, overrides = compare.parse_args(["parity=true", "steps=8", "warmup=20"])
    assert opts["turbo"] == ["on"] and opts["precisions"] == ["bf16", "fp8"] and opts["warmup"] == 7
    assert "data.kind=text" in overrides and "data.path=data/sample.txt" in overrides
    # a user's data.path is kept, once
    _, overrides = compare.parse_args(["parity=true", "data.path=/tmp/corpus.txt"])
    assert [o for o in overrides if o.startswith("data.")] == ["data.path=/tmp/corpus.txt", "data.kind=text"]
    with pytest.raises(SystemExit, match="turbo=maybe"):
        compare.parse_args(["turbo=maybe"])
    with pytest.raises(SystemExit, match="not key=value"):
        compare.parse_args(["deepseek"])


def test_error_line_prefers_the_root_error_over_torchrun_wrapper():
    log = (
        "step 1/3 | loss 5.0\n[rank0]: Traceback (most recent call last):\n"
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \ntrain.py FAILED\n"
    )
    assert compare.error_line(log).startswith("[rank0]: torch.OutOfMemoryError: CUDA out of memory")
    tail = compare.error_tail(log)
    assert tail.endswith("Tried to allocate 2.00 GiB") and "Traceback" in tail
    assert "ChildFailedError" not in tail


@pytest.mark.slow
def test_compare_runs_the_cpu_matrix_and_reports_every_configuration(tmp_path, compare_on_cpu):
    # The CPU path on every machine (gloo, no GPU needed; a GPU box runs compare.py on real recipes instead).
    rc, out = compare_on_cpu(["recipe=tiny_moe", "nproc=2", "steps=3", "warmup=1", "precisions=bf16,fp8",
                              "timeout=240", f"out={tmp_path}"], timeout=600)  # fmt: skip
    assert rc == 1, out[-3000:]  # turbo fp8 cannot run without an FP8 GPU
    for i, label in enumerate(["stock bf16", "stock fp8", "turbo bf16", "turbo fp8"], 1):
        assert f"[{i}/4] megatron {label}" in out, out[-3000:]
    table = _table((tmp_path / "report.md").read_text())
    assert table["megatron stock bf16"][0] == "ok" and table["megatron stock bf16"][-1] == "1.00x"
    assert table["megatron turbo bf16"][0] == "ok" and table["megatron turbo bf16"][-1].endswith("x")
    assert table["megatron stock fp8"][0].startswith("SKIPPED")
    error = table["megatron turbo fp8"][0]
    assert error.startswith("FAILED: train.py: configuration error: precision=fp8"), error
    assert "needs an FP8-capable GPU" in (tmp_path / "report.md").read_text().split("## Failures")[1]
    saved = json.loads((tmp_path / "results.json").read_text())["configurations"]
    for config in saved:
        if config["status"] == "ok":
            assert len(config["losses"]) == 3 and all(0 < x < 10 for x in config["losses"])
            assert config["summary"]["timed_steps"] == 2
    stock, turbo = saved[0]["losses"], saved[2]["losses"]
    assert turbo[0] == pytest.approx(stock[0], rel=1e-2), "same model shape and data: same starting loss"
    assert (tmp_path / "runs" / "megatron_turbo_bf16.log").exists()


def test_scaling_model_matches_hand_computed_deepseek_v3_numbers():
    """docs/scaling.md's inputs: V3 MoE-layer FLOPs and the all-to-all bytes of an in-node EP8 layer."""
    import scaling_model as sm

    v3 = sm.DEEPSEEK_V3
    # Forward per token: MLA projections 2*187.0M + causal core 2*83.9M + router/8 experts/shared 796.4M.
    proj = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    core = 4096 * 128 * 320 * 0.5
    moe = 2 * 7168 * 256 + 9 * 2 * 3 * 7168 * 2048
    assert sm.moe_layer_forward_flops(v3) == pytest.approx(2 * proj + 2 * core + moe, rel=1e-9)
    # EP8 in one node: 7/8 of 4096*8 rows leave the GPU; FP8 dispatch (1 + 4/128 B) + 3 bf16 all-to-alls.
    layout = sm.Layout("t", 64, ep=8, pp=8, global_batch=1920)
    row_bytes = 7168 * (1 + 4 / 128 + 6)
    expected_ms = 4096 * 8 * 7 / 8 * row_bytes / 268e9 * 1e3
    assert sm.a2a_ms_per_moe_layer(layout, v3, 268.0, 40.0) == pytest.approx(expected_ms, rel=1e-9)
    assert layout.microbatches == 240
    # Across 8 nodes the NIC bounds it; node-limited routing (4 nodes) caps the rows that cross.
    wide = sm.Layout("t", 1024, ep=64, pp=16, global_batch=15360)
    across = sm.a2a_ms_per_moe_layer(wide, v3, 268.0, 40.0)
    assert across == pytest.approx(4096 * 8 * 56 / 64 * row_bytes / 40e9 * 1e3, rel=1e-9)
    limited = sm.a2a_ms_per_moe_layer(wide, v3, 268.0, 40.0, max_nodes_per_token=4)
    assert limited == pytest.approx(across * 4 / 8, rel=1e-9)
    no_overlap = sm.project(wide, v3, 450.0, 268.0, 40.0, overlap=0.0)
    hidden = sm.project(wide, v3, 450.0, 268.0, 40.0, overlap=1.0)
    assert hidden["a2a_share"] == 0.0 and 0.3 < no_overlap["a2a_share"] < 0.7
    assert no_overlap["step_s"] > hidden["step_s"]


def test_reuse_keeps_finished_runs_and_reports_them_without_launching(tmp_path, capsys):
    runs = tmp_path / "runs"
    runs.mkdir()
    rows = _rows(500.0, 0.0, steps=3)
    (runs / "megatron_turbo_bf16.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (runs / "megatron_turbo_bf16.log").write_text("turbo report: op backends in step 1: Gemm=TRITON\n")
    (runs / "megatron_stock_bf16.jsonl").write_text(json.dumps(rows[0]) + "\n")  # unfinished: would rerun
    # Only the finished configuration is in this matrix, so nothing is launched.
    argv = ["turbo=on", "precisions=bf16", "steps=3", "warmup=1", "reuse=true", f"out={tmp_path}"]
    assert compare.main(argv) == 0
    assert "[1/1] megatron turbo bf16        reused" in capsys.readouterr().out
    table = _table((tmp_path / "report.md").read_text())
    assert table["megatron turbo bf16"][:2] == ["ok (reused)", "501.0"]
    assert "Gemm=TRITON" in (tmp_path / "report.md").read_text()
    run = report.RunResult("megatron", False, "bf16")
    run.metrics_path, run.log_path = str(runs / "megatron_stock_bf16.jsonl"), str(runs / "none.log")
    assert not compare.reuse_previous(run, steps=3)


def test_plot_is_drawn_with_matplotlib_and_explained_without(tmp_path):
    import importlib.util

    import plot

    path, note = plot.write_plot(tmp_path, _results(), warmup=1, parity=True)
    if importlib.util.find_spec("matplotlib") is None:
        assert path is None and "matplotlib is not installed" in note
    else:
        assert note == "" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    failed_only = [r for r in _results() if r.status != "ok"]
    assert plot.write_plot(tmp_path, failed_only, warmup=1)[0] is None


@pytest.mark.slow
def test_profile_mode_reports_the_top_ops_of_the_profiled_steps(tmp_path, compare_on_cpu):
    # One process (EP=1) keeps this cheap: the profile plumbing is under test, not the all-to-all.
    args = ["recipe=tiny_moe", "nproc=1", "parallel.ep=1", "steps=4", "warmup=1", "turbo=on",
            "precisions=bf16", "profile=true", f"out={tmp_path}"]  # fmt: skip
    rc, out = compare_on_cpu(args, timeout=300)
    out = out[-3000:]
    assert rc == 0, out
    profile = json.loads((tmp_path / "runs" / "megatron_turbo_bf16.profile.json").read_text())
    assert profile.get("steps") == 2 and profile["first_step"] == 3, (profile, out)
    assert profile["clock"] == "self CPU time"
    ops = {op["op"]: op for op in profile["top"]}
    assert "aten::mm" in ops and ops["aten::mm"]["calls_per_step"] >= 10, profile  # the layers' GEMMs ran
    assert sum(op["share"] for op in profile["top"]) <= 1.0 + 1e-9
    assert profile["wall_ms_per_step"] > 0, profile
    section = (tmp_path / "report.md").read_text().split("## Where the time goes (torch.profiler)")[1]
    assert "megatron turbo bf16: self CPU time" in section and "| aten::mm |" in section
    assert len(json.loads((tmp_path / "results.json").read_text())["configurations"][0]["losses"]) == 4


def test_profile_summary_counts_kernels_once_and_reports_gpu_busy_time(monkeypatch, tmp_path):
    # key_averages() lists a CPU op (aten::mm, whose self device time repeats its kernel's) and the kernel
    # itself: the GPU total must count the kernel once, and the host table holds the CPU ops only.
    import profile_entry
    import torch

    class Event:
        def __init__(self, key, cpu, device_us, on_gpu, count=3):
            self.key, self.self_cpu_time_total, self.self_device_time_total = key, cpu, device_us
            self.device_type = torch.autograd.DeviceType.CUDA if on_gpu else torch.autograd.DeviceType.CPU
            self.count = count

    events = [Event("aten::mm", 300.0, 6000.0, False), Event("nvjet_gemm", 0.0, 6000.0, True),
              Event("quantize_kernel", 0.0, 3000.0, True), Event("aten::copy_", 900.0, 0.0, False),
              Event("ProfilerStep#7", 5000.0, 0.0, False),
              # a record_function range: a CPU event and its GPU-timeline twin, which is not a kernel
              Event("Optimizer.step#AdamW.step", 50.0, 0.0, False),
              Event("Optimizer.step#AdamW.step", 0.0, 900.0, True)]  # fmt: skip

    class Node:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    chain = None
    for name in ["train.py(10): main", "torch/optim/optimizer.py(5): step",
                 "megatron/core/optimizer/clip_grads.py(120): get_grad_norm", "<built-in method item>",
                 "aten::item", "aten::_local_scalar_dense"]:  # fmt: skip
        chain = Node(name, chain)
    syncs = [Node("cudaStreamSynchronize", chain) for _ in range(6)] + [Node("cudaLaunchKernel", chain)]

    class Prof:
        def key_averages(self):
            return events

        def events(self):
            return syncs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = profile_entry.summarize(Prof(), steps=3, wall_ms=[10.0, 14.0])
    assert p["clock"] == "GPU kernel time" and p["total_ms_per_step"] == pytest.approx(3.0)  # 9 ms / 3 steps
    assert [op["op"] for op in p["top"]] == ["nvjet_gemm", "quantize_kernel"]
    assert p["top"][0]["share"] == pytest.approx(2 / 3)
    assert [op["op"] for op in p["top_host"]] == ["aten::copy_", "aten::mm", "Optimizer.step#AdamW.step"]
    assert p["wall_ms_per_step"] == 12.0 and p["syncs_per_step"] == 2.0
    site = "aten::_local_scalar_dense <- megatron/core/optimizer/clip_grads.py(120): get_grad_norm"
    site += " <- train.py(10): main"
    assert p["sync_sites"] == [{"site": site, "per_step": 2.0}]
    result = report.RunResult("megatron", True, "fp8", status="ok", rows=_rows(400.0, 0.0))
    result.profile = p
    text = "\n".join(report._profile_section([result]))
    assert "GPU kernels 3.0 ms: the GPU is busy 25% of the step (the rest it waits on the host" in text
    assert "Host side, self CPU time:" in text and "| aten::copy_ |" in text
    assert "Blocking CUDA calls (each drains the GPU queue): 2.0 per step" in text


def test_gpu_idle_sums_the_gaps_and_names_the_launch_that_ended_each():
    """Kernels on two streams are merged into one busy timeline; a gap is charged to the runtime launch made
    last before the kernel that ended it, named by its op."""
    import profile_entry
    import torch

    class Ev:
        def __init__(self, name, start, end, gpu=False, parent=None):
            self.name, self.cpu_parent = name, parent
            self.time_range = type("R", (), {"start": start, "end": end})()
            self.device_type = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU

    copy, mm = Ev("aten::copy_", 0, 500), Ev("aten::mm", 0, 500)
    events = [
        Ev("ProfilerStep#3", 0, 500),  # a record_function range and its GPU twin spanning the step
        Ev("ProfilerStep#3", 90, 430, gpu=True),
        Ev("k1", 100, 200, gpu=True),
        Ev("k2", 150, 260, gpu=True),  # overlap: busy until 260
        Ev("cudaMemcpyAsync", 300, 305, parent=copy),
        Ev("k3", 310, 320, gpu=True),  # gap 50 us
        Ev("cudaLaunchKernel", 325, 330, parent=mm),
        Ev("k4", 330, 340, gpu=True),  # gap 10 us: < 20
        Ev("cudaLaunchKernel", 380, 385, parent=mm),
        Ev("k5", 400, 420, gpu=True),  # gap 60 us
    ]
    idle = profile_entry.gpu_idle(type("P", (), {"events": lambda self: events})(), steps=2)
    assert idle["idle_ms_per_step"] == pytest.approx(0.12 / 2)  # 50 + 10 + 60 us over 2 steps
    assert idle["span_ms_per_step"] == pytest.approx(0.32 / 2)
    assert idle["gaps"] == [
        {"site": "aten::mm", "gaps_per_step": 0.5, "ms_per_step": pytest.approx(0.03)},
        {"site": "aten::copy_", "gaps_per_step": 0.5, "ms_per_step": pytest.approx(0.025)},
    ]


def test_kernel_sites_charge_kernel_time_to_the_launching_op_and_its_enclosing_range():
    """A kernel is charged to the op that launched it and the nearest non-aten range above it (an autograd
    function), with C++ template arguments dropped from its name; sites are ordered by time."""
    import profile_entry
    import torch

    Kernel = type("Kernel", (), {})

    def kernel(name, us):
        k = Kernel()
        k.name, k.duration = name, us
        return k

    class Ev:
        def __init__(self, name, parent=None, kernels=()):
            self.name, self.cpu_parent, self.kernels = name, parent, list(kernels)
            self.device_type = torch.autograd.DeviceType.CPU

    backward = Ev("_GradIntoWeightsBackward", Ev("ProfilerStep#6"))
    to = Ev("aten::_to_copy", Ev("aten::to", backward))
    copy_kernel = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(x)>(int)"
    events = [
        Ev("aten::copy_", to, [kernel(copy_kernel, 300.0)]),
        Ev("aten::copy_", to, [kernel(copy_kernel, 100.0)]),
        Ev("aten::mm", Ev("GemmFunction"), [kernel("nvjet_sm90_tst", 800.0)]),
        Ev("aten::add_", None, [kernel("vectorized_elementwise_kernel", 50.0)]),
    ]
    sites = profile_entry.kernel_sites(type("P", (), {"events": lambda self: events})(), steps=2)
    assert sites == [
        {"site": "nvjet_sm90_tst | aten::mm | GemmFunction", "ms_per_step": 0.4, "calls_per_step": 0.5},
        {
            "site": "unrolled_elementwise_kernel | aten::copy_ | _GradIntoWeightsBackward",
            "ms_per_step": 0.2,
            "calls_per_step": 1.0,
        },
        {"site": "vectorized_elementwise_kernel | aten::add_", "ms_per_step": 0.025, "calls_per_step": 0.5},
    ]


def test_op_census_counts_python_issued_aten_ops_by_site():
    """Ops called by another aten op (narrow -> slice) are not counted again; sites are the first Python
    frames outside torch, site-packages prefixes dropped."""
    import profile_entry

    class Node:
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent

    site = "megatron/core/pipeline_parallel/schedules.py(446): backward_step"
    step = Node(f".venv/lib/python3.11/site-packages/{site}")
    engine = Node("torch/autograd/graph.py(10): _engine_run_backward", step)
    narrows = [Node("aten::narrow", engine) for _ in range(6)]
    slices = [Node("aten::slice", n) for n in narrows]
    events = [*narrows, *slices, Node("aten::cat", engine), Node("aten::mm")]
    census = profile_entry.op_census(type("P", (), {"events": lambda self: events})(), steps=2)
    assert census["aten_ops_per_step"] == 4.0  # 6 narrows + 1 cat + 1 mm over 2 steps; the slices are nested
    assert census["ops"][0] == {"op": "aten::narrow", "per_step": 3.0}
    assert {"op": "aten::narrow", "site": site, "per_step": 3.0} in census["sites"]
    assert {"op": "aten::mm", "site": "(no Python frame)", "per_step": 0.5} in census["sites"]


def test_targets_section_names_the_dominant_op_when_a_target_is_missed(tmp_path):
    results = _results()
    text = report.write_report(tmp_path, results, warmup=1, meta={}).read_text()
    assert (
        "- megatron turbo fp8: speedup 2.50x vs stock bf16 (target >= 1.8x): PASS; MFU 50.0% of the FP8 "
        "peak, 100.0% of the bf16 peak (target >= 40%): PASS" in text
    )
    slow_fp8 = report.RunResult("megatron", True, "fp8", status="ok", rows=_rows(800.0, 0.0))
    slow_fp8.profile = {"clock": "self device time", "steps": 3, "first_step": 3, "total_ms_per_step": 700.0,
                        "top": [{"op": "_grouped_gemm_kernel", "ms_per_step": 300.0, "share": 0.43,
                                 "calls_per_step": 24}]}  # fmt: skip
    lines = report.targets_section([results[0], slow_fp8], warmup=1)
    assert "speedup 1.25x vs stock bf16 (target >= 1.8x): BELOW" in lines[2]  # 1001 / 801
    assert "MFU 25.0% of the FP8 peak, 50.0% of the bf16 peak (target >= 40%): BELOW" in lines[2]
    assert lines[2].endswith("Dominant op (self device time): _grouped_gemm_kernel at 43%")
    slow_fp8.profile.update(wall_ms_per_step=1400.0, top_host=[])  # a CUDA profile: kernels 700 of 1400 ms
    line = report.targets_section([results[0], slow_fp8], warmup=1)[2]
    assert "the GPU runs kernels 50% of the step (host bound: see the host ops" in line, line
    slow_fp8.profile = None
    assert report.targets_section([results[0], slow_fp8], warmup=1)[2].endswith("see which op dominates")
    # TorchTitan's own target (issue 9): 1.4x over its stock bf16 torch.compile step, no MFU target
    titan = [report.RunResult("torchtitan", on, p, status="ok", rows=_rows(ms, 0.0))
             for on, p, ms in ((False, "bf16", 1000.0), (True, "fp8", 700.0))]  # fmt: skip
    line = "\n".join(report.targets_section(titan, warmup=1))
    assert "- torchtitan turbo fp8: speedup 1.43x vs stock bf16 (target >= 1.4x): PASS" in line, line
    assert "MFU" not in line and "1.8x" not in line, line


def test_dry_run_prints_one_torchrun_per_configuration_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "never"
    argv = ["recipe=deepseek_moe_fp8", "nproc=2", "parallel.ep=2", "dry_run=true", f"out={out}"]
    assert compare.main(argv) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if "torch.distributed.run" in line]
    assert len(commands) == 3  # stock bf16, turbo bf16, turbo fp8 (stock fp8 is skipped)
    for line, (turbo, precision) in zip(commands, [("false", "bf16"), ("true", "bf16"), ("true", "fp8")]):
        assert "--nproc_per_node=2" in line and "train.py recipe=deepseek_moe_fp8" in line
        assert f"turbo.enabled={turbo}" in line and f"precision={precision}" in line
        assert line.endswith("parallel.ep=2") and f"train.metrics_file={out}/runs/" in line
    assert not out.exists()


def test_dry_run_compiles_the_stock_torchtitan_baseline_unless_told(tmp_path, capsys):
    argv = [
        "recipe=deepseek_moe_fp8",
        "frameworks=torchtitan",
        "precisions=bf16",
        "dry_run=true",
        f"out={tmp_path}",
    ]
    assert compare.main(argv) == 0
    stock, turbo = [line for line in capsys.readouterr().out.splitlines() if "torch.distributed.run" in line]
    assert "turbo.enabled=false" in stock and stock.endswith("framework.compile=true")
    assert "turbo.enabled=true" in turbo and "framework.compile" not in turbo
    assert compare.main([*argv, "framework.compile=false"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "torch.distributed.run" in line]
    assert all(line.count("framework.compile=") == 1 and "framework.compile=false" in line for line in lines)


def test_parity_windows_show_a_drifting_gap():
    bf16 = [{"step": s, "loss": 2.0} for s in range(1, 101)]
    fp8 = [{"step": s, "loss": 2.0 * (1 + 0.0005 * s)} for s in range(1, 101)]  # drifts up to +5%
    runs = [
        report.RunResult("megatron", True, p, status="ok", rows=r) for p, r in (("bf16", bf16), ("fp8", fp8))
    ]
    parity = report.parity_summary(runs)
    assert parity["final_window"] == 10 and not parity["pass"]
    assert math.isclose(parity["relative_gap"], 0.0005 * 95.5)  # mean of steps 91..100
    gaps = [w["gap"] for w in parity["windows"]]
    assert len(gaps) == 5 and gaps == sorted(gaps) and parity["windows"][-1]["first"] == 81
    short = report.gap_windows(bf16[:3], fp8[:3])  # fewer steps than windows: one step each, no empty window
    assert [(w["first"], w["last"]) for w in short] == [(1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("scale,ok", [(0.995, True), (1.005, True), (0.97, False), (1.03, False)])
def test_parity_target_is_two_sided(scale, ok):
    """'Within 1%': an FP8 loss 3% below bf16 is a numerics difference too, not a pass."""
    bf16 = [{"step": s, "loss": 2.0} for s in range(1, 101)]
    fp8 = [{"step": s, "loss": 2.0 * scale} for s in range(1, 101)]
    runs = [
        report.RunResult("megatron", True, p, status="ok", rows=r) for p, r in (("bf16", bf16), ("fp8", fp8))
    ]
    assert report.parity_summary(runs)["pass"] is ok


def _flat_pair(seed, scale):
    bf16 = [{**row, "loss": 2.0} for row in _rows(500.0, 0.0, steps=100)]
    fp8 = [{**row, "loss": 2.0 * scale} for row in _rows(400.0, 0.0, steps=100)]
    return [
        report.RunResult("megatron", True, p, status="ok", rows=r, seed=seed)
        for p, r in (("bf16", bf16), ("fp8", fp8))
    ]


def test_parity_over_seeds_takes_the_mean_gap_and_lists_each_seed(tmp_path):
    """Seeds pair with their own bf16 run only; the verdict is the mean gap (+2% and -1.8%: +0.1%, a pass)."""
    runs = _flat_pair(1, 1.02) + _flat_pair(2, 0.982)
    parity = report.parity_summary(runs)
    assert [p["seed"] for p in parity["per_seed"]] == [1, 2]
    gaps = [p["gap"] for p in parity["per_seed"]]
    assert math.isclose(gaps[0], 0.02) and math.isclose(gaps[1], -0.018)
    assert math.isclose(parity["relative_gap"], 0.001) and parity["pass"]
    assert math.isclose(parity["spread"], 0.038)
    text = report.write_report(tmp_path, runs, warmup=1, meta={}, parity=True).read_text()
    # standard error over the seeds: stdev(+2%, -1.8%) / sqrt(2) = 1.9%
    assert "+0.10% +- 1.90% standard error (mean over 2 seeds" in text
    assert "| 2 | 2.0000 | 1.9640 | -1.80% |" in text
    assert "megatron turbo fp8 seed2" in text and report.NOISE_NOTE not in text
    one = report.write_report(tmp_path / "one", _flat_pair(None, 1.02), warmup=1, meta={}, parity=True)
    assert report.NOISE_NOTE in one.read_text() and "**FAIL**" in one.read_text()


def test_seeds_option_runs_every_configuration_per_seed(tmp_path, capsys):
    opts, overrides = compare.parse_args(["parity=true", "seeds=1,4321", "steps=4"])
    runs = compare.matrix(opts)
    assert [(r.precision, r.seed) for r in runs] == [("bf16", 1), ("fp8", 1), ("bf16", 4321), ("fp8", 4321)]
    cmd = compare.command(runs[3], opts, overrides, tmp_path)
    assert cmd[-1] == "train.seed=4321" and cmd.count("train.seed=4321") == 1
    assert runs[3].metrics_path.endswith("megatron_turbo_fp8_seed4321.jsonl")
    with pytest.raises(SystemExit, match="seeds=1,x: expected comma-separated integers"):
        compare.parse_args(["seeds=1,x"])
    with pytest.raises(SystemExit, match="either seeds=... or train.seed"):
        compare.parse_args(["seeds=1", "train.seed=3"])


def test_loss_gaps_table_per_window_and_clear_errors(tmp_path, capsys):
    def write(folder, losses):
        path = tmp_path / folder / "runs" / "megatron_turbo_bf16.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n" for i, v in enumerate(losses)))
        return str(path)

    ref = write("ref", [4.0] * 5 + [2.0] * 5)
    other = write("perturbed", [4.0] * 5 + [2.1] * 5)  # +0% then +5% in the second window
    loss_gaps.main([ref, other, "--parts", "2"])
    lines = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    rows = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in lines}
    assert list(rows) == ["1-5", "6-10", "smoothed final"]
    assert rows["1-5"] == ["4.0000", "+0.00%"]
    assert rows["6-10"] == ["2.0000", "+5.00%"]
    assert rows["smoothed final"] == ["2.0000", "2.1000"]
    assert "note:" not in capsys.readouterr().out  # the same steps, no lr recorded: nothing to compare
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit):
        loss_gaps.main([ref, str(empty)])
    assert "empty.jsonl: no loss rows" in capsys.readouterr().err


def test_loss_gaps_notes_a_run_on_another_learning_rate_schedule(tmp_path, capsys):
    """Session 29 compared 400-step runs with 500-step references: another cosine schedule at the same steps.
    Such a run gets a note naming the first step whose lr differs, and the step counts; a run on the
    reference's schedule gets none."""

    def write(name, steps, lrs):
        path = tmp_path / name / "runs" / "m.jsonl"
        path.parent.mkdir(parents=True)
        rows = [{"step": i + 1, "loss": 2.0, "lr": lrs(i + 1)} for i in range(steps)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    def cosine(total):
        return lambda step: 1e-4 * 0.5 * (1 + math.cos(math.pi * step / total))

    ref = write("ref", 10, cosine(10))
    loss_gaps.main([ref, write("same", 10, cosine(10)), write("short", 8, cosine(8)), "--parts", "2"])
    out = capsys.readouterr().out
    assert "note: same" not in out
    assert (
        "note: short: learning rate differs from the reference's at 8 of 8 common steps (most at step 8: 0 vs"
        in out
    )
    assert "ran to step 8, the reference to step 10" in out


def test_find_syncs_groups_sync_warnings_by_their_caller_outside_torch():
    import warnings

    import find_syncs

    counter = find_syncs.SyncCounter()

    def sync_here():  # stands for a caller of .item() / .tolist() (the warning comes from inside torch)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    old = warnings.showwarning
    warnings.showwarning = counter.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = counter.showwarning
            sync_here()  # not counted: the counter is off (warm-up steps)
            counter.on = True
            for _ in range(3):
                sync_here()
    finally:
        warnings.showwarning = old
    counter.steps = 2
    summary = counter.summary()
    assert summary["syncs_per_step"] == 1.5 and len(summary["sites"]) == 1, summary
    site = summary["sites"][0]["site"]
    assert site.startswith("tests/pytorch/integrations/test_e2e_compare.py:") and "sync_here" in site, site
    assert "test_find_syncs_groups_sync_warnings" in site, site
