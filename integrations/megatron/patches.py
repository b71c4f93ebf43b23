"""The Megatron-Core patch registry: turbo feature swaps and TE-absent gap fixes, one entry each.

Spec-level features (gemm, attention, rmsnorm, grouped_gemm) switch a leaf class in ``TurboSpecProvider``;
runtime features (router, permute, dispatch, async_tp, fp8) replace one Megatron function. Each entry names
the Megatron-Core versions it was tested on. ``apply_megatron_patches`` is called once per process before the
model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import megatron.core
import torch
from omegaconf import DictConfig
from primus_turbo.integrations.common.patch_registry import (
    PatchRegistry,
    apply_patches,
    restore_patched_attrs,
)
from primus_turbo.integrations.megatron import turbo_ops

TESTED = ("0.16.1",)
REGISTRY = PatchRegistry(framework="megatron-core")


@dataclass
class MegatronPatchContext:
    cfg: DictConfig
    spec: object  # TurboSpecProvider
    notes: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.cfg.model.moe is not None


def _needs_moe(ctx) -> str | None:
    return None if ctx.is_moe else "dense model"


def _needs_op(*names):
    def probe(ctx) -> str | None:
        missing = [n for n in names if not turbo_ops.has(n)]
        return f"turbo op(s) {', '.join(missing)} not found in primus_turbo" if missing else None

    return probe


# ---- gap fixes: Megatron-Core without Transformer Engine -------------------------------------------------


@REGISTRY.register(
    "fix.router_gating_gemm",
    "megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction",
    TESTED,
    condition=_needs_moe,
)
def _fix_te_general_gemm(ctx) -> str:
    """moe_utils references ``te_general_gemm`` that is only defined when TE imports: define it as None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        return "moe_utils.te_general_gemm = None (router gating uses torch matmul)"
    return "te_general_gemm already defined"


@REGISTRY.register(
    "fix.all_to_all_splits",
    "megatron.core.tensor_parallel.mappings._AllToAll.forward",
    TESTED,
    condition=_needs_moe,
)
def _fix_all_to_all_splits(ctx) -> str:
    """The alltoall dispatcher passes numpy split sizes; torch >= 2.12's binding only takes int sequences."""
    from megatron.core.tensor_parallel import mappings

    forward = mappings._AllToAll.forward
    if getattr(forward, "_turbo_fixed", False):
        return "already applied"

    def to_list(sizes):
        return sizes.tolist() if hasattr(sizes, "tolist") else sizes

    def fixed_forward(fctx, group, input, output_split_sizes, input_split_sizes):
        return forward(fctx, group, input, to_list(output_split_sizes), to_list(input_split_sizes))

    fixed_forward._turbo_fixed = True
    mappings._AllToAll.forward = staticmethod(fixed_forward)
    return "split sizes -> list"


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for Megatron's ``local_multi_tensor_l2_norm`` without its host syncs: that one builds
    ``torch.tensor()`` from one CUDA norm per gradient (a blocking copy per parameter, every step: 153 per
    step of the 2-layer deepseek proxy, measured under the profiler). Returns the [1] fp32 norm on the
    gradients' device, as amp_C does."""
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _scale_foreach(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for ``local_multi_tensor_scale`` (dst = src * scale, one multiply + copy per tensor there)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _uses_local_multi_tensor(ctx) -> str | None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        return "Transformer Engine / Apex multi-tensor kernels in use"
    return None


@REGISTRY.register("fix.grad_norm_no_sync", "megatron.core.optimizer.clip_grads.l2_norm_impl", TESTED,
                   condition=_uses_local_multi_tensor)  # fmt: skip
def _fix_grad_norm_no_sync(ctx) -> str:
    """Megatron's TE/Apex-less fallbacks for the gradient norm and scaling: foreach ops, no host sync."""
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.l2_norm_impl = _l2_norm_on_device
    clip_grads.multi_tensor_scale_impl = _scale_foreach
    optimizer.multi_tensor_scale_impl = _scale_foreach
    return "local multi-tensor l2 norm / scale -> foreach ops (no per-parameter host sync)"


def _needs_mla_without_te(ctx) -> str | None:
    if ctx.cfg.model.mla is None:
        return "no MLA"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return None
    return "Transformer Engine is installed"


@REGISTRY.register("fix.mla_have_te", "megatron.core.transformer.multi_latent_attention.HAVE_TE", TESTED,
                   condition=_needs_mla_without_te)  # fmt: skip
def _fix_mla_have_te(ctx) -> str:
    """MLA sets HAVE_TE=True when megatron's TE extension module imports, even with TE absent (TELinear is
    None), then crashes on ``isinstance(linear_proj, TELinear)``: make HAVE_TE tell the truth."""
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False
    return "multi_latent_attention.HAVE_TE = False (TE not importable)"


def _needs_stock_mla_attention(ctx) -> str | None:
    if ctx.cfg.model.mla is None:
        return "no MLA"
    turbo = ctx.cfg.turbo
    if turbo.enabled and turbo.get("attention", False):
        return "turbo.attention serves MLA (TurboCoreAttention)"
    return None


@REGISTRY.register("fix.mla_core_attention",
                   "megatron.core.transformer.dot_product_attention.DotProductAttention", TESTED,
                   condition=_needs_stock_mla_attention)  # fmt: skip
def _fix_mla_core_attention(ctx) -> str:
    """MLASelfAttention builds its core attention with k_channels/v_channels (qk 192 / v 128), which only TE's
    DotProductAttention accepts: the local spec fails at model build. Use the stock-PyTorch SDPA subclass."""
    from primus_turbo.integrations.megatron.stock_attention import MLADotProductAttention

    ctx.spec.stock_core_attention = MLADotProductAttention
    mla = ctx.cfg.model.mla
    qk = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    return f"DotProductAttention -> MLADotProductAttention (stock torch SDPA, qk {qk} / v {mla.v_head_dim})"


def apply_megatron_patches(cfg: DictConfig, spec) -> list:
    """Run the registry for ``cfg`` with ``spec`` (a TurboSpecProvider); returns the report rows."""
    from primus_turbo.integrations.megatron import (
        sync_free,
        turbo_layers,
        turbo_optimizer,
        turbo_patches,  # noqa: F401  (registers the turbo entries)
    )

    restore_patched_attrs()  # an earlier run's turbo entries in this process: back to stock first
    turbo_layers.FP8_CONFIG = None  # set again by the turbo.fp8 entry when precision=fp8
    turbo_layers.FP8_GROUPED_CONFIG = None
    turbo_layers.ASYNC_TP = False  # set again by the turbo.async_tp entry
    turbo_optimizer.ENABLED = False  # set again by the turbo.optimizer entry
    sync_free.ENABLED = False  # set again by the turbo.sync_free_step entry
    ctx = MegatronPatchContext(cfg=cfg, spec=spec)
    return apply_patches(REGISTRY, ctx, cfg.turbo, megatron.core.__version__)
