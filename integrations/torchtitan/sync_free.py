"""``turbo.sync_free_step`` (TorchTitan): a training step that never waits for the GPU.

Stock TorchTitan's ``train_step`` drains the GPU queue 11 times a step: each micro-batch's ``.to(device)`` (a
blocking copy, 8 with 4 micro-batches), the valid-token count's copy, and the loss and grad-norm ``.item()``
for the metrics line. After each drain the GPU idles while the host launches the next kernels: on an H200
``deepseek_moe_fp8`` step, 20 ms of idle in a 290 ms kernel span (session 18 profile). Here:

- every micro-batch is pinned and its copy queued without blocking when the batch is drawn
  (``_StagedBatch``: TorchTitan's later ``.to(device)`` returns that copy);
- runs without pipeline stages also run ``train_step`` below: TorchTitan 0.2.2's own, with the valid-token
  count staged the same way (and, with data parallelism, summed over the data-parallel ranks on the GPU, where
  TorchTitan reads it back first), and the loss (summed over the loss mesh on the GPU) and grad norm handed
  to the metrics processor as GPU tensors (``DeferredMetrics``): copied to pinned memory behind a timing
  event and logged one step later, when that event (not the queue) has completed. A step's time is then the
  GPU timeline between the end events of two steps; its line prints during the next step (the last one at
  close). Pipeline runs keep TorchTitan's step.

On a CPU the same code runs (nothing is pinned, the host clock times the steps): the CPU training tests cover
this step against TorchTitan's.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from primus_turbo.pytorch.optim import AdamW as TurboAdamW


class _StagedBatch(torch.Tensor):
    """A CPU batch tensor (pinned) whose copy on the GPU is already queued: ``.to(that device)`` returns the
    copy instead of copying again. Every other ``.to`` and op acts on the CPU values and returns plain
    tensors (TorchTitan counts the valid tokens on them)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def to(self, *args, **kwargs):
        staged = self.__dict__.get("_turbo_staged")
        target = kwargs.get("device", args[0] if len(args) == 1 else None)
        if staged is not None and len(args) + len(kwargs) == 1 and isinstance(target, (str, torch.device)):
            target = torch.device(target)
            index = target.index
            if index is None and target.type == "cuda":
                index = torch.cuda.current_device()
            if target.type == staged.device.type and index == staged.device.index:
                return staged
        return super().to(*args, **kwargs)


def stage_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (CPU) pinned, with its copy on ``device`` queued without blocking, as a ``_StagedBatch``
    (on a CPU device: the tensor itself, unpinned)."""
    pinned = tensor.pin_memory() if device.type == "cuda" else tensor
    staged = pinned.as_subclass(_StagedBatch)
    staged._turbo_staged = pinned.to(device, non_blocking=True)
    return staged


def staged_batches(batches, device: torch.device):
    """TorchTitan ``batch_generator`` output with every tensor staged on ``device``."""
    for input_dict, labels in batches:
        input_dict = {k: stage_to_device(v, device) if isinstance(v, torch.Tensor) else v
                      for k, v in input_dict.items()}  # fmt: skip
        yield input_dict, stage_to_device(labels, device)


def train_step(trainer, data_iterator) -> None:
    """TorchTitan 0.2.2 ``Trainer.train_step`` for runs without pipeline stages, with no host sync: the
    valid-token count staged like the batches (summed over the data-parallel ranks by a GPU all-reduce), the
    metrics deferred (``DeferredMetrics``; the loss summed over the loss mesh on the GPU)."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    dims = trainer.parallel_dims
    trainer.optimizers.zero_grad()
    lr = trainer.lr_schedulers.schedulers[0].get_last_lr()[0]
    microbatches, local_valid_tokens = [], torch.tensor(0, dtype=torch.int64)
    for _ in range(trainer.gradient_accumulation_steps):
        input_dict, labels = next(data_iterator)
        local_valid_tokens += (labels != IGNORE_INDEX).sum()
        microbatches.append((input_dict, labels))
    global_valid_tokens = stage_to_device(local_valid_tokens, trainer.device).to(trainer.device)
    if dims.dp_enabled:  # TorchTitan: dist_sum over the batch mesh, read back to the host
        global_valid_tokens = funcol.all_reduce(global_valid_tokens, "sum", dims.get_mesh("batch"))
    global_valid_tokens = global_valid_tokens.float()
    losses = []
    for input_dict, labels in microbatches:
        inputs = {k: v.to(trainer.device) if torch.is_tensor(v) else v for k, v in input_dict.items()}
        loss = trainer.forward_backward_step(
            input_dict=inputs, labels=labels.to(trainer.device), global_valid_tokens=global_valid_tokens
        )
        losses.append(loss.detach())
    params = [p for m in trainer.model_parts for p in m.parameters()]
    max_norm = trainer.job_config.training.max_norm
    inner = trainer.optimizers.optimizers
    if not dims.ep_enabled and inner and all(isinstance(o, TurboAdamW) for o in inner):
        # turbo.optimizer: TorchTitan's clip (norm, then .grad *= factor) with the factor applied in the step
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        factor = (max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
        for optimizer in inner:
            optimizer.set_next_grad_scale(factor)
    else:
        grad_norm = dist_utils.clip_grad_norm_(
            params, max_norm, foreach=True, pp_mesh=dims.get_optional_mesh("pp"), ep_enabled=dims.ep_enabled
        )
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    if trainer.metrics_processor.should_log(trainer.step):
        loss = torch.stack(losses).sum()
        # DTensors under TP (the loss-parallel loss is Replicate, the norm may be Partial): whole tensors
        loss, grad_norm = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (loss, grad_norm))
        if dims.dp_cp_enabled:  # TorchTitan's global average loss: the sum over the loss mesh
            loss = funcol.all_reduce(loss, "sum", dims.get_optional_mesh("loss"))
        extra = {"n_tokens_seen": trainer.ntokens_seen, "lr": lr}
        trainer.metrics_processor.log_async(trainer.step, loss, grad_norm, extra)


def use_turbo_adamw(optimizers) -> int:
    """turbo.optimizer: each torch AdamW of TorchTitan's OptimizersContainer becomes a ``turbo.optim.AdamW``
    (same state and options; its step a Triton pass per parameter); returns how many."""
    swapped = 0
    for optimizer in optimizers.optimizers:
        if type(optimizer) is torch.optim.AdamW:
            TurboAdamW.adopt(optimizer)
            if "step" in optimizer.__dict__:
                # an LR scheduler built before the swap wrapped the *old* step function on the instance (its
                # call counter): without this, torch's AdamW kept stepping (a CPU test caught it)
                del optimizer.__dict__["step"]
                optimizer.step = _counted(optimizer)
            swapped += 1
    return swapped


def _counted(optimizer):
    """torch's LR-scheduler step wrapper (it marks the optimizer as stepped) around the class's step."""
    step = optimizer.step

    def wrapper(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    return wrapper


def trainer_class(cfg, trainer_cls: type, log) -> type:
    """TorchTitan's Trainer, or with turbo.sync_free_step / turbo.optimizer the subclass the module doc
    describes (the optimizer swap: ``use_turbo_adamw``)."""
    sync_free = cfg.turbo.enabled and cfg.turbo.get("sync_free_step", False)
    turbo_adamw = cfg.turbo.enabled and cfg.turbo.get("optimizer", False)
    if not (sync_free or turbo_adamw):
        return trainer_cls

    class TurboTitanTrainer(trainer_cls):
        def __init__(self, job_config):
            super().__init__(job_config)
            if turbo_adamw:
                n = use_turbo_adamw(self.optimizers)
                # train_step applies the factor in the step only without EP or pipeline stages
                dims = self.parallel_dims
                inside = sync_free and not (dims.ep_enabled or dims.pp_enabled)
                clip = "the clip factor applied inside" if inside else "TorchTitan's clip"
                log(f"turbo.optimizer: {n} torch AdamW -> turbo.optim.AdamW (Triton, {clip})")

        def batch_generator(self, data_iterable):
            batches = super().batch_generator(data_iterable)
            return staged_batches(batches, self.device) if sync_free else batches

        def train_step(self, data_iterator):
            if not sync_free or self.parallel_dims.pp_enabled:
                return super().train_step(data_iterator)
            return train_step(self, data_iterator)

    if sync_free:
        log(
            "turbo.sync_free_step: micro-batches staged to the GPU without blocking; without pipeline "
            "stages, token count and loss reduced on the GPU, loss and grad norm read back one step later "
            "(event-timed steps)"
        )
    return TurboTitanTrainer
