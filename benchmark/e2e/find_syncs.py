"""Where a training step synchronizes the host with the GPU: each call site that blocks, with counts per step.

A host sync (``.item()``, ``.tolist()``, ``.cpu()``, a data-dependent shape, ...) drains the GPU's queue: the
GPU then idles while the host issues the next kernels, which is what makes a step host bound (the profile's
"GPU busy" share). This runs train.py with ``torch.cuda.set_sync_debug_mode("warn")`` switched on after the
warm-up steps and groups the warnings by the Python call stack that triggered them.

    torchrun --nproc_per_node=1 benchmark/e2e/find_syncs.py recipe=deepseek_moe_fp8 train.steps=6 \
        [SYNC_WAIT=3] [SYNC_OUT=syncs.json]

Rank 0 prints the sites by calls per step and writes ``$SYNC_OUT`` (JSON) when set. Frames inside torch
itself are skipped, so a site names the first caller outside torch (ours, Megatron's or TorchTitan's) with
its two outer callers. CUDA only (the debug mode is a no-op on CPU).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
import warnings

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, REPO)
sys.argv[0] = os.path.join(REPO, "train.py")  # Hydra names the job after it

import hydra  # noqa: E402
from primus_turbo.integrations.common import metrics  # noqa: E402
from primus_turbo.integrations.hydra_main import RECIPES_DIR, run  # noqa: E402

WAIT = int(os.environ.get("SYNC_WAIT", "3"))  # steps before the count starts (warm-up, autotune, caches)
_TORCH_DIR = os.path.dirname(torch.__file__)
_SKIP = (_TORCH_DIR, os.path.dirname(warnings.__file__), os.path.abspath(__file__))


def site_of(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame outside torch / the stdlib and its two callers, innermost first."""
    outside = [f for f in stack if not f.filename.startswith(_SKIP)]
    frames = outside[-3:][::-1]
    return " <- ".join(f"{os.path.relpath(f.filename, REPO) if f.filename.startswith(REPO) else f.filename}"
                       f":{f.lineno} {f.name}" for f in frames) or "(torch internals)"  # fmt: skip


class SyncCounter:
    def __init__(self):
        self.sites: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self.on = False
        self._show = warnings.showwarning

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if self.on and "synchronizing" in str(message):
            self.sites[site_of(traceback.extract_stack()[:-1])] += 1
            return
        self._show(message, category, filename, lineno, file, line)

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "first_step": WAIT + 1,
            "syncs_per_step": sum(self.sites.values()) / steps,
            "sites": [{"site": s, "per_step": n / steps} for s, n in self.sites.most_common()],
        }


@hydra.main(version_base="1.3", config_path=RECIPES_DIR, config_name="config")
def _entry(cfg) -> None:
    counter = SyncCounter()
    record = metrics.StepMetrics.record
    done = {"steps": 0}

    def record_and_count(self, *args, **kwargs):
        # step N's record runs after its host syncs of the metrics themselves (loss .item()): counted with it
        row = record(self, *args, **kwargs)
        done["steps"] += 1
        if counter.on:
            counter.steps += 1
        if done["steps"] == WAIT and torch.cuda.is_available():
            counter.on = True
            torch.cuda.set_sync_debug_mode("warn")
        return row

    warnings.simplefilter("always")
    warnings.showwarning = counter.showwarning
    metrics.StepMetrics.record = record_and_count
    try:
        run(cfg)
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        metrics.StepMetrics.record = record
        warnings.showwarning = counter._show
    if os.environ.get("RANK", "0") != "0":
        return
    summary = counter.summary()
    print(f"host syncs: {summary['syncs_per_step']:.1f} per step over {summary['steps']} steps")
    for s in summary["sites"]:
        print(f"{s['per_step']:8.1f}  {s['site']}")
    if os.environ.get("SYNC_OUT"):
        with open(os.environ["SYNC_OUT"], "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    _entry()
