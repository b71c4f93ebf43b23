"""Build a Megatron-Core GPTModel (dense or MoE, MHA/GQA or MLA) from the recipe config and a spec provider.

``build_layer_specs`` mirrors ``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec``
(0.16.1) but takes the ``BackendSpecProvider`` as an argument, so the stock ``LocalSpecProvider`` and
``TurboSpecProvider`` build the same module tree with different leaf classes (parameter names, hence
checkpoints, are unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from omegaconf import DictConfig
from primus_turbo.integrations.common.config import moe_layer_pattern


def build_transformer_config(cfg: DictConfig, params_dtype: torch.dtype, use_grouped_gemm: bool):
    """TransformerConfig (or MLATransformerConfig) for ``cfg.model`` / ``cfg.parallel``."""
    m, p = cfg.model, cfg.parallel
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=m.kv_channels,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        expert_model_parallel_size=p.ep,
        context_parallel_size=p.cp,
        sequence_parallel=p.sequence_parallel,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=not on_gpu,
        init_method_std=m.init_std,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The fused paths below need apex / TE / compiled CUDA helpers; the turbo ops replace them.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        recompute_granularity="full" if cfg.train.activation_recompute else None,
        recompute_method="uniform" if cfg.train.activation_recompute else None,
        recompute_num_layers=1 if cfg.train.activation_recompute else None,
    )
    if m.moe is not None:
        moe = m.moe
        kwargs.update(
            num_moe_experts=moe.num_experts,
            moe_router_topk=moe.topk,
            moe_ffn_hidden_size=moe.ffn_hidden_size,
            moe_shared_expert_intermediate_size=moe.get("shared_expert_ffn_hidden_size"),
            moe_router_num_groups=moe.get("num_groups"),
            moe_router_group_topk=moe.get("group_topk"),
            moe_router_score_function=moe.get("score_function", "softmax"),
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=moe.aux_loss_coeff,
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=moe.get("dispatcher", "alltoall"),
            moe_grouped_gemm=use_grouped_gemm,
            moe_layer_freq=moe_layer_pattern(m),
        )
    if m.mla is not None:
        mla = m.mla
        kwargs.update(
            q_lora_rank=mla.q_lora_rank,
            kv_lora_rank=mla.kv_lora_rank,
            qk_head_dim=mla.qk_head_dim,
            qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
            v_head_dim=mla.v_head_dim,
            rope_type=mla.get("rope_type", "rope"),
            rotary_base=m.rotary_base,
        )
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def _attention_spec(backend, mla: bool) -> ModuleSpec:
    if mla:
        return ModuleSpec(
            module=backend.mla_self_attention(),
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=backend.column_parallel_linear(),
                linear_q_down_proj=backend.column_parallel_linear(),
                linear_q_up_proj=backend.column_parallel_linear(),
                linear_kv_down_proj=backend.column_parallel_linear(),
                linear_kv_up_proj=backend.column_parallel_linear(),
                core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=backend.layer_norm(rms_norm=True, for_qk=True),
                kv_layernorm=backend.layer_norm(rms_norm=True, for_qk=True),
            ),
        )
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_linear(),
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def build_layer_specs(backend, cfg: DictConfig, config: TransformerConfig) -> TransformerBlockSubmodules:
    """Per-layer specs (dense or MoE per ``moe_layer_pattern``) for this pipeline stage, from ``backend``."""
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    attention = _attention_spec(backend, mla=cfg.model.mla is not None)

    def layer(is_moe: bool) -> ModuleSpec:
        mlp = get_mlp_module_spec_for_backend(
            backend=backend,
            num_experts=cfg.model.moe.num_experts if is_moe else None,
            moe_grouped_gemm=bool(config.moe_grouped_gemm) if is_moe else False,
        )
        return ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=norm,
                self_attention=attention,
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=norm,
                mlp=mlp,
                mlp_bda=get_bias_dropout_add,
            ),
        )

    pattern = moe_layer_pattern(cfg.model)
    offset = get_transformer_layer_offset(config)
    local_layers = config.num_layers // config.pipeline_model_parallel_size
    specs = [layer(bool(is_moe)) for is_moe in pattern[offset : offset + local_layers]]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def build_gpt_model(cfg: DictConfig, config: TransformerConfig, backend) -> GPTModel:
    """GPTModel for this rank's pipeline stage (pre/post process from parallel_state)."""
    from megatron.core import parallel_state

    return GPTModel(
        config=config,
        transformer_layer_spec=build_layer_specs(backend, cfg, config),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not cfg.model.untie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.model.rotary_base,
    )
