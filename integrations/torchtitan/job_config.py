"""Hydra recipe -> TorchTitan 0.2.2: model args (a flavor of llama3 / qwen3 / deepseek_v3 with the recipe's
sizes) and a ``JobConfig`` (parallelism, schedule, optimizer, checkpoint, metrics, compile, converters).

Model family by recipe shape:
  MLA (model.mla)              -> deepseek_v3 (MLA attention; first_k_dense dense layers, MoE after)
  MoE without MLA (GQA)        -> qwen3 with moe_enabled (qk_norm off: the recipes have no q/k norm)
  dense GQA                    -> llama3 (ffn_hidden_size reproduced through multiple_of/ffn_dim_multiplier)

Everything a recipe asks that TorchTitan cannot express raises ``ConfigError`` here, before any process
group, model or GPU memory exists. Known, documented differences from the Megatron side: MoE load balancing
is TorchTitan's aux-loss-free expert bias (``load_balance_coeff``), not Megatron's aux loss.
"""

from __future__ import annotations

import os
import tempfile

import torch
from omegaconf import DictConfig
from primus_turbo.integrations.common.config import ConfigError, moe_layer_pattern

FAMILIES = ("deepseek_v3", "qwen3", "llama3")


def model_family(cfg: DictConfig) -> str:
    m = cfg.model
    if m.mla is not None:
        return "deepseek_v3"
    return "qwen3" if m.moe is not None else "llama3"


def _moe_args(cfg: DictConfig):
    from torchtitan.models.moe import MoEArgs

    moe = cfg.model.moe
    shared = moe.get("shared_expert_ffn_hidden_size") or 0
    if shared % moe.ffn_hidden_size:
        raise ConfigError(
            f"model.moe.shared_expert_ffn_hidden_size={shared} is not a multiple of moe.ffn_hidden_size="
            f"{moe.ffn_hidden_size}: TorchTitan's shared experts are num_shared_experts x moe_inter_dim"
        )
    return MoEArgs(
        num_experts=moe.num_experts,
        num_shared_experts=shared // moe.ffn_hidden_size,
        score_func=moe.get("score_function", "softmax"),
        route_norm=moe.get("score_function", "softmax") == "sigmoid",
        route_scale=1.0,
        score_before_experts=False,
        top_k=moe.topk,
        num_expert_groups=moe.get("num_groups") or None,
        num_limited_groups=moe.get("group_topk") or None,
        use_grouped_mm=True,
        load_balance_coeff=1e-3,
    )


def _deepseek_args(cfg: DictConfig):
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    m, mla = cfg.model, cfg.model.mla
    first_dense = moe_layer_pattern(m).count(0)
    args = DeepSeekV3ModelArgs(
        max_seq_len=m.seq_length, vocab_size=m.vocab_size, dim=m.hidden_size, inter_dim=m.ffn_hidden_size,
        moe_inter_dim=m.moe.ffn_hidden_size if m.moe is not None else m.ffn_hidden_size,
        n_layers=m.num_layers, n_dense_layers=first_dense, n_heads=m.num_attention_heads, norm_eps=m.norm_eps,
        moe_args=_moe_args(cfg) if m.moe is not None else MoEArgs(),
        q_lora_rank=mla.q_lora_rank or 0, kv_lora_rank=mla.kv_lora_rank, qk_nope_head_dim=mla.qk_head_dim,
        qk_rope_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim, attn_type="sdpa",
        original_seq_len=m.seq_length, rope_theta=float(m.rotary_base),
    )  # fmt: skip
    args.moe_impl = "standard"  # update_from_config sets it from the job; the default for direct builds
    return args


def _qwen3_args(cfg: DictConfig):
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    m = cfg.model
    if m.moe is not None and (m.moe.get("first_k_dense") or 0) > 0:
        raise ConfigError(
            f"model.moe.first_k_dense={m.moe.first_k_dense}: TorchTitan's qwen3 MoE (the GQA MoE model) has "
            "MoE in every layer; use first_k_dense=0, or an MLA recipe (deepseek_v3 supports dense layers)"
        )
    return Qwen3ModelArgs(
        dim=m.hidden_size, n_layers=m.num_layers, n_heads=m.num_attention_heads,
        n_kv_heads=m.num_query_groups or m.num_attention_heads, vocab_size=m.vocab_size,
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads, hidden_dim=m.ffn_hidden_size,
        norm_eps=m.norm_eps, rope_theta=float(m.rotary_base), qk_norm=False, max_seq_len=m.seq_length,
        enable_weight_tying=not m.untie_embeddings, moe_enabled=m.moe is not None,
        moe_inter_dim=m.moe.ffn_hidden_size if m.moe is not None else m.ffn_hidden_size,
        moe_args=_moe_args(cfg) if m.moe is not None else MoEArgs(),  # (its update_from_config reads it)
    )  # fmt: skip


def llama3_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """TorchTitan llama3 FeedForward's hidden size formula (hidden_dim = 4 * dim on entry)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _llama3_args(cfg: DictConfig):
    from torchtitan.models.llama3.model.args import TransformerModelArgs

    m = cfg.model
    if m.kv_channels not in (None, m.hidden_size // m.num_attention_heads):
        return _qwen3_args(cfg)  # llama3 fixes head_dim = dim / n_heads; qwen3 takes it explicitly
    # multiple_of = ffn rounds any hidden size in (0, ffn] up to exactly ffn.
    multiplier = m.ffn_hidden_size / int(8 * m.hidden_size / 3)
    if llama3_ffn(m.hidden_size, m.ffn_hidden_size, multiplier) != m.ffn_hidden_size:
        return _qwen3_args(cfg)
    if not m.untie_embeddings:
        return _qwen3_args(cfg)
    return TransformerModelArgs(
        dim=m.hidden_size, n_layers=m.num_layers, n_heads=m.num_attention_heads,
        n_kv_heads=m.num_query_groups or m.num_attention_heads, vocab_size=m.vocab_size,
        multiple_of=m.ffn_hidden_size, ffn_dim_multiplier=multiplier, norm_eps=m.norm_eps,
        rope_theta=float(m.rotary_base), max_seq_len=m.seq_length, attn_type="sdpa",
    )  # fmt: skip


def build_model_args(cfg: DictConfig) -> tuple[str, object]:
    """(TorchTitan model family, its model-args dataclass) for the recipe."""
    family = model_family(cfg)
    if family == "deepseek_v3":
        return family, _deepseek_args(cfg)
    if family == "qwen3":
        return family, _qwen3_args(cfg)
    args = _llama3_args(cfg)
    return ("llama3" if type(args).__name__ == "TransformerModelArgs" else "qwen3"), args


def check_expressible(cfg: DictConfig) -> None:
    """ConfigError for what TorchTitan 0.2.2 (or this adapter) cannot run; cheap, no imports of torchtitan."""
    p, m = cfg.parallel, cfg.model
    if p.tp > 1 and not p.sequence_parallel:
        raise ConfigError(
            f"parallel.tp={p.tp} with sequence_parallel=false: TorchTitan's tensor parallelism always "
            "shards the sequence (sequence parallel); set parallel.sequence_parallel=true"
        )
    if p.pp > 1 and model_family(cfg) == "qwen3":
        raise ConfigError(f"parallel.pp={p.pp}: TorchTitan's qwen3 (GQA MoE) has no pipelining function")
    if p.ep > 1 and p.tp > 1:
        raise ConfigError("parallel.ep > 1 with tp > 1: this adapter runs expert tensor parallel = 1 only")
    if m.moe is not None and m.moe.get("dispatcher", "alltoall") == "flex":
        raise ConfigError(
            "model.moe.dispatcher=flex: TorchTitan's DeepEP backend needs the external deep_ep package; "
            "use dispatcher=alltoall with framework=torchtitan"
        )
    if m.mla is not None and m.mla.get("rope_type", "rope") != "rope":
        raise ConfigError(
            f"model.mla.rope_type={m.mla.rope_type}: this adapter builds DeepSeek-V3 with plain RoPE "
            "(original_seq_len = seq_length, no YaRN scaling); use rope_type=rope with framework=torchtitan"
        )
    if cfg.fp8.enabled and not cfg.turbo.enabled:
        raise ConfigError(
            "precision=fp8 with turbo.enabled=false: stock TorchTitan FP8 needs torchao (not a dependency "
            "here); use turbo.enabled=true for turbo FP8, or precision=bf16 for the stock baseline"
        )
    if cfg.fp8.enabled and cfg.turbo.enabled and not (cfg.turbo.gemm or cfg.turbo.grouped_gemm):
        raise ConfigError(
            "precision=fp8 with turbo.gemm=false and turbo.grouped_gemm=false: no GEMM would run in FP8 "
            "(conflicting flags); enable one of them or use precision=bf16"
        )
    folder = os.path.join(cfg.train.ckpt_dir or "", "checkpoint")
    if cfg.train.ckpt_dir and not cfg.resume and os.path.isdir(folder) and os.listdir(folder):
        raise ConfigError(
            f"train.ckpt_dir={cfg.train.ckpt_dir} already holds TorchTitan checkpoints ({folder}), which its "
            "Trainer would load: pass resume=true to continue from them, or use an empty train.ckpt_dir"
        )
    if cfg.turbo.enabled and cfg.turbo.dispatch and not cfg.turbo.grouped_gemm and p.ep > 1:
        raise ConfigError("turbo.dispatch=true needs turbo.grouped_gemm=true (conflicting converter flags)")


def _training_dtype(cfg: DictConfig) -> str:
    if cfg.train.dtype == "auto":
        return "bfloat16" if torch.cuda.is_available() else "float32"
    return {"bf16": "bfloat16", "fp32": "float32"}[cfg.train.dtype]


def build_job_config(cfg: DictConfig, model_name: str, flavor: str):
    """TorchTitan JobConfig for the recipe; ``model_name``/``flavor`` name the registered train spec."""
    from torchtitan.config import JobConfig

    job = JobConfig()
    t, p, d, fw = cfg.train, cfg.parallel, cfg.data, cfg.framework
    job.job.dump_folder = t.ckpt_dir or os.path.join(tempfile.gettempdir(), "primus_turbo_torchtitan")
    job.job.description = f"primus_turbo recipe={cfg.recipe_name}"
    job.model.name, job.model.flavor = model_name, flavor
    job.model.converters = ["primus_turbo"] if cfg.turbo.enabled else []
    job.model.hf_assets_path = ""
    job.optimizer.lr, job.optimizer.weight_decay = t.lr, t.weight_decay
    job.optimizer.beta1, job.optimizer.beta2 = t.adam_beta1, t.adam_beta2
    job.optimizer.implementation = "fused" if torch.cuda.is_available() else "foreach"
    job.lr_scheduler.warmup_steps = min(t.warmup_steps, t.steps - 1)
    job.lr_scheduler.decay_type = "cosine"
    job.lr_scheduler.min_lr_factor = t.min_lr / t.lr
    tr = job.training
    tr.local_batch_size, tr.global_batch_size = d.micro_batch_size, d.global_batch_size
    # train.clip_grad=0 means no clipping (as on Megatron); TorchTitan's clip would scale every gradient to 0
    tr.seq_len, tr.steps, tr.max_norm = cfg.model.seq_length, t.steps, t.clip_grad or float("inf")
    tr.dtype, tr.mixed_precision_param = "float32", _training_dtype(cfg)
    par = job.parallelism
    par.tensor_parallel_degree, par.pipeline_parallel_degree = p.tp, p.pp
    par.context_parallel_degree, par.expert_parallel_degree = p.cp, p.ep
    par.data_parallel_shard_degree, par.expert_tensor_parallel_degree = -1, 1
    job.activation_checkpoint.mode = "full" if t.activation_recompute else "none"
    job.compile.enable = bool(fw.get("compile", False))
    job.metrics.log_freq = t.log_interval
    job.metrics.enable_tensorboard = False
    job.checkpoint.enable = bool(t.ckpt_dir)
    job.checkpoint.folder = "checkpoint"
    job.checkpoint.interval = t.save_interval or t.steps
    job.checkpoint.last_save_model_only = False
    job.checkpoint.load_only = False
    job.debug.seed = t.seed
    job.comm.init_timeout_seconds = 600
    return job
