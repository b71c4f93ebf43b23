"""End-to-end step-time comparison: framework x turbo on/off x bf16/fp8, one torchrun process per config.

    python benchmark/e2e/compare.py recipe=deepseek_moe_fp8                       # megatron, 1 GPU, 4 configs
    python benchmark/e2e/compare.py recipe=deepseek_moe_fp8 nproc=2 parallel.ep=2 model.num_layers=8
    python benchmark/e2e/compare.py recipe=deepseek_moe_fp8 parity=true steps=500 # FP8 vs bf16 loss curves
    python benchmark/e2e/compare.py recipe=tiny_moe nproc=2 precisions=bf16 steps=4 warmup=1 out=/tmp/e2e

Options (key=value; every other key=value is passed to train.py as a Hydra override for all configurations):
  recipe=NAME            recipes/recipe/NAME.yaml (default tiny_moe)
  frameworks=a,b         megatron,torchtitan (default megatron)
  nproc=N                GPUs (processes) per configuration (default 1)
  precisions=a,b         bf16,fp8 (default bf16,fp8)
  turbo=a,b              off,on (default off,on)
  steps=N warmup=K       train.steps; medians skip the first K steps (default 30, 10; parity: 500, 10)
  timeout=S              seconds per configuration before it is killed and reported as timeout (default 1800)
  out=DIR                default benchmark/results/<gpu>/e2e/<recipe>_<nproc>gpu[_parity]
  parity=true            turbo on, bf16 vs fp8 on the shipped text sample (data.kind=text unless given), same
                         seed and data order; the report adds the final-loss gap (target: fp8 within 1%)
  seeds=a,b,c            every configuration once per train.seed (parity: the gap is the mean over the seeds;
                         one run's gap is within its noise floor, see report.NOISE_NOTE)
  repeats=N              every configuration N times per seed (default 1; parity: each seed compares the
                         mean of its runs, and the report gives bf16's own run-to-run spread, the noise floor
                         of the gap: on GPUs runs that differ only by rounding end apart, 3.3% on H200 for
                         deepseek_moe_fp8 at 500 steps; on a CPU repeats are bitwise equal)
  stock_fp8=true         also run the stock fp8 rows (they stop at start-up: Megatron-Core has no FP8
                         without Transformer Engine, stock TorchTitan FP8 needs torchao)
  reuse=true             keep a configuration whose DIR/runs/<config>.jsonl already holds all `steps` rows
                         (split a long matrix over several invocations into one report)
  profile=true           run train.py under torch.profiler for 3 steps after warm-up (benchmark/e2e/
                         profile_entry.py); the report adds each run's top ops by self GPU time
  dry_run=true           print the commands, run nothing

TorchTitan's stock rows run with its per-block torch.compile (framework.compile=true is added): the baseline
issue 9 names. Turbo rows run eager unless framework.compile=... is given, which then applies to every row.

Writes DIR/report.md (table + failures with their log tails), DIR/results.json, DIR/report.png (when
matplotlib is installed), DIR/runs/<config>.{log,jsonl}. Where nvidia-smi is installed, each configuration's
GPUs are sampled every 250 ms (DIR/runs/<config>.smi.csv) and the report lists the median SM clock and power
over the timed steps and how often the power cap held the clock (gpu_telemetry.py). Exit code 0 when every
configuration that ran succeeded, 1 if not.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import itertools
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_telemetry  # noqa: E402
from plot import write_plot  # noqa: E402
from report import RunResult, load_metrics, summarize, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OPTIONS = {
    "recipe": "tiny_moe", "frameworks": "megatron", "nproc": "1", "precisions": "bf16,fp8", "turbo": "off,on",
    "steps": None, "warmup": "10", "timeout": "1800", "out": None, "parity": "false", "stock_fp8": "false",
    "dry_run": "false", "reuse": "false", "profile": "false", "seeds": "", "repeats": "1",
}  # fmt: skip
TRUE = ("1", "true", "yes", "on")
NO_STOCK_FP8 = {
    "megatron": "stock Megatron-Core without Transformer Engine has no FP8 path (stock_fp8=true runs it)",
    "torchtitan": "stock TorchTitan FP8 needs torchao, not a dependency (stock_fp8=true runs it)",
}
ERROR_LINE = re.compile(r"(^|\]: |: )[\w.]*(Error|Exception)\b|configuration error|^train\.py: ")


def parse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Split ``key=value`` arguments into compare options and train.py overrides."""
    opts, overrides, given = dict(OPTIONS), [], set()
    for arg in argv:
        if arg in ("-h", "--help"):
            print(__doc__)
            raise SystemExit(0)
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"compare.py: argument {arg!r} is not key=value (see --help)")
        if key in OPTIONS:
            opts[key] = value
            given.add(key)
        else:
            overrides.append(arg)
    opts["parity"] = opts["parity"].lower() in TRUE
    opts["steps"] = int(opts["steps"] or (500 if opts["parity"] else 30))
    opts["warmup"] = min(int(opts["warmup"]), max(opts["steps"] - 1, 0))
    for key in ("frameworks", "precisions", "turbo"):
        opts[key] = [v.strip().lower() for v in opts[key].split(",") if v.strip()]
    bad = [v for v in opts["turbo"] if v not in ("on", "off")]
    if bad:
        raise SystemExit(f"compare.py: turbo={','.join(bad)}: expected on, off or on,off")
    try:
        opts["seeds"] = [int(v) for v in opts["seeds"].split(",") if v.strip()]
    except ValueError:
        raise SystemExit(
            f"compare.py: seeds={opts['seeds']}: expected comma-separated integers, e.g. 1,2,3"
        ) from None
    if not opts["repeats"].isdigit() or int(opts["repeats"]) < 1:
        raise SystemExit(f"compare.py: repeats={opts['repeats']}: expected a whole number >= 1")
    opts["repeats"] = int(opts["repeats"])
    if opts["seeds"] and any(o.split("=", 1)[0].lstrip("+") == "train.seed" for o in overrides):
        raise SystemExit("compare.py: give either seeds=... or train.seed=..., not both")
    bad = [v for v in opts["precisions"] if v not in ("bf16", "fp8")]
    if bad:
        raise SystemExit(f"compare.py: precisions={','.join(bad)}: expected bf16, fp8 or bf16,fp8")
    if opts["parity"]:  # turbo bf16 vs turbo fp8, unless the user narrowed it (e.g. one per invocation)
        opts["turbo"] = opts["turbo"] if "turbo" in given else ["on"]
        opts["precisions"] = opts["precisions"] if "precisions" in given else ["bf16", "fp8"]
        for default in ("data.kind=text", "data.path=data/sample.txt"):  # each only if the user gave no value
            if not any(o.split("=", 1)[0].lstrip("+") == default.split("=", 1)[0] for o in overrides):
                overrides.append(default)
        if "data.path=data/sample.txt" in overrides and opts["steps"] > 100:
            print(f"compare.py: note: parity on the shipped data/sample.txt (120 KB), {opts['steps']} steps: "
                  "the model memorizes it within ~100 steps, so late losses say little about FP8 numerics; a "
                  "larger local corpus: python scripts/build_corpus.py .corpus/corpus.txt --mb 20 && gzip -9 "
                  ".corpus/corpus.txt, then data.path=.corpus/corpus.txt.gz", file=sys.stderr)  # fmt: skip
    return opts, overrides


def gpu_name() -> str | None:
    """Device name from nvidia-smi (the parent never initialises CUDA: the runs need the whole GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return names[0] if out.returncode == 0 and names else None


def gpu_slug(name: str | None) -> str:
    if not name:
        return "cpu"
    for tag in ("h200", "h100", "h800", "h20", "a100", "b200"):
        if tag in name.lower():
            return tag
    return name.lower().replace(" ", "_")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_metadata(opts: dict, overrides: list[str], device: str | None) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "benchmark" / "ops"))
    from bench_utils import git_commit  # torch is imported here anyway

    commit = git_commit(REPO)  # PRIMUS_TURBO_COMMIT, else HEAD (+dirty)
    return {
        "recipe": opts["recipe"],
        "device": f"{opts['nproc']}x {device}" if device else f"cpu ({opts['nproc']} ranks)",
        "steps": opts["steps"],
        "overrides": " ".join(overrides) or "none",
        "torch": torch.__version__,
        "python": platform.python_version(),
        **{name: _version(name) for name in ("triton", "megatron-core", "torchtitan")},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
    }


def matrix(opts: dict) -> list[RunResult]:
    runs = []
    for seed, repeat in itertools.product(opts.get("seeds") or [None], range(1, opts.get("repeats", 1) + 1)):
        for framework in opts["frameworks"]:
            for turbo in opts["turbo"]:
                for precision in opts["precisions"]:
                    run = RunResult(framework, turbo == "on", precision, seed=seed, repeat=repeat)
                    stock_fp8 = not run.turbo and precision == "fp8" and framework in NO_STOCK_FP8
                    if stock_fp8 and opts["stock_fp8"].lower() not in TRUE:
                        run.status, run.error = "skipped", NO_STOCK_FP8[framework]
                    runs.append(run)
    return runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lost_port_race(run: RunResult) -> bool:
    """A run that failed before its first step because torchrun's rendezvous port was taken between
    ``free_port`` and the bind (parallel compare.py invocations on one host; seen in session 30)."""
    return run.status == "failed" and not run.rows and "EADDRINUSE" in run.error


def command(run: RunResult, opts: dict, overrides: list[str], runs_dir: Path) -> list[str]:
    if (
        run.framework == "torchtitan"
        and not run.turbo
        and not any(o.startswith("framework.compile=") for o in overrides)
    ):
        overrides = [*overrides, "framework.compile=true"]  # the stock baseline is compiled TorchTitan
    run.metrics_path = str(runs_dir / f"{run.slug}.jsonl")
    run.log_path = str(runs_dir / f"{run.slug}.log")
    entry = "train.py"
    if opts["profile"].lower() in TRUE:
        entry, run.profile_path = "benchmark/e2e/profile_entry.py", str(runs_dir / f"{run.slug}.profile.json")
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={opts['nproc']}",
        f"--master_port={free_port()}", entry, f"recipe={opts['recipe']}", f"framework={run.framework}",
        f"precision={run.precision}", f"turbo.enabled={str(run.turbo).lower()}",
        f"train.steps={opts['steps']}", "train.log_interval=1", "train.progress=false",
        f"train.metrics_file={run.metrics_path}", *overrides,
        *([] if run.seed is None else [f"train.seed={run.seed}"]),
    ]  # fmt: skip


def _error_index(lines: list[str]) -> int | None:
    hits = [i for i, line in enumerate(lines) if ERROR_LINE.search(line) and "ChildFailedError" not in line]
    return hits[-1] if hits else None


def error_line(log: str) -> str:
    """The most telling error line of a failed run's log (not torchrun's ChildFailedError wrapper)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    index = _error_index(lines)
    line = lines[index] if index is not None else (lines[-1] if lines else "no output")
    return line if len(line) <= 200 else line[:197] + "..."


def error_tail(log: str, context: int = 30) -> str:
    """The traceback up to the error line (torchrun's long wrapper summary after it is cut), else the tail."""
    lines = log.rstrip().splitlines()
    index = _error_index(lines)
    if index is None:
        return "\n".join(lines[-40:])
    return "\n".join(lines[max(0, index - context) : index + 1])


def execute(run: RunResult, cmd: list[str], timeout: float, warmup: int) -> None:
    """Run one configuration as its own process group; fill status, rows and error fields of ``run``."""
    Path(run.metrics_path).unlink(missing_ok=True)  # StepMetrics appends
    run.command = shlex.join(cmd)
    env = dict(os.environ)
    if run.profile_path:
        Path(run.profile_path).unlink(missing_ok=True)
        env.update(E2E_PROFILE_OUT=run.profile_path, E2E_PROFILE_WAIT=str(warmup))
    start, timed_out = time.perf_counter(), False
    telemetry = gpu_telemetry.Sampler(Path(run.metrics_path).with_suffix(".smi.csv"))
    with open(run.log_path, "w") as log, telemetry:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            run.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            run.returncode = proc.returncode
    run.seconds = time.perf_counter() - start
    text = Path(run.log_path).read_text(errors="replace")
    run.rows = load_metrics(run.metrics_path)
    window = gpu_telemetry.timed_window(run.rows, warmup)
    if window is not None:  # the GPUs this run used: torchrun's ranks take devices 0 .. nproc-1
        samples = gpu_telemetry.parse(telemetry.path)
        run.gpu = gpu_telemetry.summarize(samples, *window, gpus=_nproc(cmd))
    if run.profile_path and Path(run.profile_path).exists():
        run.profile = json.loads(Path(run.profile_path).read_text())
    backends = re.search(r"turbo report: op backends in step \d+: (.*)", text)
    run.backends = backends.group(1).strip() if backends else ""
    if run.returncode == 0 and run.rows:
        run.status = "ok"
        return
    run.status = "timeout" if timed_out else "failed"
    run.error = f"killed after {timeout:.0f} s" if timed_out else error_line(text)
    if run.returncode == 0:
        run.error = "exited 0 but wrote no metrics rows"
    run.error_tail = error_tail(text)


def _nproc(cmd: list[str]) -> int | None:
    for arg in cmd:
        if arg.startswith("--nproc_per_node="):
            return int(arg.split("=", 1)[1])
    return None


def reuse_previous(run: RunResult, steps: int) -> bool:
    """A finished earlier run of this configuration in the same out dir (reuse=true)."""
    rows = load_metrics(run.metrics_path)
    if len(rows) != steps or rows[-1]["step"] != steps:
        return False
    run.status, run.rows, run.reused = "ok", rows, True
    log = Path(run.log_path).read_text(errors="replace") if Path(run.log_path).exists() else ""
    backends = re.search(r"turbo report: op backends in step \d+: (.*)", log)
    run.backends = backends.group(1).strip() if backends else ""
    return True


def progress(i: int, n: int, run: RunResult, warmup: int) -> str:
    head = f"[{i}/{n}] {run.label:<26}"
    if run.status == "ok":
        s = summarize(run.rows, warmup)
        state = "reused " if run.reused else "ok     "
        return (f"{head} {state} {run.seconds:6.0f} s | {s['step_time_ms']:.1f} ms/step | "
                f"loss {s['final_loss']:.4f}")  # fmt: skip
    return f"{head} {run.status.upper():<7} {run.seconds:6.0f} s | {run.error}"


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    device = gpu_name()
    suffix = "_parity" if opts["parity"] else ""
    name = f"{opts['recipe']}_{opts['nproc']}gpu"
    default_out = REPO / "benchmark" / "results" / gpu_slug(device) / "e2e" / name
    out = Path(opts["out"]).resolve() if opts["out"] else Path(f"{default_out}{suffix}")
    runs_dir = out / "runs"
    dry_run = opts["dry_run"].lower() in TRUE
    if not dry_run:
        runs_dir.mkdir(parents=True, exist_ok=True)
    runs, timeout = matrix(opts), float(opts["timeout"])
    print(f"compare: {len(runs)} configurations of recipe={opts['recipe']} on "
          f"{device or 'cpu'} x{opts['nproc']}, {opts['steps']} steps (warm-up {opts['warmup']}) -> {out}",
          flush=True)  # fmt: skip
    for i, run in enumerate(runs, 1):
        cmd = command(run, opts, overrides, runs_dir)
        if dry_run:
            shown = shlex.join(cmd) if run.status == "pending" else f"{run.status.upper()}: {run.error}"
            print(f"[{i}/{len(runs)}] {run.label}: {shown}")
            continue
        if run.status == "pending" and opts["reuse"].lower() in TRUE and reuse_previous(run, opts["steps"]):
            pass
        elif run.status == "pending":
            print(f"[{i}/{len(runs)}] {run.label} ...", flush=True)
            execute(run, cmd, timeout, opts["warmup"])
            if lost_port_race(run):  # another process took the free port before torchrun bound it
                print(f"[{i}/{len(runs)}] {run.label}: port taken ({run.error}); again", flush=True)
                run.status, run.error, run.error_tail = "pending", "", ""
                execute(run, command(run, opts, overrides, runs_dir), timeout, opts["warmup"])
        print(progress(i, len(runs), run, opts["warmup"]), flush=True)
    if dry_run:
        return 0
    path, note = write_plot(out, runs, opts["warmup"], parity=opts["parity"])
    meta = run_metadata(opts, overrides, device)
    report = write_report(out, runs, opts["warmup"], meta, parity=opts["parity"], plot_note=note)
    print(report.read_text().split("\n## ")[0])
    print(f"compare: wrote {report}" + (f" and {path}" if path else f" ({note})"))
    return 0 if all(r.status in ("ok", "skipped") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
