"""Turbo feature entries of the Megatron-Core patch registry (importing this module registers them).

Each entry: the turbo flag that requests it, the Megatron target, a condition (is it relevant to this run?),
a probe (do the turbo ops exist and can they serve this config?) and a small apply function.
"""

from __future__ import annotations

import os

import torch
from primus_turbo.integrations.common.config import fp8_current_config, fp8_expert_recipe, fp8_format_name
from primus_turbo.integrations.common.patch_registry import replace_attr
from primus_turbo.integrations.megatron import turbo_layers, turbo_moe, turbo_ops
from primus_turbo.integrations.megatron.patches import REGISTRY, TESTED, _needs_moe, _needs_op

# ---- spec swaps ------------------------------------------------------------------------------------------


@REGISTRY.register("turbo.gemm", "megatron.core.tensor_parallel.layers.ColumnParallelLinear._forward_impl",
                   TESTED, feature="gemm", probe=_needs_op("ops.gemm"))  # fmt: skip
def _gemm(ctx) -> str:
    if ctx.cfg.model.mla is not None:
        _accept_turbo_linear_in_mla()  # first: if it raises, the stock linears stay (the row says so)
    ctx.spec.linear = True
    return "Column/RowParallelLinear -> TurboColumn/RowParallelLinear (turbo.ops.gemm, main_grad fusion)"


def _accept_turbo_linear_in_mla() -> None:
    """MLASelfAttention accepts q/kv down-projections only from a fixed class list (ColumnParallelLinear,
    TEColumnParallelLinear, modelopt Linear), by identity. Without TE the TE slot is unused: put the turbo
    class there so MLA builds with it (gather_output=False, like ColumnParallelLinear)."""
    from megatron.core.transformer import multi_latent_attention as mla

    try:
        import transformer_engine  # noqa: F401

        raise RuntimeError(
            "Transformer Engine is installed: turbo MLA linears would shadow TEColumnParallelLinear"
        )
    except ImportError:
        pass
    replace_attr(mla, "TEColumnParallelLinear", turbo_layers.TurboColumnParallelLinear)


@REGISTRY.register("turbo.rmsnorm", "megatron.core.transformer.torch_norm.WrappedTorchNorm", TESTED,
                   feature="rmsnorm", probe=_needs_op("ops.rmsnorm"))  # fmt: skip
def _rmsnorm(ctx) -> str:
    ctx.spec.norm = True
    return "WrappedTorchNorm(RMSNorm) -> TurboRMSNorm (turbo.ops.rmsnorm)"


def _attention_probe(ctx) -> str | None:
    if ctx.cfg.parallel.cp > 1:
        return _needs_op("ops.flash_attn_func", "ops.flash_attn_usp_func")(ctx)
    return _needs_op("ops.flash_attn_func")(ctx)


@REGISTRY.register("turbo.attention", "megatron.core.transformer.dot_product_attention.DotProductAttention",
                   TESTED, feature="attention", probe=_attention_probe)  # fmt: skip
def _attention(ctx) -> str:
    ctx.spec.attention = True
    kind = "MLA" if ctx.cfg.model.mla is not None else "GQA/MHA"
    cp = ctx.cfg.parallel.cp
    if cp > 1:
        return (
            f"DotProductAttention -> TurboCoreAttention ({kind}, ring context parallel x{cp}, "
            "turbo.ops.flash_attn_usp_func)"
        )
    return f"DotProductAttention -> TurboCoreAttention ({kind}, turbo.ops.flash_attn_func)"


@REGISTRY.register("turbo.grouped_gemm", "megatron.core.transformer.moe.experts.TEGroupedMLP", TESTED,
                   feature="grouped_gemm", condition=_needs_moe,
                   probe=_needs_op("ops.grouped_gemm"))  # fmt: skip
def _grouped_gemm(ctx) -> str:
    ctx.spec.grouped_mlp = True
    return (
        "SequentialMLP -> TurboGroupedMLP (TEGroupedMLP, fused SwiGLU x probs) with "
        "TurboColumn/RowParallelGroupedLinear (turbo.ops.grouped_gemm)"
    )


# ---- runtime patches -------------------------------------------------------------------------------------


@REGISTRY.register("turbo.router", "megatron.core.transformer.moe.router.topk_routing_with_score_function",
                   TESTED, feature="router", condition=_needs_moe,
                   probe=_needs_op("ops.moe.fused_topk_routing"))  # fmt: skip
def _router(ctx) -> str:
    from megatron.core.transformer.moe import router

    fused_topk_routing = turbo_ops.get("ops.moe.fused_topk_routing")

    def turbo_topk_routing(logits, topk, use_pre_softmax=False, num_groups=None, group_topk=None,
                           scaling_factor=None, score_function="softmax", expert_bias=None, fused=False,
                           router_replay=None):  # fmt: skip
        if router_replay is not None:
            raise ValueError("turbo.router: router replay is not supported; set turbo.router=false")
        return fused_topk_routing(
            logits, topk, score_function=score_function, use_pre_softmax=use_pre_softmax,
            num_groups=num_groups, topk_groups=group_topk,
            scaling_factor=scaling_factor or None,  # Megatron scales only by a truthy factor (0.0: unscaled)
            expert_bias=expert_bias, norm_topk=score_function == "sigmoid" and topk > 1,  # Megatron's rule
        )  # fmt: skip

    replace_attr(router, "topk_routing_with_score_function", turbo_topk_routing)
    return "TopKRouter top-k (incl. group-limited) -> turbo.ops.fused_topk_routing"


@REGISTRY.register("turbo.permute", "megatron.core.transformer.moe.token_dispatcher.permute", TESTED,
                   feature="permute", condition=_needs_moe,
                   probe=_needs_op("ops.moe.permute.token_permute",
                                   "ops.moe.permute.token_unpermute"))  # fmt: skip
def _permute(ctx) -> str:
    from megatron.core.transformer.moe import token_dispatcher

    token_permute = turbo_ops.get("ops.moe.permute.token_permute")
    token_unpermute = turbo_ops.get("ops.moe.permute.token_unpermute")

    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if drop_and_pad:
            raise ValueError("turbo.permute: drop-and-pad (capacity factor) is not supported")
        if hasattr(num_out_tokens, "item"):
            num_out_tokens = int(num_out_tokens.item())  # the stock alltoall path passes a Python int
        permuted, permuted_probs, row_id_map, _ = token_permute(tokens, routing_map, probs, num_out_tokens)
        return permuted, permuted_probs, row_id_map

    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False):  # fmt: skip
        out = token_unpermute(permuted_tokens, sorted_indices, merging_probs=probs)
        return out.view(restore_shape)

    replace_attr(token_dispatcher, "permute", permute)
    replace_attr(token_dispatcher, "unpermute", unpermute)
    return "token_dispatcher.permute/unpermute -> turbo token_permute/token_unpermute"


def _dispatch_condition(ctx) -> str | None:
    if not ctx.is_moe:
        return "dense model"
    if _local_dispatch(ctx) and ctx.cfg.parallel.tp > 1:
        return "ep=1 with tp > 1: Megatron's dispatcher gathers over the tensor-parallel group"
    return None


def _local_dispatch(ctx) -> bool:
    """ep=1 with the alltoall dispatcher: nothing to communicate, the local sync-free dispatcher."""
    return ctx.cfg.parallel.ep == 1 and ctx.cfg.model.moe.get("dispatcher", "alltoall") == "alltoall"


def _dispatch_probe(ctx) -> str | None:
    if ctx.cfg.model.moe.get("dispatcher", "alltoall") == "flex":
        return _needs_op("deep_ep.Buffer")(ctx)
    if _local_dispatch(ctx):
        return _needs_op("ops.moe.permute.token_permute", "ops.moe.permute.token_unpermute")(ctx)
    return _needs_op("modules.TokenDispatcher")(ctx)


@REGISTRY.register("turbo.dispatch",
                   "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher", TESTED,
                   feature="dispatch", condition=_dispatch_condition, probe=_dispatch_probe)  # fmt: skip
def _dispatch(ctx) -> str:
    if ctx.cfg.model.moe.get("dispatcher", "alltoall") == "flex":
        return _install_turbo_deep_ep()
    if not ctx.cfg.turbo.grouped_gemm:
        raise ValueError(
            "turbo.dispatch applies the routing probs inside the turbo experts (TurboGroupedMLP): needs "
            "turbo.grouped_gemm"
        )
    from megatron.core.transformer.moe import moe_layer

    if _local_dispatch(ctx):
        replace_attr(moe_layer, "MoEAlltoAllTokenDispatcher", turbo_moe.TurboLocalTokenDispatcher)
        return (
            "MoEAlltoAllTokenDispatcher -> TurboLocalTokenDispatcher (ep=1: turbo permute/unpermute, token "
            "counts stay on the GPU: no host sync, no identity re-sort)"
        )
    replace_attr(moe_layer, "MoEAlltoAllTokenDispatcher", turbo_layers.TurboTokenDispatcher)
    return "MoEAlltoAllTokenDispatcher -> TurboTokenDispatcher (turbo moe_dispatch/moe_combine + permute)" + (
        _size_turbo_ep_buffers(ctx.cfg)
    )


def _size_turbo_ep_buffers(cfg) -> str:
    """The TURBO EP backend (no host sync) sizes its buffers for PRIMUS_TURBO_EP_MAX_TOKENS tokens per rank;
    unless the user set it, use the tokens a rank feeds its MoE layers (the default 8192 doubles the buffers
    and the rows the expert-side passes walk at seq 4096). Same on every rank: it comes from the config."""
    if "PRIMUS_TURBO_EP_MAX_TOKENS" in os.environ:
        return ""
    par = cfg.parallel
    tokens = cfg.model.seq_length // par.cp * cfg.data.micro_batch_size
    tokens //= par.tp if par.sequence_parallel else 1
    os.environ["PRIMUS_TURBO_EP_MAX_TOKENS"] = str(max(tokens, 1))
    return f"; TURBO EP buffers sized for {max(tokens, 1)} tokens per rank"


def _install_turbo_deep_ep() -> str:
    """Megatron's flex dispatcher (deepep backend) over turbo's DeepEP-compatible Buffer: register
    primus_turbo.pytorch.deep_ep as ``deep_ep`` and re-run fused_a2a's import-time ``HAVE_DEEP_EP`` branch."""
    import importlib

    from megatron.core.transformer.moe import fused_a2a, token_dispatcher

    from primus_turbo.pytorch.deep_ep import install_as_deep_ep

    if not install_as_deep_ep():
        raise RuntimeError(
            "a real DeepEP is installed; turbo.dispatch would shadow it (set turbo.dispatch=false)"
        )
    fused_a2a = importlib.reload(fused_a2a)
    if not fused_a2a.HAVE_DEEP_EP:
        raise RuntimeError("megatron fused_a2a still cannot import deep_ep after installing the turbo Buffer")
    for name in ("fused_dispatch", "fused_combine", "set_deepep_num_sms"):
        replace_attr(token_dispatcher, name, getattr(fused_a2a, name))
    return "MoEFlexTokenDispatcher (deepep backend) -> primus_turbo.pytorch.deep_ep.Buffer"


def _async_tp_condition(ctx) -> str | None:
    p = ctx.cfg.parallel
    return None if p.tp > 1 and p.sequence_parallel else "needs tp > 1 with sequence_parallel"


def _async_tp_probe(ctx) -> str | None:
    if not ctx.cfg.turbo.gemm:
        return "the async-TP linears are the turbo linears: needs turbo.gemm=true"
    if ctx.cfg.fp8.enabled:
        return "precision=fp8: the turbo linears run turbo's FP8 GEMMs; async-TP serves bf16 linears"
    ops = ("ops.fused_all_gather_matmul", "ops.fused_matmul_reduce_scatter", "ops.gemm.gemm_wgrad")
    return _needs_op(*ops)(ctx)


@REGISTRY.register("turbo.async_tp", "megatron.core.tensor_parallel.layers.ColumnParallelLinear", TESTED,
                   feature="async_tp", condition=_async_tp_condition, probe=_async_tp_probe)  # fmt: skip
def _async_tp(ctx) -> str:
    turbo_layers.ASYNC_TP = True
    return (
        "sequence-parallel TurboColumn/RowParallelLinear: all-gather + GEMM and GEMM + reduce-scatter fused "
        "(turbo.ops.fused_all_gather_matmul / fused_matmul_reduce_scatter), fwd and bwd"
    )


@REGISTRY.register("turbo.cross_entropy",
                   "megatron.core.models.common.language_module.language_module.LanguageModule."
                   "compute_language_model_loss", TESTED, feature="cross_entropy",
                   probe=_needs_op("ops.cross_entropy"))  # fmt: skip
def _cross_entropy(ctx) -> str:
    """The LM loss (and MTP's, which calls the same method): one fused kernel each way instead of Megatron's
    eager vocab_parallel_cross_entropy (~8 passes over an fp32 copy of the [s, b, V] logits)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cross_entropy = turbo_ops.get("ops.cross_entropy")

    def compute_language_model_loss(self, labels, logits):
        labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as the logits
        tp = self.pg_collection.tp
        loss = cross_entropy(logits, labels, tp_group=tp if tp.size() > 1 else None)
        return loss.transpose(0, 1).contiguous()

    replace_attr(LanguageModule, "compute_language_model_loss", compute_language_model_loss)
    return "LanguageModule.compute_language_model_loss -> turbo.ops.cross_entropy (vocab-parallel)"


@REGISTRY.register("turbo.embedding", "megatron.core.tensor_parallel.layers.VocabParallelEmbedding.forward",
                   TESTED, feature="embedding", probe=_needs_op("ops.embedding"))  # fmt: skip
def _embedding(ctx) -> str:
    """VocabParallelEmbedding's ``F.embedding`` (through the module's ``F`` global) -> turbo.ops.embedding
    with the weight gradient added into DDP's fp32 main_grad, where the weight has one (under DDP)."""
    from megatron.core.tensor_parallel import layers

    replace_attr(layers, "F", _FunctionalWithTurboEmbedding(turbo_ops.get("ops.embedding")))
    return "VocabParallelEmbedding: F.embedding -> turbo.ops.embedding (weight gradient into main_grad)"


class _FunctionalWithTurboEmbedding:
    """``torch.nn.functional`` for megatron.core.tensor_parallel.layers, except ``embedding``: with a weight
    that has a main_grad (Megatron DDP), turbo's (deterministic, straight into main_grad); else torch's."""

    def __init__(self, embedding):
        self._embedding = embedding

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    def embedding(self, input, weight, *args, **kwargs):
        fusable = weight.requires_grad and isinstance(getattr(weight, "main_grad", None), torch.Tensor)
        if args or kwargs or not fusable:
            return torch.nn.functional.embedding(input, weight, *args, **kwargs)
        return self._embedding(input, weight, accumulate_into_main_grad=True)


@REGISTRY.register("turbo.rope", "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb",
                   TESTED, feature="rope", probe=_needs_op("ops.apply_rotary_pos_emb"))  # fmt: skip
def _rope(ctx) -> str:
    """Attention's and MLA's ``apply_rotary_pos_emb`` -> turbo.ops.apply_rotary_pos_emb where the layout is
    the one it serves (bshd, rotary dim = head dim, a power of two, rotate-half, no TE fusion); others keep
    Megatron's."""
    from megatron.core.transformer import attention
    from megatron.core.transformer import multi_latent_attention as mla

    turbo_rope = turbo_ops.get("ops.apply_rotary_pos_emb")
    stock = mla.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        dim = t.shape[-1]
        served = (
            cu_seqlens is None and not config.apply_rope_fusion and not config.rotary_interleaved
            and t.dim() == 4 and freqs.dim() == 4 and tuple(freqs.shape[1:]) == (1, 1, dim)
            and freqs.shape[0] == t.shape[0] and dim >= 2 and dim & (dim - 1) == 0
        )  # fmt: skip
        if not served:
            return stock(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        return turbo_rope(t, freqs, interleaved_input=bool(config.multi_latent_attention), mscale=mscale)

    replace_attr(attention, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    replace_attr(mla, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    return "attention/MLA apply_rotary_pos_emb -> turbo.ops.apply_rotary_pos_emb (full-dim bshd RoPE)"


def _needs_mla(ctx) -> str | None:
    return None if ctx.cfg.model.mla is not None else "no MLA"


@REGISTRY.register("turbo.mla_qkv",
                   "megatron.core.transformer.multi_latent_attention.MLASelfAttention.get_query_key_value_tensors",
                   TESTED, feature="mla_qkv", condition=_needs_mla,
                   probe=_needs_op("ops.apply_rotary_pos_emb", "ops.mla_key_value"))  # fmt: skip
def _mla_qkv(ctx) -> str:
    ctx.spec.mla_qkv = True
    return "MLASelfAttention -> TurboMLASelfAttention (query / key / value from two turbo kernels each way)"


# ---- FP8: owned by the plugin (Megatron-Core without TE ignores config.fp8 and rejects MoE FP8) -----------


def _fp8_condition(ctx) -> str | None:
    return None if ctx.cfg.fp8.enabled else "precision=bf16"


def _fp8_probe(ctx) -> str | None:
    cfg = ctx.cfg
    if not cfg.turbo.enabled:
        return (
            "Megatron-Core without Transformer Engine has no FP8 path: precision=fp8 needs turbo.enabled=true"
        )
    needed = []
    if cfg.turbo.gemm:
        needed.append("ops.gemm_fp8")
        if cfg.fp8.recipe == "delayed":
            needed.append("core.fp8_autocast.DelayedScalingState")
    if cfg.turbo.grouped_gemm and ctx.is_moe:
        needed.append("ops.grouped_gemm_fp8")
    if not needed:
        return "precision=fp8 needs turbo.gemm or turbo.grouped_gemm"
    return _needs_op(*needed)(ctx)


@REGISTRY.register("turbo.fp8", "megatron.core.transformer.transformer_config.TransformerConfig.fp8", TESTED,
                   condition=_fp8_condition, probe=_fp8_probe)  # fmt: skip
def _fp8(ctx) -> str:
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingStrategy

    fp8 = ctx.cfg.fp8
    recipe, experts, fmt_name = fp8.recipe, fp8_expert_recipe(fp8), fp8.get("format", "auto")
    hp_wgrad = fp8.get("wgrad", "bf16") == "bf16"
    wgrad = "; weight gradients in bf16" if hp_wgrad else ""

    def describe(config: Float8QuantConfig) -> str:
        return f"FP8 {config.format.value} {config.granularity.value} {config.strategy.name.lower()} scaling"

    if recipe == "delayed":
        # Linears keep a per-module amax history (DelayedScalingState); grouped_gemm_fp8 has no delayed
        # scaling, so the experts use current scaling (tensorwise unless fp8.expert_recipe says otherwise).
        fmt = Format[fp8_format_name(recipe, fmt_name)]
        turbo_layers.FP8_CONFIG = Float8QuantConfig(
            format=fmt, strategy=ScalingStrategy.DELAYED, high_precision_wgrad=hp_wgrad
        )
    else:
        turbo_layers.FP8_CONFIG = fp8_current_config(recipe, fmt_name, hp_wgrad)
    same = experts == recipe
    turbo_layers.FP8_GROUPED_CONFIG = (
        turbo_layers.FP8_CONFIG if same else fp8_current_config(experts, fmt_name, hp_wgrad)
    )
    if same:
        return f"turbo linears/experts run FP8 GEMMs: {describe(turbo_layers.FP8_CONFIG)}" + wgrad
    return (
        f"linears: {describe(turbo_layers.FP8_CONFIG)}; experts: {describe(turbo_layers.FP8_GROUPED_CONFIG)}"
        + wgrad
    )


def _needs_torch_adam(ctx) -> str | None:
    from megatron.core import optimizer

    if getattr(optimizer, "USING_PYTORCH_OPTIMIZER", True) is False:
        return "Transformer Engine / Apex FusedAdam in use"
    return None


@REGISTRY.register("turbo.optimizer", "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
                   TESTED, feature="optimizer", condition=_needs_torch_adam)  # fmt: skip
def _optimizer(ctx) -> str:
    """Megatron's torch AdamW -> turbo.optim.AdamW (swapped by the trainer once the optimizer exists), the
    clip factor and the master-to-bf16 cast inside its one pass (``turbo_optimizer``)."""
    from primus_turbo.integrations.megatron import turbo_optimizer

    turbo_optimizer.install_clip()
    turbo_optimizer.ENABLED = True
    return "torch AdamW -> turbo.optim.AdamW (clip factor and master-to-model cast in the step)"


@REGISTRY.register("turbo.sync_free_step", "megatron.core.optimizer.optimizer.get_grad_norm_fp32", TESTED,
                   feature="sync_free_step")  # fmt: skip
def _sync_free_step(ctx) -> str:
    """The step without host syncs (``sync_free``): the gradient norm and clip factor stay on the GPU, the
    batches are pinned, the trainer reads loss, norm and the SIGTERM flag back one step later."""
    from primus_turbo.integrations.megatron import sync_free

    sync_free.install()
    sync_free.ENABLED = True
    return "grad norm and clip on the GPU, batches pinned, loss / norm read back one step later (event-timed)"
