"""The ``primus_turbo`` TorchTitan model converter and its patch registry (same rules as the Megatron side).

Enable it in any TorchTitan 0.2.2 job with ``--model.converters primus_turbo`` after importing this
module, or through ``train.py framework=torchtitan`` (which sets the options from the Hydra recipe).
``convert(model)`` runs on the meta-device model before parallelisation, swapping per turbo flag:

  gemm          nn.Linear (all but the MoE router gate) -> turbo Linear, or Float8Linear with precision=fp8;
                FeedForward w1/w3 -> one GEMM + turbo swiglu (bf16 linears over fp32 weights under autocast)
  attention     ScaledDotProductAttentionWrapper -> TurboAttention "bhsd" (MLA 192/128, GQA)
  rope          DeepSeek-V3 MLA Attention -> TurboMLA (q's split + RoPE + cat, k_pe's RoPE, the keys' split +
                cat: one kernel each way)
  rmsnorm       nn.RMSNorm -> turbo RMSNorm
  embedding     nn.Embedding -> weight gradient into the fp32 .grad by turbo.ops.embedding (no FSDP, tp == 1)
  grouped_gemm  GroupedExperts -> turbo grouped GEMM (bf16 or FP8) over the stacked w1/w2/w3
  router        TokenChoiceTopKRouter -> turbo fused_topk_routing
  permute       MoE's token reorder / gather / un-sort -> turbo token_permute / token_unpermute
  dispatch      (ep > 1) ExpertParallel's all-to-all + permute -> moe_dispatch / moe_combine in MoE.forward

Single-device runs (fp32 parameters under autocast): the turbo linears and experts cast (quantize) each weight
once per optimizer step and add its gradient into ``.grad`` in the backward (``amp_weights``).

Parameter names and shapes never change. Fail-closed: a requested feature that cannot serve the run stops it
(``PatchError``) unless turbo.strict=false; every decision is a row of the turbo report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from primus_turbo.integrations.common.config import fp8_current_config
from primus_turbo.integrations.common.patch_registry import (
    ACTIVE,
    FALLBACK,
    PatchError,
    PatchRegistry,
    ReportRow,
    apply_patches,
    format_report,
)
from primus_turbo.integrations.megatron import turbo_ops  # framework-agnostic op lookup
from primus_turbo.integrations.torchtitan import amp_weights
from primus_turbo.integrations.torchtitan import turbo_modules as tm
from torch import nn
from torchtitan.models.attention import ScaledDotProductAttentionWrapper
from torchtitan.models.llama3.model.model import FeedForward as Llama3FeedForward
from torchtitan.models.moe.moe import FeedForward as MoEFeedForward
from torchtitan.models.moe.moe import GroupedExperts, MoE, TokenChoiceTopKRouter
from torchtitan.models.qwen3.model.model import FeedForward as Qwen3FeedForward
from torchtitan.protocols.model_converter import _registry_model_converter_cls as _registered_converters
from torchtitan.protocols.model_converter import register_model_converter

TESTED = ("0.2.2",)
_FEED_FORWARDS = (MoEFeedForward, Llama3FeedForward, Qwen3FeedForward)  # w2(silu(w1(x)) * w3(x))
CONVERTER_NAME = "primus_turbo"
REGISTRY = PatchRegistry(framework="torchtitan")


@dataclass
class TurboOptions:
    """The ``turbo.*`` flags, FP8 recipe and parallel degrees the converter needs (``turbo_cfg`` for the
    registry: ``enabled``, ``strict`` and one bool per feature)."""

    enabled: bool = True
    strict: bool = True
    gemm: bool = True
    grouped_gemm: bool = True
    attention: bool = True
    rmsnorm: bool = True
    router: bool = True
    permute: bool = False
    dispatch: bool = False
    async_tp: bool = False
    embedding: bool = True
    rope: bool = True
    fp8_recipe: str | None = None  # None = bf16; tensorwise | rowwise | blockwise | delayed
    fp8_wgrad: str = "bf16"  # bf16 | fp8 (bf16: Float8QuantConfig.high_precision_wgrad)
    fp8_format: str = "auto"  # auto | hybrid | e4m3 (common.config.fp8_format_name)
    fp8_expert_recipe: str = "same"  # same | tensorwise | rowwise | blockwise: the experts' grouped GEMMs
    tp: int = 1
    ep: int = 1
    cp: int = 1
    fsdp: bool = False  # TorchTitan shards the parameters (bf16 under FSDP's mixed precision)
    compile: bool = False  # TorchTitan compiles each block (framework.compile)

    def get(self, key, default=None):
        return getattr(self, key, default)


_OPTIONS: TurboOptions | None = None
LAST_REPORT: list = []


def options_from_cfg(cfg) -> TurboOptions:
    """TurboOptions from the Hydra config (turbo.*, fp8.*, parallel.*)."""
    t, p = cfg.turbo, cfg.parallel
    flags = {k: bool(t[k]) for k in ("enabled", "strict", "gemm", "grouped_gemm", "attention", "rmsnorm",
                                       "router", "permute", "dispatch", "async_tp", "embedding",
                                       "rope")}  # fmt: skip
    fp8 = cfg.fp8.recipe if cfg.fp8.enabled else None
    wgrad, fmt = cfg.fp8.get("wgrad", "bf16"), cfg.fp8.get("format", "auto")
    experts = cfg.fp8.get("expert_recipe", "same")
    return TurboOptions(**flags, fp8_recipe=fp8, fp8_wgrad=wgrad, fp8_format=fmt, fp8_expert_recipe=experts,
                        tp=p.tp, ep=p.ep, cp=p.cp)  # fmt: skip


def set_options(options: TurboOptions | None) -> None:
    """Options for converters built after this call (train.py sets them from the recipe; None = defaults)."""
    global _OPTIONS
    _OPTIONS = options


@dataclass
class TitanPatchContext:
    model: nn.Module
    options: TurboOptions
    fp8_config: object = None
    fp8_expert_config: object = None  # the experts' (fp8.expert_recipe); fp8_config unless it differs
    notes: dict = field(default_factory=dict)

    def modules_of(self, cls, exact: bool = True) -> list[tuple[nn.Module, str, nn.Module]]:
        """(parent, attribute name, child) for every ``cls`` instance (``exact``: not subclasses, which
        are the turbo replacements already in place)."""
        found = []
        for parent in self.model.modules():
            for name, child in parent.named_children():
                if type(child) is cls or (not exact and isinstance(child, cls)):
                    found.append((parent, name, child))
        return found


def _needs(*ops):
    def probe(ctx) -> str | None:
        missing = [n for n in ops if not turbo_ops.has(n)]
        return f"turbo op(s) {', '.join(missing)} not found in primus_turbo" if missing else None

    return probe


def _tp_condition(what: str):
    def condition(ctx) -> str | None:
        if ctx.options.tp > 1:
            return f"tp > 1: TorchTitan's TP plans shard {what}; stock module kept"
        return None

    return condition


def _needs_moe(ctx) -> str | None:
    return None if ctx.modules_of(GroupedExperts, exact=False) else "dense model (no GroupedExperts)"


def _all(*conditions):
    """The first reason any of ``conditions`` gives (None: all hold)."""
    return lambda ctx: next((r for c in conditions if (r := c(ctx))), None)


def _has(cls, what: str, exact: bool = True):
    """Condition: the model holds a ``cls`` to swap. A swap over none (a model, or a TorchTitan version,
    without that class) is 'n/a' with the reason, not an 'active' row over 0 modules."""
    return lambda ctx: None if ctx.modules_of(cls, exact) else f"no {what} in the model"


# ---- FP8 (first: the linear and expert swaps read ctx.fp8_config) ---------------------------------------


def _fp8_probe(ctx) -> str | None:
    o = ctx.options
    if not (o.gemm or o.grouped_gemm):
        return "precision=fp8 needs turbo.gemm or turbo.grouped_gemm"
    if o.fp8_recipe == "delayed":
        return (
            "fp8.recipe=delayed: TorchTitan builds the model on the meta device and its init_weights does "
            "not initialise amax histories (and grouped_gemm_fp8 is current-scaling only): use "
            "tensorwise|rowwise|blockwise"
        )
    return _needs("ops.gemm_fp8", "ops.grouped_gemm_fp8")(ctx)


@REGISTRY.register("turbo.fp8", "primus_turbo.pytorch.core.low_precision.Float8QuantConfig", TESTED,
                   condition=lambda ctx: None if ctx.options.fp8_recipe else "precision=bf16",
                   probe=_fp8_probe)  # fmt: skip
def _fp8(ctx) -> str:
    o = ctx.options
    hp_wgrad = o.fp8_wgrad == "bf16"

    def describe(config) -> str:
        return f"{config.format.value} {config.granularity.value} current scaling"

    ctx.fp8_config = fp8_current_config(o.fp8_recipe, o.fp8_format, hp_wgrad)
    experts = o.fp8_expert_recipe
    same = experts in ("same", o.fp8_recipe)
    ctx.fp8_expert_config = ctx.fp8_config if same else fp8_current_config(experts, o.fp8_format, hp_wgrad)
    wgrad = "; weight gradients in bf16" if hp_wgrad else ""
    if ctx.fp8_expert_config is ctx.fp8_config:
        return f"turbo linears/experts run FP8 GEMMs: {describe(ctx.fp8_config)}" + wgrad
    return f"linears: FP8 {describe(ctx.fp8_config)}; experts: FP8 {describe(ctx.fp8_expert_config)}" + wgrad


# ---- module swaps ----------------------------------------------------------------------------------------


def _fp8_linear_ok(linear: nn.Linear) -> bool:
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


@REGISTRY.register("turbo.gemm", "torch.nn.Linear", TESTED, feature="gemm",
                   condition=_all(_tp_condition("nn.Linear"), _has(nn.Linear, "nn.Linear")),
                   probe=_needs("ops.gemm"))  # fmt: skip
def _gemm(ctx) -> str:
    swapped, kept = 0, []
    for parent, name, linear in ctx.modules_of(nn.Linear):
        if isinstance(parent, TokenChoiceTopKRouter):
            kept.append(name)  # [T, E] router logits: tiny N, stays on torch (as on the Megatron side)
            continue
        if ctx.fp8_config is not None and name != "output" and _fp8_linear_ok(linear):
            setattr(parent, name, tm.TitanFloat8Linear.from_stock(linear, ctx.fp8_config))
        else:
            setattr(parent, name, tm.TitanLinear.from_stock(linear))
        swapped += 1
    kind = "Float8Linear (LM head: bf16)" if ctx.fp8_config is not None else "Linear"
    ffns = [m for m in ctx.model.modules() if type(m) in _FEED_FORWARDS]
    for ffn in ffns:
        ffn.__class__ = tm.feed_forward_class(type(ffn))
    return (
        f"{swapped} nn.Linear -> turbo {kind}; router gates kept ({len(kept)}); {len(ffns)} FeedForward: "
        "w1/w3 as one GEMM + turbo swiglu where bf16 linears read fp32 weights under autocast"
    )


def _embedding_condition(ctx) -> str | None:
    if ctx.options.tp > 1:
        return "tp > 1: TorchTitan's TP plan shards the embedding; stock nn.Embedding"
    if ctx.options.fsdp:
        return "FSDP shards the embedding and reduces its gradient itself; stock nn.Embedding"
    return None if ctx.modules_of(nn.Embedding) else "no nn.Embedding"


@REGISTRY.register("turbo.embedding", "torch.nn.Embedding", TESTED, feature="embedding",
                   condition=_embedding_condition, probe=_needs("ops.embedding"))  # fmt: skip
def _embedding(ctx) -> str:
    embeddings = ctx.modules_of(nn.Embedding)
    for _, _, module in embeddings:
        module.__class__ = tm.TitanEmbedding
    return (
        f"{len(embeddings)} nn.Embedding -> TitanEmbedding (the weight gradient goes into the fp32 .grad "
        "through turbo.ops.embedding, touched rows only)"
    )


def _attention_condition(ctx) -> str | None:
    if ctx.options.cp > 1:
        return "context parallelism (cp > 1) uses TorchTitan's CP attention"
    if not ctx.modules_of(ScaledDotProductAttentionWrapper):
        return "no SDPA inner attention (flex/varlen attention kept)"
    return None


@REGISTRY.register("turbo.attention", "torchtitan.models.attention.ScaledDotProductAttentionWrapper", TESTED,
                   feature="attention", condition=_attention_condition,
                   probe=_needs("modules.TurboAttention"))  # fmt: skip
def _attention(ctx) -> str:
    count = 0
    for parent, name, _ in ctx.modules_of(ScaledDotProductAttentionWrapper):
        scale = getattr(parent, "softmax_scale", None) or getattr(parent, "scaling", None)
        setattr(parent, name, tm.TitanInnerAttention(softmax_scale=scale))
        count += 1
    return f"{count} SDPA inner attention -> TurboAttention(layout=bhsd) (turbo.ops.flash_attn_func)"


def _rope_condition(ctx) -> str | None:
    if ctx.options.tp > 1:
        return "tp > 1: TorchTitan's TP plan hands the attention DTensor-sharded heads; stock Attention kept"
    return None if ctx.modules_of(tm.MLAAttention) else "no DeepSeek-V3 MLA attention"


@REGISTRY.register("turbo.rope", "torchtitan.models.deepseek_v3.model.model.Attention", TESTED,
                   feature="rope", condition=_rope_condition,
                   probe=_needs("ops.rope.apply_rotary_emb_complex", "ops.mla.mla_key_value"))  # fmt: skip
def _rope(ctx) -> str:
    layers = ctx.modules_of(tm.MLAAttention)
    for _, _, module in layers:
        module.__class__ = tm.TurboMLA
    return (
        f"{len(layers)} MLA Attention -> TurboMLA (q: split + RoPE + cat, k_pe: RoPE -> "
        "turbo.ops.apply_rotary_emb_complex; keys/values: split + cat -> turbo.ops.mla_key_value; one kernel "
        "each way)"
    )


@REGISTRY.register("turbo.rmsnorm", "torch.nn.RMSNorm", TESTED, feature="rmsnorm",
                   condition=_all(_tp_condition("the norms (SequenceParallel)"),
                                  _has(nn.RMSNorm, "nn.RMSNorm")),
                   probe=_needs("modules.RMSNorm"))  # fmt: skip
def _rmsnorm(ctx) -> str:
    norms = ctx.modules_of(nn.RMSNorm)
    for parent, name, norm in norms:
        setattr(parent, name, tm.TitanRMSNorm.from_stock(norm))
    return f"{len(norms)} nn.RMSNorm -> turbo RMSNorm (turbo.ops.rmsnorm)"


@REGISTRY.register("turbo.grouped_gemm", "torchtitan.models.moe.moe.GroupedExperts", TESTED,
                   feature="grouped_gemm", condition=_needs_moe,
                   probe=_needs("ops.grouped_gemm", "ops.grouped_gemm_fp8"))  # fmt: skip
def _grouped_gemm(ctx) -> str:
    experts = ctx.modules_of(GroupedExperts)
    for _, _, module in experts:
        module.__class__ = tm.TurboGroupedExperts  # same parameters, new forward
    tm.EXPERTS_FP8_CONFIG = ctx.fp8_expert_config
    kind = "grouped_gemm_fp8" if ctx.fp8_expert_config is not None else "grouped_gemm"
    return f"{len(experts)} GroupedExperts -> turbo.ops.{kind} (w1/w2/w3 unchanged)"


def _router_probe(ctx) -> str | None:
    for _, _, router in ctx.modules_of(TokenChoiceTopKRouter):
        problem = tm.router_semantics_problem(router)
        if problem:
            return problem
    return _needs("ops.moe.fused_topk_routing")(ctx)


@REGISTRY.register("turbo.router", "torchtitan.models.moe.moe.TokenChoiceTopKRouter", TESTED,
                   feature="router", probe=_router_probe,
                   condition=_all(_needs_moe, _has(TokenChoiceTopKRouter, "router")))  # fmt: skip
def _router(ctx) -> str:
    routers = ctx.modules_of(TokenChoiceTopKRouter)
    for _, _, module in routers:
        module.__class__ = tm.TurboTopKRouter
    return f"{len(routers)} TokenChoiceTopKRouter -> turbo.ops.fused_topk_routing"


def _permute_condition(ctx) -> str | None:
    if ctx.options.tp > 1 and ctx.options.ep > 1:  # TorchTitan borrows TP for EP: a TP plan on the reorderer
        return "tp > 1 with ep > 1: TorchTitan splits the token reorder over TP ranks; stock MoE.forward runs"
    return _needs_moe(ctx) or _has(MoE, "MoE")(ctx)


@REGISTRY.register("turbo.permute", "torchtitan.models.moe.moe.MoE.forward", TESTED, feature="permute",
                   condition=_permute_condition,
                   probe=_needs("ops.moe.permute.token_permute",
                                "ops.moe.permute.token_unpermute"))  # fmt: skip
def _permute(ctx) -> str:
    layers = ctx.modules_of(MoE)
    for _, _, module in layers:
        module.__class__ = tm.TurboMoE
    return f"{len(layers)} MoE token reorder/gather/un-sort -> turbo token_permute / token_unpermute"


def _dispatch_condition(ctx) -> str | None:
    if ctx.options.ep <= 1:
        return "ep=1: no EP communication"
    if ctx.options.tp > 1:  # ReordererSequenceParallel / ExpertTensorParallel split the tokens over TP ranks
        return "tp > 1 with ep > 1: TorchTitan splits the EP tokens over TP ranks; its all-to-all runs"
    return _needs_moe(ctx) or _has(MoE, "MoE", exact=False)(ctx)


def _dispatch_probe(ctx) -> str | None:
    if ctx.modules_of(GroupedExperts):  # stock experts expect ExpertParallel's padded groups
        return "the experts are stock GroupedExperts: turbo.dispatch needs turbo.grouped_gemm"
    return _needs("ops.moe.dispatch.moe_dispatch", "ops.moe.dispatch.moe_combine",
                  "ops.moe.permute.token_permute")(ctx)  # fmt: skip


# After permute: TurboMoE layers (or stock MoE with turbo.permute=false) become TurboEPMoE (which permutes).
@REGISTRY.register("turbo.dispatch", "torchtitan.distributed.expert_parallel.ExpertParallel._apply", TESTED,
                   feature="dispatch", condition=_dispatch_condition, probe=_dispatch_probe)  # fmt: skip
def _dispatch(ctx) -> str:
    layers = [m for _, _, m in ctx.modules_of(MoE, exact=False) if type(m) in (MoE, tm.TurboMoE)]
    for module in layers:
        module.__class__ = tm.TurboEPMoE
        module.experts.turbo_dispatch = True
    tm.leave_token_exchange_to_turbo()
    return (
        f"{len(layers)} MoE: EP all-to-all + permute (ExpertParallel hooks) -> turbo moe_dispatch / "
        "token_permute / moe_combine in MoE.forward; ExpertParallel only shards the experts"
    )


# ---- tensor parallelism --------------------------------------------------------------------------------


def _async_tp_probe(ctx) -> str | None:
    if ctx.options.compile:
        return (
            "framework.compile=true: turbo's fused all-gather/reduce-scatter GEMMs run eagerly (TorchTitan's "
            "own async TP needs compile); set framework.compile=false or turbo.async_tp=false"
        )
    from primus_turbo.integrations.torchtitan import async_tp

    if not any(async_tp.plan_for(name, m) for b in getattr(ctx.model, "layers", {}).values()
               for name, m in b.named_children()):  # fmt: skip
        return "no bias-free block attention / dense feed-forward that TorchTitan's TP plan gathers"
    return _needs("ops.fused_all_gather_matmul", "ops.fused_matmul_reduce_scatter")(ctx)


@REGISTRY.register("turbo.async_tp", "torch.distributed.tensor.parallel.PrepareModuleInput", TESTED,
                   feature="async_tp",
                   condition=lambda ctx: None if ctx.options.tp > 1 else "needs tp > 1",
                   probe=_async_tp_probe)  # fmt: skip
def _async_tp(ctx) -> str:
    from primus_turbo.integrations.torchtitan import async_tp

    marked = async_tp.mark_blocks(ctx.model)
    return (
        f"{len(marked)} attention / dense feed-forward modules: TP input all-gather + the GEMMs reading it "
        "-> turbo fused_all_gather_matmul, wo/w2 GEMM + reduce-scatter -> fused_matmul_reduce_scatter "
        "(MoE layers: TorchTitan's TP)"
    )


def convert_model(model: nn.Module, options: TurboOptions) -> list:
    """Apply the registry to ``model`` in place; returns the report rows (raises PatchError when strict)."""
    import torchtitan

    tm.EXPERTS_FP8_CONFIG = None
    ctx = TitanPatchContext(model=model, options=options)
    rows = apply_patches(REGISTRY, ctx, options, getattr(torchtitan, "__version__", "0.2.2"))
    rows = _check_fp8_reaches_a_gemm(model, options, rows)
    LAST_REPORT[:] = rows
    return rows


def _check_fp8_reaches_a_gemm(model: nn.Module, options: TurboOptions, rows: list) -> list:
    """precision=fp8 with no FP8 module after the swaps (a dense model with turbo.gemm n/a under tp > 1, or
    off): fail closed under strict, else say so in the report, instead of training in high precision under
    an "active" FP8 row."""
    fp8 = next((r for r in rows if r.name == "turbo.fp8"), None)
    if fp8 is None or fp8.status != ACTIVE:
        return rows
    experts = any(r.name == "turbo.grouped_gemm" and r.status == ACTIVE for r in rows)
    if any(isinstance(m, tm.TitanFloat8Linear) for m in model.modules()) or (
        experts and tm.EXPERTS_FP8_CONFIG is not None
    ):
        return rows
    status = {r.name: r.status for r in rows}
    problem = (
        f"precision=fp8 but no GEMM runs in FP8: turbo.gemm is {status.get('turbo.gemm')} (TorchTitan keeps "
        f"its linears under parallel.tp > 1) and turbo.grouped_gemm is {status.get('turbo.grouped_gemm')}"
    )
    if options.strict:
        raise PatchError(f"{problem}. Use precision=bf16, or turbo.strict=false to train in high precision.")
    return [ReportRow(r.name, FALLBACK, r.target, problem) if r is fp8 else r for r in rows]


class PrimusTurboConverter:
    """TorchTitan ``ModelConverter``: ``convert`` swaps modules, prints the turbo report on rank 0."""

    def __init__(self, job_config, parallel_dims):
        options = _OPTIONS or TurboOptions()
        options.tp = parallel_dims.tp
        options.ep = parallel_dims.ep
        options.cp = parallel_dims.cp
        options.fsdp = bool(getattr(parallel_dims, "fsdp_enabled", False))
        options.compile = bool(job_config.compile.enable and "model" in job_config.compile.components)
        self.options = options

    def convert(self, model: nn.Module) -> None:
        rows = convert_model(model, self.options)
        amp_weights.new_step()  # TorchTitan's Trainer calls post_optimizer_hook after every optimizer step
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(format_report(f"torchtitan, turbo.enabled={self.options.enabled}", rows), flush=True)

    def post_optimizer_hook(self, model) -> None:
        """The weights changed: single-device AMP runs cast (quantize) them again on the next micro-batch."""
        amp_weights.new_step()


if CONVERTER_NAME not in _registered_converters:
    register_model_converter(PrimusTurboConverter, CONVERTER_NAME)
