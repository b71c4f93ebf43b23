"""The training loop on Megatron-Core: parallel_state, GPTModel, DDP + distributed optimizer, the
forward_backward schedule, cosine LR with warmup, grad clipping, metrics, DCP checkpoints.

One function per stage, called in order by ``train``; read top to bottom.
"""

from __future__ import annotations

import functools
import gc
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from primus_turbo.integrations.common import checkpoint as ckpt
from primus_turbo.integrations.common.data import TokenBatches
from primus_turbo.integrations.common.metrics import (
    DeferredMetrics,
    StepMetrics,
    check_finite,
    model_flops_per_token,
)
from primus_turbo.integrations.common.patch_registry import PatchError, format_report
from primus_turbo.integrations.megatron import checkpointing, sync_free, turbo_optimizer
from primus_turbo.integrations.megatron.turbo_optimizer import sub_optimizers


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def setup_distributed() -> torch.device:
    """Process group (nccl on GPUs, gloo on CPU) and, on a CPU machine, the Megatron CPU shims."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
        dist.init_process_group("nccl" if on_gpu else "gloo", device_id=device if on_gpu else None)
    # Megatron-Core warns at import about absent TE/apex and deprecated arguments; the turbo report says
    # what actually runs instead.
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\..*")
    if not on_gpu:
        from primus_turbo.integrations.megatron.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    return device


def params_dtype(cfg: DictConfig) -> torch.dtype:
    if cfg.train.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.train.dtype]


@dataclass
class Run:
    cfg: DictConfig
    device: torch.device
    model: object
    optimizer: object
    scheduler: object
    batches: TokenBatches
    num_microbatches: int
    fp8_context: object
    start_step: int = 0


def build_run(cfg: DictConfig, device: torch.device) -> Run:
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from primus_turbo.integrations.megatron.model import build_gpt_model, build_transformer_config
    from primus_turbo.integrations.megatron.patches import apply_megatron_patches
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider

    p, t, d = cfg.parallel, cfg.train, cfg.data
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        expert_model_parallel_size=p.ep,
    )
    model_parallel_cuda_manual_seed(t.seed)
    torch.manual_seed(t.seed + parallel_state.get_pipeline_model_parallel_rank())

    spec = TurboSpecProvider(cfg)
    rows = apply_megatron_patches(cfg, spec)
    log0(format_report(f"megatron-core, turbo.enabled={cfg.turbo.enabled}", rows + spec.report_rows()))

    dtype = params_dtype(cfg)
    config = build_transformer_config(cfg, dtype, use_grouped_gemm=spec.uses_grouped_gemm)
    model = build_gpt_model(cfg, config, spec)
    if device.type == "cuda":
        model.cuda(device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=device.type == "cuda",
        use_distributed_optimizer=True,
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.no_sync_func = model.no_sync
    if cfg.turbo.enabled:  # turbo experts: no per-weight DDP hooks before the last micro-batch
        from primus_turbo.integrations.megatron import turbo_layers

        config.no_sync_func = functools.partial(turbo_layers.accumulating_microbatch, model.no_sync)
    config.finalize_model_grads_func = finalize_model_grads

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            clip_grad=t.clip_grad,
            use_distributed_optimizer=True,
        ),
        [model],
    )
    config.grad_scale_func = optimizer.scale_loss
    if turbo_optimizer.ENABLED:  # turbo.optimizer
        switched, casts = turbo_optimizer.use_turbo_adamw(optimizer)
        log0(f"optimizer: turbo.optim.AdamW for {switched} optimizer(s), clip factor in the step, "
             f"{casts} master-to-model cast(s) in the step")  # fmt: skip
    fused = use_fused_adam(optimizer)
    if fused:
        log0(f"optimizer: torch fused Adam(W) for {fused} parameter group(s) (no TE/Apex FusedAdam here)")
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=min(t.warmup_steps, t.steps - 1),  # Megatron asserts warmup < decay steps
        lr_decay_steps=t.steps,
        lr_decay_style="cosine",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
        # a resume follows this run's config (more train.steps, another lr), not the saved schedule
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    dp = parallel_state.get_data_parallel_world_size()
    m = cfg.model
    batches = TokenBatches(d.kind, m.seq_length, d.micro_batch_size, m.vocab_size, t.seed, d.path)
    num_microbatches = d.global_batch_size // (d.micro_batch_size * dp)
    return Run(cfg, device, model, optimizer, scheduler, batches, num_microbatches, spec.fp8_context())


def _forward_step_func(run: Run, step: int):
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    dp_rank = parallel_state.get_data_parallel_rank()
    cp = parallel_state.get_context_parallel_world_size()
    seq = run.cfg.model.seq_length
    position_ids = torch.arange(seq, device=run.device).unsqueeze(0)

    def forward_step(data_iterator, model):
        microbatch = next(data_iterator)
        tokens = run.batches.batch(step, microbatch, dp_rank)
        if sync_free.ENABLED:  # pinned, no host wait
            tokens = sync_free.to_device(tokens, run.device)
        else:
            tokens = tokens.to(run.device, non_blocking=True)
        batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": position_ids}
        if cp > 1:  # Megatron's zigzag: chunks r and 2cp-1-r of 2cp, as its RoPE slicing expects
            batch = get_batch_on_this_cp_rank(batch)
        inputs, labels = batch["tokens"].contiguous(), batch["labels"].contiguous()
        with run.fp8_context():
            output = model(inputs, batch["position_ids"].expand_as(inputs), None, labels=labels)

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            # The schedule multiplies a (loss, dict) loss by the CP size and DDP averages gradients over
            # dp x cp ranks: divide by cp so each rank's gradient is its share of the full-sequence mean.
            # clone: the schedule divides the returned loss by num_microbatches in place.
            return loss / cp, {"lm loss": loss.detach().clone()}

        return output, loss_func

    return forward_step


def train_step(run: Run, step: int, stop: bool | None = None) -> tuple[torch.Tensor, object]:
    """One optimizer step over ``num_microbatches``; returns ([loss sum, ranks with a loss(, stop flags)]
    summed over the world, on the device, not read back) and the grad norm (Megatron's float, or a device
    tensor with turbo.sync_free_step). ``stop``: this rank's SIGTERM flag, reduced with the loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from primus_turbo.integrations.megatron import turbo_layers

    turbo_layers.new_weight_step()  # FP8 linears: one weight quantization per optimizer step
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    # train.autograd_threads=false (default): backward on this thread, no hand-off to torch's device worker
    with torch.autograd.set_multithreading_enabled(bool(run.cfg.train.get("autograd_threads", False))):
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step_func(run, step),
            data_iterator=iter(range(run.num_microbatches)),
            model=[run.model],
            num_microbatches=run.num_microbatches,
            seq_length=run.cfg.model.seq_length,
            micro_batch_size=run.cfg.data.micro_batch_size,
            forward_only=False,
        )
    _, grad_norm, _ = run.optimizer.step()
    run.scheduler.step(increment=1)
    # Loss lives on the last pipeline stage; sum it and the number of contributing ranks over the world.
    flags = [] if stop is None else [torch.full((), float(stop), device=run.device)]
    if losses:
        mean_loss = torch.stack([x["lm loss"].float() for x in losses]).mean().to(run.device)
        reduced = torch.stack([mean_loss, torch.ones((), device=run.device), *flags])
    else:
        reduced = torch.stack([torch.zeros((), device=run.device)] * 2 + flags)
    dist.all_reduce(reduced)
    return reduced, grad_norm


def use_fused_adam(optimizer) -> int:
    """Switch Megatron's torch Adam(W) fallback to torch's fused implementation; returns the groups switched.

    Without Transformer Engine or Apex, Megatron-Core steps with torch's foreach Adam(W): a dozen foreach
    launches per group and a Python ``.item()`` of every parameter's (CPU) step counter, each step. Fused
    Adam(W) keeps the counters on the device and updates a group in a few launches: it is the FusedAdam
    Megatron expects from TE/Apex (same update rule; the per-parameter GPU syncs of that fallback setup came
    from the gradient norm, see ``patches.fix.grad_norm_no_sync``). Called before the first step, so the state
    is created by the fused path; groups on a device without fused kernels, or non-float parameters, stay.
    """
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    supported = set(_get_fused_kernels_supported_devices())
    switched = 0
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or inner.state:  # not turbo's AdamW
            continue
        for group in inner.param_groups:
            params = group["params"]
            if group.get("fused") or group.get("differentiable") or not params:
                continue
            if all(p.device.type in supported and p.is_floating_point() for p in params):
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def _legacy_checkpoint_state(run: Run) -> tuple[dict, dict]:
    """The load template of a format-1 checkpoint (module names, optimizer state by index): it loads only
    into the module layout that wrote it. Saves write format 2 (``checkpointing``)."""
    tensors = {k: v for k, v in run.model.module.state_dict().items() if isinstance(v, torch.Tensor)}
    inner_states = []
    for o, sub in enumerate(sub_optimizers(run.optimizer)):
        # bf16 training: the fp32 master shards live outside the model (fp32: they are the model params).
        for g, group in enumerate(getattr(sub, "shard_fp32_from_float16_groups", None) or []):
            for i, param in enumerate(group):
                tensors[f"main_param.{o}.{g}.{i}"] = param
        inner_states.append(sub.optimizer.state_dict())
    objects = {
        "inner_optimizers": inner_states,
        "scheduler": run.scheduler.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "step": 0,
        "world_size": dist.get_world_size(),
    }
    return tensors, objects


def save(run: Run, step: int) -> None:
    start = time.perf_counter()
    path = checkpointing.save(run, step, _init_optimizer_state)
    seconds = time.perf_counter() - start
    log0(f"checkpoint: saved step {step} to {path} in {seconds:.1f} s ({ckpt.dir_gb(path):.2f} GB here)")


def _init_optimizer_state(run: Run) -> None:
    """Create every parameter's Adam state (moments as Megatron's ``init_state_fn`` makes them, and a step
    counter), so the checkpoint template has the saved state's structure: a fresh optimizer has none, and the
    resumed run continued with zero moments from the second step after the checkpoint."""
    for sub in sub_optimizers(run.optimizer):
        inner = sub.optimizer
        init_state_fn = getattr(sub, "init_state_fn", None)
        if init_state_fn is not None:
            init_state_fn(inner, getattr(sub, "config", None))
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                for key in ("exp_avg", "exp_avg_sq"):
                    if key not in state:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)


def _load_legacy(run: Run, step: int, metadata: dict) -> dict:
    _init_optimizer_state(run)  # DCP loads only the entries the template holds: give it every moment
    tensors, objects = _legacy_checkpoint_state(run)
    path = ckpt.step_dir(run.cfg.train.ckpt_dir, step)
    problem = checkpointing.model_tensor_problem(path, metadata, f"rank{dist.get_rank()}.tensors.", tensors)
    saved = {k.split(".")[3] for k in metadata if k.startswith(f"rank{dist.get_rank()}.objects.inner_")}
    if problem is None and len(saved) != len(objects["inner_optimizers"]):
        problem = (
            f"cannot resume from {path}: a format-1 checkpoint with {len(saved)} optimizer(s), this run "
            f"has {len(objects['inner_optimizers'])}"
        )
    if problem is not None:
        problem += " (an earlier version's format-1 checkpoint loads only with the turbo flags that saved it)"
    checkpointing.agree(problem, run.device)
    objects = ckpt.load_checkpoint(run.cfg.train.ckpt_dir, step, tensors, objects)
    model = {k: v for k, v in tensors.items() if not k.startswith("main_param.")}
    run.model.module.load_state_dict(model, strict=False)
    for sub, state in zip(sub_optimizers(run.optimizer), objects["inner_optimizers"], strict=True):
        sub.optimizer.load_state_dict(state)
    return objects


def maybe_resume(run: Run) -> None:
    if not run.cfg.resume:
        return
    step = ckpt.latest_step(run.cfg.train.ckpt_dir)
    if step is None:
        log0(f"resume: no checkpoint in {run.cfg.train.ckpt_dir}; starting from step 0")
        return
    path = ckpt.step_dir(run.cfg.train.ckpt_dir, step)
    metadata = checkpointing.read_metadata(path)
    if checkpointing.saved_format(path, metadata) == 1:
        objects = _load_legacy(run, step, metadata)
    else:
        objects = checkpointing.load(run, step, metadata, _init_optimizer_state)
    if objects["world_size"] != dist.get_world_size():
        raise RuntimeError(f"checkpoint world size {objects['world_size']} != {dist.get_world_size()}")
    run.scheduler.load_state_dict(objects["scheduler"])
    torch.set_rng_state(objects["rng_cpu"])
    run.start_step = objects["step"]
    log0(f"resume: loaded step {step} from {path}")


def backends_used() -> str:
    """Which backend each turbo op dispatcher picked on its last call (second half of the turbo report)."""
    from primus_turbo.pytorch.core.backend import AutoKernelDispatcher

    used = sorted(
        f"{d.__name__.removesuffix('Dispatcher')}={d.last_backend.name}"
        for d in AutoKernelDispatcher.registry()
        if d.last_backend is not None
    )
    return ", ".join(used) if used else "none (no turbo op ran)"


def train(cfg: DictConfig) -> dict:
    """Run ``cfg.train.steps`` steps (or until SIGTERM); returns {"losses": [...], "last_step": n}."""
    device = setup_distributed()
    try:
        run = build_run(cfg, device)
    except PatchError as err:
        log0(f"train.py: {err}")
        dist.destroy_process_group()
        raise SystemExit(3) from None
    try:
        maybe_resume(run)
    except checkpointing.CheckpointMismatch as err:
        print(f"train.py: {err}", flush=True)
        dist.destroy_process_group()
        raise SystemExit(4) from None
    t = cfg.train
    precision = "fp8" if cfg.fp8.enabled else "bf16"
    flops = model_flops_per_token(cfg.model)
    metrics = StepMetrics(cfg, dist.get_world_size(), flops, precision, dist.get_rank() == 0)
    sigterm = ckpt.SigtermFlag()
    tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_length
    losses, step = [], run.start_step
    # turbo.sync_free_step: nothing read back in the step; loss, norm and the SIGTERM flag one step later
    deferred = DeferredMetrics() if sync_free.ENABLED else None

    def record(step: int, loss: float, grad_norm, seconds: float, extra: dict) -> None:
        check_finite(loss, step)
        losses.append(loss)
        if step == run.start_step + 1 and cfg.turbo.enabled:
            log0(f"turbo report: op backends in step {step}: {backends_used()}")
        if step % t.log_interval == 0 or step == t.steps:
            wait = deferred.host_wait_ms if deferred is not None else None
            metrics.record(step, loss, seconds, tokens_per_step, extra["lr"], grad_norm, host_wait_ms=wait)

    gc_interval = int(t.get("gc_interval", 0) or 0)
    if gc_interval:  # collections at fixed steps instead of whenever allocation counts say (step-time spikes)
        gc.collect()
        gc.freeze()
        gc.disable()
    try:
        for step in range(run.start_step + 1, t.steps + 1):
            start = time.perf_counter()
            if gc_interval and step % gc_interval == 0:
                gc.collect()
            if deferred is None:
                reduced, grad_norm = train_step(run, step)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - start
                lr = run.optimizer.param_groups[0]["lr"]
                record(step, (reduced[0] / reduced[1]).item(), grad_norm, seconds, {"lr": lr})
                stop = sigterm.should_stop(device)
            else:
                first = step == run.start_step + 1
                begin = DeferredMetrics.marker(device) if first else None  # the first step's own time
                reduced, grad_norm = train_step(run, step, stop=sigterm.received)
                if not isinstance(grad_norm, torch.Tensor):  # e.g. clip_grad=0: Megatron's float 0.0
                    grad_norm = torch.full((), float(grad_norm or 0.0), device=device)
                extra = {"lr": run.optimizer.param_groups[0]["lr"]}
                loss = reduced[0] / reduced[1]
                deferred.queue(step, loss, grad_norm, extra, record, stop=reduced[2], start=begin)
                stop = deferred.stop_requested  # all-reduced: every rank stops after the same step
            periodic = t.ckpt_dir and t.save_interval and step % t.save_interval == 0
            if t.ckpt_dir and (stop or periodic or (t.save_at_end and step == t.steps)):
                if deferred is not None:
                    deferred.flush(record)
                save(run, step)
            if stop:
                log0(f"SIGTERM: stopped after step {step}")
                break
        if deferred is not None:
            deferred.flush(record)
    finally:
        if gc_interval:
            gc.enable()
            gc.unfreeze()
        metrics.close()
        sigterm.restore()
    if losses:
        log0(f"done: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    dist.barrier()
    dist.destroy_process_group()
    return {"losses": losses, "last_step": step}
