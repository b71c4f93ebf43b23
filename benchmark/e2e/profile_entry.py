"""train.py under torch.profiler for a few steps after warm-up: the op table that says what dominates a step.

compare.py launches this instead of train.py when ``profile=true`` (same Hydra overrides). Steps are marked
by wrapping ``StepMetrics.record`` (called once per step on every rank), so train.py needs no hook. Rank 0
writes ``$E2E_PROFILE_OUT`` (JSON): the profiled steps and the top ops by self device time (CUDA) or self
CPU time (CPU runs), per step.

    E2E_PROFILE_OUT=p.json E2E_PROFILE_WAIT=10 torchrun --nproc_per_node=1 benchmark/e2e/profile_entry.py \
        recipe=deepseek_moe_fp8 train.steps=20
"""

from __future__ import annotations

import json
import os
import sys

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
TOP = 15


def _self_time_us(event, device: bool) -> float:
    if not device:
        return event.self_cpu_time_total
    for name in ("self_device_time_total", "self_cuda_time_total"):  # renamed across torch versions
        if hasattr(event, name):
            return getattr(event, name)
    return 0.0


def summarize(prof, steps: int) -> dict:
    """Top ops by self time per profiled step; shares are of the summed self time of all ops."""
    device = torch.cuda.is_available()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(_self_time_us(e, device) for e in events) or 1.0
    events.sort(key=lambda e: _self_time_us(e, device), reverse=True)
    return {
        "clock": "self device time" if device else "self CPU time",
        "steps": steps,
        "first_step": WAIT + 2,
        "total_ms_per_step": total / 1e3 / steps,
        "top": [
            {
                "op": e.key,
                "ms_per_step": _self_time_us(e, device) / 1e3 / steps,
                "share": _self_time_us(e, device) / total,
                "calls_per_step": e.count / steps,
            }
            for e in events[:TOP]
        ],  # fmt: skip
    }


@hydra.main(version_base="1.3", config_path=RECIPES_DIR, config_name="config")
def _entry(cfg) -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    active = max(1, min(ACTIVE, cfg.train.steps - WAIT - 1))
    prof = profile(activities=activities, schedule=schedule(wait=WAIT, warmup=1, active=active, repeat=1))
    record = metrics.StepMetrics.record

    def record_and_step(self, *args, **kwargs):
        row = record(self, *args, **kwargs)
        prof.step()
        return row

    metrics.StepMetrics.record = record_and_step
    prof.start()
    try:
        run(cfg)
    finally:
        prof.stop()
        metrics.StepMetrics.record = record
    out = os.environ.get("E2E_PROFILE_OUT")
    if out and os.environ.get("RANK", "0") == "0":
        try:
            summary = summarize(prof, active)
        except (AssertionError, RuntimeError) as err:  # the run ended before the profiled steps
            summary = {"error": f"no profile: {err or type(err).__name__}"}
        with open(out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    _entry()
