"""GPU clock and power while a compare.py configuration runs (``nvidia-smi`` sampled every 250 ms).

A step time means little without the clock it ran at: on an H200 the FP8 step holds the GPU at its 700 W
power cap (SM clock 1575-1920 of 1980 MHz, session 28), bf16 less so. ``Sampler`` runs ``nvidia-smi`` next
to the training process and writes one CSV row per GPU and sample; ``summarize`` reduces the samples inside
the timed steps to the median SM clock and power and the share of samples with a power cap or a thermal
slowdown among the clock-event reasons. Where ``nvidia-smi`` is absent (a CPU machine) nothing is sampled.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from pathlib import Path

QUERY = "timestamp,index,clocks.sm,power.draw,clocks_event_reasons.active"
POWER_CAP = 0x4  # SW power cap
THERMAL = 0x20 | 0x40  # SW / HW thermal slowdown


class Sampler:
    """``with Sampler(path):`` samples every GPU into ``path`` (CSV, no header) while the block runs;
    ``path`` is left absent when ``nvidia-smi`` is not installed."""

    def __init__(self, path: str | Path, interval_ms: int = 250):
        self.path, self.interval_ms, self.proc, self.out = Path(path), interval_ms, None, None

    def __enter__(self) -> Sampler:
        self.path.unlink(missing_ok=True)
        smi = shutil.which("nvidia-smi")
        if smi is not None:
            self.out = open(self.path, "w")
            loop = f"--loop-ms={self.interval_ms}"
            cmd = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", loop]
            self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.out.close()


def parse(path: str | Path) -> list[tuple[float, int, float, float, int]]:
    """(unix time, GPU index, SM clock MHz, power W, clock-event reasons) per CSV row; rows that do not
    parse (a value nvidia-smi reports as [N/A], a line cut when the sampler stopped) are skipped."""
    samples = []
    path = Path(path)
    if not path.exists():
        return samples
    for line in path.read_text(errors="replace").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5:
            continue
        try:
            stamp, fraction = fields[0].rsplit(".", 1)
            seconds = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S")) + float(f"0.{fraction}")
            samples.append((seconds, int(fields[1]), float(fields[2]), float(fields[3]), int(fields[4], 16)))
        except ValueError:
            continue
    return samples


def summarize(samples, start: float, end: float, gpus: int | None = None) -> dict | None:
    """Median SM clock and power and the power-cap / thermal shares of the samples between ``start`` and
    ``end`` (unix times) on GPUs ``0 .. gpus-1`` (all when None); None without such samples."""
    window = [s for s in samples if start <= s[0] <= end and (gpus is None or s[1] < gpus)]
    if not window:
        return None
    return {
        "samples": len(window),
        "sm_clock_mhz": statistics.median(s[2] for s in window),
        "power_w": statistics.median(s[3] for s in window),
        "power_capped": sum(1 for s in window if s[4] & POWER_CAP) / len(window),
        "thermal": sum(1 for s in window if s[4] & THERMAL) / len(window),
    }


def timed_window(rows: list[dict], warmup: int) -> tuple[float, float] | None:
    """Unix start and end of the timed steps (after ``warmup``) from the metrics rows' ``time`` (when each
    row was recorded) and step times; None when the run has no timed steps."""
    timed = rows[warmup:] if len(rows) > warmup else rows
    if not timed or "time" not in timed[0]:
        return None
    return timed[0]["time"] - timed[0]["step_time_ms"] / 1e3, timed[-1]["time"]


def describe(gpu: dict) -> str:
    text = f"SM {gpu['sm_clock_mhz']:.0f} MHz, {gpu['power_w']:.0f} W (medians of {gpu['samples']} samples)"
    text += f", power cap in {100 * gpu['power_capped']:.0f}% of them"
    if gpu["thermal"]:
        text += f", thermal slowdown in {100 * gpu['thermal']:.0f}%"
    return text
