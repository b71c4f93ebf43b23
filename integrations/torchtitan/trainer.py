"""``train.py framework=torchtitan``: TorchTitan's own Trainer on the recipe, with our data and metrics.

1. ``check_expressible`` + ``build_model_args``: the recipe as a TorchTitan flavor (ConfigError early).
2. A train spec ``primus_turbo_<family>`` = TorchTitan's stock spec for the family with three swaps: the
   recipe's flavor, our token data (``TokenBatchLoader``: the same batches as the Megatron side), and our
   metrics processor (per-step line + JSONL through ``common.metrics.StepMetrics``, MFU against our peak
   table instead of TorchTitan's lspci/A100 default).
3. ``TurboTitanTrainer`` (TorchTitan's Trainer; on a CPU the shims in ``cpu_shims`` make it run on gloo)
   with ``model.converters=["primus_turbo"]`` when turbo.enabled.
"""

from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from primus_turbo.integrations.common.data import TokenBatches
from primus_turbo.integrations.common.metrics import (
    DeferredMetrics,
    StepMetrics,
    check_finite,
    model_flops_per_token,
)
from primus_turbo.integrations.common.patch_registry import PatchError
from primus_turbo.integrations.torchtitan import sync_free
from primus_turbo.integrations.torchtitan.job_config import (
    build_job_config,
    build_model_args,
    check_expressible,
)


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


class TokenBatchLoader:
    """TorchTitan ``BaseDataLoader`` over ``common.data.TokenBatches``: yields ({"input": [b, s]}, labels)
    for microbatch i of step n as a pure function of (seed, n, i, dp_rank); the state is one counter."""

    def __init__(self, batches: TokenBatches, microbatches_per_step: int, dp_rank: int):
        self.batches = batches
        self.microbatches_per_step = microbatches_per_step
        self.dp_rank = dp_rank
        self.position = 0

    def __iter__(self):
        while True:
            step, micro = divmod(self.position, self.microbatches_per_step)
            tokens = self.batches.batch(step + 1, micro, self.dp_rank)
            self.position += 1
            yield {"input": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous()

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])


class TurboMetricsProcessor:
    """The part of TorchTitan's MetricsProcessor its Trainer uses, writing our per-step line and JSONL."""

    def __init__(self, cfg: DictConfig, parallel_dims, job_config=None):
        from torchtitan.components.metrics import _get_metrics_rank

        precision = "fp8" if cfg.fp8.enabled else "bf16"
        self.cfg = cfg
        self._backends_reported = False
        # the rank that holds the loss: under pipeline parallelism the last stage's first rank (the others
        # see TorchTitan's placeholder loss, -1 per micro-batch), as TorchTitan's own MetricsProcessor picks
        metrics_rank = _get_metrics_rank(parallel_dims, job_config) if job_config is not None else 0
        self.step_metrics = StepMetrics(cfg, parallel_dims.world_size, model_flops_per_token(cfg.model),
                                        precision, dist.get_rank() == metrics_rank)  # fmt: skip
        self.color = SimpleNamespace(**{c: "" for c in ("blue", "red", "green", "yellow", "cyan", "reset")})
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.device_memory_monitor = SimpleNamespace(
            device_name=name,
            get_peak_stats=lambda: SimpleNamespace(max_reserved_gib=0.0, max_reserved_pct=0.0),
        )
        self.num_flops_per_token = 0
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.optimizers = None
        self.model_parts = None
        self.losses: list[float] = []
        self._last_log = time.perf_counter()
        self._last_step = 0
        self._deferred = DeferredMetrics()

    def should_log(self, step: int) -> bool:
        return step % self.cfg.train.log_interval == 0 or step == self.cfg.train.steps

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        seconds = (now - self._last_log) / max(step - self._last_step, 1)
        self._record(step, float(global_avg_loss), seconds, grad_norm, extra_metrics)

    def log_async(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, extra_metrics=None) -> None:
        """turbo.sync_free_step: queue step's loss and grad norm (copied to pinned memory without blocking, a
        timing event behind them) and log the step queued before, waiting for its event only: the GPU keeps
        the work queued since. Its step time is the GPU timeline between the two steps' end events."""
        self._deferred.queue(step, loss, grad_norm, extra_metrics, self._record_deferred)

    def _record_deferred(self, step, loss, grad_norm, seconds, extra_metrics) -> None:
        if seconds is None:  # the first queued step: host time since the last record
            seconds = (time.perf_counter() - self._last_log) / max(step - self._last_step, 1)
        self._record(step, loss, seconds, grad_norm, extra_metrics, self._deferred.host_wait_ms)

    def _record(self, step, loss, seconds, grad_norm, extra_metrics, host_wait_ms=None) -> None:
        check_finite(loss, step)
        self.losses.append(loss)
        if not self._backends_reported and self.cfg.turbo.enabled:  # first step run (resumes too)
            from primus_turbo.integrations.megatron.trainer import backends_used

            self._backends_reported = True
            log0(f"turbo report: op backends in step {step}: {backends_used()}")
        tokens = self.cfg.data.global_batch_size * self.cfg.model.seq_length
        lr = (extra_metrics or {}).get("lr", 0.0)
        self.step_metrics.record(step, loss, seconds, tokens, lr, grad_norm, host_wait_ms=host_wait_ms)
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self._last_log, self._last_step = time.perf_counter(), step

    def close(self) -> None:
        self._deferred.flush(self._record_deferred)
        self.step_metrics.close()


_SPECS: dict = {}  # name -> TrainSpec registered in this process
_ACTIVE: dict = {}  # "cfg": the recipe the registered builders read


def _build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **_):
    cfg = _ACTIVE["cfg"]
    d, m, t = cfg.data, cfg.model, cfg.train
    batches = TokenBatches(d.kind, m.seq_length, d.micro_batch_size, m.vocab_size, t.seed, d.path)
    return TokenBatchLoader(batches, d.global_batch_size // (d.micro_batch_size * dp_world_size), dp_rank)


def _build_metrics_processor(job_config, parallel_dims, model_args=None, **_):
    return TurboMetricsProcessor(_ACTIVE["cfg"], parallel_dims, job_config)


def _build_loss_fn(job_config, **kwargs):
    """turbo.cross_entropy (tp == 1): TorchTitan's summed, ignore-index cross-entropy as one fused kernel
    each way; otherwise (turbo off, the flag off, or tp > 1 where TorchTitan's loss_parallel owns the
    sharded logits) the stock loss, compiled when the job compiles it."""
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss

    cfg = _ACTIVE["cfg"]
    if not (cfg.turbo.enabled and cfg.turbo.cross_entropy):
        return build_cross_entropy_loss(job_config, **kwargs)
    if cfg.parallel.tp > 1:
        log0("turbo.cross_entropy: inactive (tp > 1: TorchTitan's loss_parallel computes the sharded loss)")
        return build_cross_entropy_loss(job_config, **kwargs)
    from primus_turbo.pytorch.ops.cross_entropy import cross_entropy

    def turbo_cross_entropy_loss(pred, labels):
        return cross_entropy(
            pred.flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    log0("turbo.cross_entropy: TorchTitan loss -> turbo.ops.cross_entropy (reduction=sum, ignore_index)")
    return turbo_cross_entropy_loss


def register_train_spec(cfg: DictConfig) -> tuple[str, str]:
    """Register ``primus_turbo_<family>`` (once per process) and the recipe's flavor: (name, flavor)."""
    import torchtitan.protocols.train_spec as ts
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing

    family, model_args = build_model_args(cfg)
    name = f"primus_turbo_{family}"
    _ACTIVE["cfg"] = cfg
    if name not in _SPECS:
        stock = ts.get_train_spec(family)
        _SPECS[name] = dataclasses.replace(
            stock, model_args={}, build_dataloader_fn=_build_dataloader, build_tokenizer_fn=None,
            build_validator_fn=None, build_metrics_processor_fn=_build_metrics_processor,
            build_loss_fn=_build_loss_fn,
            # expert-bias load balancing (aux-loss-free) for both MoE families, as deepseek_v3 does
            build_optimizers_fn=stock.build_optimizers_fn if family == "llama3"
            else build_optimizers_with_moe_load_balancing,
        )  # fmt: skip
        ts.register_train_spec(name, _SPECS[name])
    _SPECS[name].model_args[cfg.recipe_name] = model_args
    return name, cfg.recipe_name


def _setup_process_group() -> None:
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
    os.environ.setdefault("LOCAL_RANK", "0")
    if torch.cuda.is_available():
        return  # TorchTitan's Trainer initialises NCCL itself
    from primus_turbo.integrations.torchtitan.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def train(cfg: DictConfig) -> dict:
    """Run the recipe on TorchTitan's Trainer; returns {"losses": [...], "last_step": n}."""
    check_expressible(cfg)
    import primus_turbo.integrations.torchtitan.converter as converter  # registers "primus_turbo"
    from torchtitan.tools.logging import init_logger
    from torchtitan.train import Trainer

    name, flavor = register_train_spec(cfg)
    job_config = build_job_config(cfg, name, flavor)
    converter.set_options(converter.options_from_cfg(cfg))
    _setup_process_group()
    init_logger()
    trainer = None
    try:
        trainer = sync_free.trainer_class(cfg, Trainer, log0)(job_config)
        # train.autograd_threads=false (default): backward on this thread, as in the Megatron trainer
        with torch.autograd.set_multithreading_enabled(bool(cfg.train.get("autograd_threads", False))):
            trainer.train()
    except PatchError as err:
        log0(f"train.py: {err}")
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(3) from None
    finally:
        if trainer is not None:
            trainer.close()
    losses = trainer.metrics_processor.losses
    if losses and trainer.metrics_processor.step_metrics.is_writer:  # holds the loss (PP: last stage)
        print(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {"losses": losses, "last_step": trainer.step}
