"""turbo.optimizer for Megatron-Core: its Adam(W) step as ``turbo.optim.AdamW``, with gradient clipping and
the master-to-model weight cast folded into that one pass.

Without Transformer Engine or Apex, Megatron-Core's DistributedOptimizer steps torch's AdamW (the trainer
switches it to the fused implementation) and, per step, touches every fp32 main gradient and master weight
in separate passes:

    clip        grad *= min(1, max_norm / (norm + 1e-6))            a foreach multiply: 8 bytes per element
    step        AdamW over the fp32 masters                         28 bytes per element
    cast        bf16 param buffer <- each master, one copy_ each    6 bytes per element

With turbo.optimizer, each sub-optimizer's torch AdamW becomes ``turbo.optim.AdamW`` (``use_turbo_adamw``),
``clip_grad_by_total_norm_fp32`` hands the factor to that step instead of scaling the gradients, and the step
also writes each updated master into its slice of the bf16 parameter buffer (``set_param_copies``), so the
DistributedOptimizer's own cast is skipped after such a step. The gradient norm, its logging and the update
rule are Megatron's. Anything this does not recognise (TE/Apex optimizers, decoupled gradients, FP8 or
Megatron-FSDP parameters, the precision-aware optimizer) keeps Megatron's path for that part.
"""

from __future__ import annotations

import weakref

import torch

from primus_turbo.pytorch.optim import AdamW as TurboAdamW

ENABLED = False  # set by the turbo.optimizer registry entry; the trainer then calls use_turbo_adamw
_ADOPTED: list[weakref.ref] = []  # the turbo AdamWs use_turbo_adamw made (the clip looks up owners here)
_STOCK_CLIP = None  # Megatron's clip_grad_by_total_norm_fp32, kept by install_clip


def install_clip() -> None:
    """Replace the name Megatron's optimizers call (``megatron.core.optimizer.optimizer``) once."""
    global _STOCK_CLIP
    from megatron.core.optimizer import optimizer
    from primus_turbo.integrations.common.patch_registry import replace_attr

    if _STOCK_CLIP is None:
        _STOCK_CLIP = optimizer.clip_grad_by_total_norm_fp32
    replace_attr(optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """Megatron's clip with the same arguments. When one turbo AdamW holds every parameter that has a
    gradient, the factor becomes that optimizer's next ``grad_scale`` (the gradients are not written);
    otherwise Megatron's own multiply (for a device norm from turbo.sync_free_step: one foreach multiply by
    the factor computed on the device)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    owner = None if use_decoupled_grad or not with_grad else _owner_of(with_grad)
    device_norm = isinstance(total_norm, torch.Tensor)  # turbo.sync_free_step's norm, never read back
    if owner is None and device_norm and with_grad and not use_decoupled_grad:
        grads = [p.grad for p in with_grad]  # Megatron's multiply, by min(1, factor) computed on the device
        torch._foreach_mul_(grads, _clip_factor(max_norm, total_norm, grads[0].device).reshape(()))
        return None
    if owner is None:
        norm = float(total_norm) if device_norm else total_norm
        return _STOCK_CLIP(params, max_norm, norm, use_decoupled_grad)
    device = with_grad[0].grad.device
    if device_norm:  # the factor stays on the device, no host read
        scale = _clip_factor(max_norm, total_norm, device)
    else:
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if not clip_coeff < 1.0:  # as Megatron: no clip at or above 1, nor for a NaN norm
            return None
        scale = torch.full((1,), clip_coeff, dtype=torch.float32, device=device)
    owner.set_next_grad_scale(scale)
    return None


def _clip_factor(max_norm: float, total_norm: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` as a one-element fp32 tensor on ``device`` (Megatron clips only
    below 1; a multiply by exactly 1.0 changes nothing). A NaN norm gives 1, as Megatron does not clip then:
    a NaN factor would spread to every parameter, where stock Megatron leaves the finite gradients as they
    are."""
    factor = (max_norm / (total_norm.to(device, torch.float32) + 1.0e-6)).clamp(max=1.0)
    return torch.nan_to_num(factor, nan=1.0).reshape(1)


def _owner_of(params: list[torch.Tensor]) -> TurboAdamW | None:
    for ref in _ADOPTED:
        opt = ref()
        if opt is None:
            continue
        owned = {p for group in opt.param_groups for p in group["params"]}
        if all(p in owned for p in params):
            return opt
    return None


def sub_optimizers(optimizer) -> list:
    """Megatron chains one optimizer per parameter family (dense, expert) when both exist."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def use_turbo_adamw(optimizer) -> tuple[int, int]:
    """Turn each sub-optimizer's ``torch.optim.AdamW`` (no state yet) into ``turbo.optim.AdamW`` and, for a
    DistributedOptimizer, register its master-to-model casts with the step. Returns (optimizers switched,
    casts fused)."""
    switched = fused = 0
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if type(inner) is not torch.optim.AdamW or inner.state:
            continue
        TurboAdamW.adopt(inner)
        _ADOPTED.append(weakref.ref(inner))
        switched += 1
        pairs = _model_copies(sub)
        if pairs:
            fused += inner.set_param_copies(pairs)
            _skip_cast_after_fused_step(sub, inner)
    return switched, fused


def _model_copies(sub) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """(fp32 master shard, its slice of the parameter buffer) pairs, exactly where DistributedOptimizer's
    ``_copy_main_params_to_model_params`` writes them; None when that method does more than plain copies (or
    ``sub`` is not a DistributedOptimizer)."""
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(sub, DistributedOptimizer) or sub.is_stub_optimizer:
        return None
    if sub.ddp_config.use_megatron_fsdp or getattr(sub.config, "use_precision_aware_optimizer", False):
        return None
    if getattr(sub.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return None
    pairs = []
    groups = ((sub.shard_fp32_from_float16_groups, sub.model_float16_groups),
              (sub.shard_fp32_groups, sub.model_fp32_groups))  # fmt: skip
    for main_groups, model_groups in groups:
        for main_group, model_group in zip(main_groups, model_groups, strict=True):
            for main, model_param in zip(main_group, model_group, strict=True):
                if is_float8tensor(model_param):
                    return None
                world = sub._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = sub.model_param_gbuf_map[model_param]
                buffer = sub.buffers[gbuf_index].buckets[bucket_id].param_data
                pairs.append((main, buffer.view(-1)[world.start : world.end]))
    return pairs


def _skip_cast_after_fused_step(sub, inner: TurboAdamW) -> None:
    """The DistributedOptimizer's master-to-model cast, skipped right after a step that wrote it (any other
    caller, e.g. a checkpoint reload, still casts)."""
    cast = sub._copy_main_params_to_model_params

    def copy_main_params_to_model_params():
        if not inner.copies_fresh():
            cast()

    sub._copy_main_params_to_model_params = copy_main_params_to_model_params
