"""Per-step metrics: model FLOPs (dense, GQA, MLA, MoE), MFU against a peak table, JSONL/TensorBoard/console.

Model FLOPs per token (forward; training = 3x forward: one forward, two backward GEMMs per forward GEMM;
activation recompute is not counted, as usual for MFU):
  attention projections  2 * (sum of projection weight sizes)          -- GQA or MLA (q/kv low-rank)
  attention core         2 * s * heads * (d_qk + d_v) * 1/2            -- causal: half the score matrix
  dense MLP (SwiGLU)     2 * 3 * h * ffn
  MoE layer              2 * h * experts (router) + topk * 2*3*h*ffn_moe + 2*3*h*ffn_shared
  LM head                2 * h * vocab
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch
from primus_turbo.integrations.common.config import moe_layer_pattern

# Dense (non-sparse) peak TFLOP/s per GPU by (device-name substring, precision), NVIDIA's datasheets (half
# the "with sparsity" figures). The first substring found wins: the PCIe and NVL cards (lower clocks and
# power) come before the SXM parts' bare "H100" / "H200".
PEAK_TFLOPS = {
    ("H100 PCIe", "bf16"): 756.0,
    ("H100 PCIe", "fp8"): 1513.0,
    ("H100 NVL", "bf16"): 835.0,
    ("H100 NVL", "fp8"): 1671.0,
    ("H200 NVL", "bf16"): 835.0,
    ("H200 NVL", "fp8"): 1671.0,
    ("H100", "bf16"): 989.0,
    ("H100", "fp8"): 1979.0,
    ("H200", "bf16"): 989.0,
    ("H200", "fp8"): 1979.0,
}


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """Peak dense TFLOP/s for ``device_name`` at ``precision`` ('bf16' or 'fp8'); None when unknown (CPU)."""
    if not device_name:
        return None
    for (key, prec), value in PEAK_TFLOPS.items():
        if key in device_name and prec == precision:
            return value
    return None


def _attention_flops_per_token(m) -> float:
    h, heads, s = m.hidden_size, m.num_attention_heads, m.seq_length
    if m.mla is not None:
        mla = m.mla
        d_qk, d_v = mla.qk_head_dim + mla.qk_pos_emb_head_dim, mla.v_head_dim
        if mla.q_lora_rank:
            q_proj = h * mla.q_lora_rank + mla.q_lora_rank * heads * d_qk
        else:
            q_proj = h * heads * d_qk
        kv_down = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim)
        kv_proj = kv_down + mla.kv_lora_rank * heads * (mla.qk_head_dim + d_v)
        proj = q_proj + kv_proj + heads * d_v * h
    else:
        d_qk = d_v = m.kv_channels or h // heads
        groups = m.num_query_groups or heads
        proj = h * (heads + 2 * groups) * d_qk + heads * d_v * h
    core = s * heads * (d_qk + d_v) * 0.5
    return 2 * proj + 2 * core


def _mlp_flops_per_token(m, is_moe: bool) -> float:
    h = m.hidden_size
    if not is_moe:
        return 2 * 3 * h * m.ffn_hidden_size
    moe = m.moe
    shared = moe.get("shared_expert_ffn_hidden_size") or 0
    return 2 * h * moe.num_experts + moe.topk * 2 * 3 * h * moe.ffn_hidden_size + 2 * 3 * h * shared


def model_flops_per_token(model_cfg) -> float:
    """Training FLOPs per token of the full model (all layers, all ranks together)."""
    attention = _attention_flops_per_token(model_cfg)
    pattern = moe_layer_pattern(model_cfg)
    layers = sum(attention + _mlp_flops_per_token(model_cfg, bool(is_moe)) for is_moe in pattern)
    head = 2 * model_cfg.hidden_size * model_cfg.vocab_size
    return 3 * (layers + head)


class StepMetrics:
    """Formats, prints and records one dict per step (rank 0 only writes)."""

    def __init__(self, cfg, world_size: int, flops_per_token: float, precision: str, is_writer: bool):
        self.total_steps = cfg.train.steps
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.is_writer = is_writer
        self.show_progress = cfg.train.progress and is_writer
        self.device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        self.peak = peak_tflops(self.device_name, precision)
        self.jsonl = None
        self.tensorboard = None
        if is_writer and cfg.train.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.train.metrics_file)), exist_ok=True)
            # a new run starts the file (appending mixed two runs' rows: compare.py and parity_spread.py read
            # every row as this run's); a resumed run continues it
            mode = "a" if getattr(cfg, "resume", False) else "w"
            self.jsonl = open(cfg.train.metrics_file, mode, encoding="utf-8")
        if is_writer and cfg.train.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(cfg.train.tensorboard_dir)
            except ImportError:
                print("metrics: tensorboard is not installed; train.tensorboard_dir ignored", flush=True)

    def record(
        self, step: int, loss: float, step_seconds: float, tokens: int, lr: float, grad_norm,
        host_wait_ms: float | None = None,
    ) -> dict:  # fmt: skip
        """``host_wait_ms``: the sync-free loops' read-back wait (``DeferredMetrics.host_wait_ms``)."""
        tokens_per_gpu = tokens / self.world_size / step_seconds
        tflops = tokens_per_gpu * self.flops_per_token / 1e12
        if torch.cuda.is_available():
            max_mem_gb = torch.cuda.max_memory_allocated() / 2**30
        else:  # CPU: peak resident set size of this rank's process (Linux reports KiB)
            max_mem_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        row = {
            "step": step,
            "loss": loss,
            "step_time_ms": step_seconds * 1e3,
            "tokens_per_s_per_gpu": tokens_per_gpu,
            "tflops_per_gpu": tflops,
            "mfu": tflops / self.peak if self.peak else None,
            "max_mem_gb": max_mem_gb,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "host_wait_ms": host_wait_ms,
            "time": time.time(),
        }
        if self.is_writer:
            self._emit(row)
        return row

    def _emit(self, row: dict) -> None:
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        bar = ""
        if self.show_progress:
            width = 20
            done = int(width * row["step"] / self.total_steps)
            bar = "[" + "#" * done + "-" * (width - done) + "] "
        print(
            f"{bar}step {row['step']}/{self.total_steps} | loss {row['loss']:.4f} | "
            f"{row['step_time_ms']:.0f} ms | {row['tokens_per_s_per_gpu']:.0f} tok/s/GPU | "
            f"{row['tflops_per_gpu']:.2f} TFLOP/s/GPU | MFU {mfu} | mem {row['max_mem_gb']:.1f} GB | "
            f"lr {row['lr']:.2e}",
            file=sys.stdout,
            flush=True,
        )
        if self.jsonl:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()
        if self.tensorboard:
            for key in ("loss", "step_time_ms", "tokens_per_s_per_gpu", "tflops_per_gpu", "max_mem_gb", "lr"):
                self.tensorboard.add_scalar(f"train/{key}", row[key], row["step"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tensorboard:
            self.tensorboard.close()


def check_finite(loss: float, step: int) -> None:
    """Stop the run on a NaN/inf loss, naming the step."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"loss is {loss} at step {step}: stopping (lower train.lr, check the data, or resume from the "
            "last checkpoint)"
        )


class DeferredMetrics:
    """Step metrics read back one step late (the sync-free steps of both trainers): ``queue`` copies (loss,
    grad norm[, stop flag]) to pinned memory without blocking and records a timing event behind them, then
    hands the step queued before to ``record(step, loss, grad_norm, seconds, extra)`` once its event has
    completed (``seconds``: the GPU time between the previous recorded event and this one, per step; None for
    the first). ``flush`` records the last one. ``stop_requested`` turns True once a recorded step's ``stop``
    (e.g. a SIGTERM flag all-reduced with the loss) was positive. On a CPU nothing runs ahead: the values are
    read at once and the host clock times the steps.

    ``host_wait_ms`` (set before each ``record`` call): how long the host, having issued the next step, waited
    for the recorded step's GPU work to finish; None on a CPU. Above 0 only when the host ran a whole step
    ahead. 0 either because the host sets the pace or because its run-ahead is capped below a step (the CUDA
    launch queue: a deepseek_moe_fp8 step issues ~2,500 launches); a flushed step's wait (nothing left to
    issue) is the host's lead over the GPU at that point, which tells the two apart."""

    def __init__(self):
        self._pending = None  # (step, host [loss, grad_norm, stop], end marker, extra)
        self._last = None  # (step, end marker) of the last recorded step
        self.stop_requested = False
        self.host_wait_ms: float | None = None

    def queue(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, extra, record, stop=None,
              start=None) -> None:  # fmt: skip
        """``start``: for a step with no recorded step before it, a ``marker()`` taken when it began (else its
        ``seconds`` is None)."""
        parts = [loss, grad_norm] + ([] if stop is None else [stop])
        values = torch.stack([t.detach().float().reshape(()) for t in parts])
        if values.is_cuda:
            host = torch.empty(values.numel(), dtype=torch.float32, pin_memory=True)
            host.copy_(values, non_blocking=True)
        else:
            host = values
        pending, self._pending = self._pending, (step, host, self.marker(values.device), extra, start)
        if pending is not None:
            self._resolve(pending, record)

    @staticmethod
    def marker(device: torch.device):
        """A point on the timeline: a CUDA event recorded now on a GPU, the host clock on a CPU."""
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def flush(self, record) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._resolve(pending, record)

    def _resolve(self, pending, record) -> None:
        step, host, end, extra, start = pending
        self.host_wait_ms = None
        if isinstance(end, torch.cuda.Event):
            t0 = time.perf_counter()
            end.synchronize()  # this step's work only: later steps stay queued
            self.host_wait_ms = (time.perf_counter() - t0) * 1e3
        seconds = None
        if self._last is not None:
            last_step, last_end = self._last
            seconds = self._elapsed(last_end, end) / max(step - last_step, 1)
        elif start is not None:
            seconds = self._elapsed(start, end)
        self._last = (step, end)
        loss, grad_norm, *stop = host.tolist()
        self.stop_requested |= bool(stop and stop[0] > 0)
        record(step, loss, grad_norm, seconds, extra)

    @staticmethod
    def _elapsed(first, last) -> float:
        return first.elapsed_time(last) / 1e3 if isinstance(last, torch.cuda.Event) else last - first
