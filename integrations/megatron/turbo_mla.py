"""turbo.mla_qkv: Megatron-Core's MLA query / key / value assembly in two turbo kernels each way.

``MLASelfAttention.get_query_key_value_tensors`` (0.16.1, without RoPE fusion, which Megatron allows for MLA
only with YaRN) splits the up-projected q into [q_nope, q_pe] and kv into [k_nope, v], ropes q_pe and the
shared k_pe, then concatenates: query = cat(q_nope, rope(q_pe)), key = cat(k_nope, rope(k_pe) expanded over
the heads), and copies value contiguous. That is two cats and a copy forward, and the splits' backward is two
more cats (~8 ms per step of the deepseek_moe recipe on one H200, from its profile). Here:

    query      = turbo.ops.apply_rotary_pos_emb(q, freqs, nope_dim=qk_head_dim)   one kernel each way
    key, value = turbo.ops.mla_key_value(kv, rope(k_pe), qk_head_dim)            one kernel each way

The down projections, norms, up projections and the RoPE angles are Megatron's modules and calls, in
Megatron's order. Served: training without packed sequences, inference caches, up-projection recompute or RoPE
fusion, at tensor-parallel size 1 (the TP gathers stay Megatron's), a power-of-two rotary dim; anything else
runs Megatron's method unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size
from primus_turbo.integrations.megatron import turbo_ops


class TurboMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose query / key / value come from turbo kernels (see the module doc)."""

    def _turbo_serves(self, hidden_states, key_value_states, packed_seq_params, inference_context) -> bool:
        cfg = self.config
        pos = cfg.qk_pos_emb_head_dim
        return (
            key_value_states is None and packed_seq_params is None and inference_context is None
            and hidden_states.dim() == 3 and not cfg.apply_rope_fusion and not self.recompute_up_proj
            and not self.cache_mla_latents and get_pg_size(self.tp_group) == 1
            and pos >= 2 and pos & (pos - 1) == 0
        )  # fmt: skip

    def get_query_key_value_tensors(
        self, hidden_states, key_value_states=None, position_ids=None, packed_seq_params=None,
        inference_context=None, *, inference_params=None,
    ):  # fmt: skip
        if inference_params is not None or not self._turbo_serves(
            hidden_states, key_value_states, packed_seq_params, inference_context
        ):
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params, inference_context,
                inference_params=inference_params,
            )  # fmt: skip
        cfg = self.config
        rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, cfg, None)
        if cfg.rope_type == "rope":
            freqs, mscale = self.rotary_pos_emb(rotary_seq_len, packed_seq=False), 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(rotary_seq_len, packed_seq=False)
        # down projections and norms, as Megatron (TP 1: no gather, no scatter)
        if cfg.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
        else:
            q_compressed = hidden_states
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_compressed, k_pe = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if cfg.q_lora_rank is not None:
            q_compressed = self.q_layernorm(q_compressed)
        kv_compressed = self.kv_layernorm(kv_compressed)
        # up projections: q [S, B, H, qk + pos], kv [S, B, H, qk + v]
        q, _ = (self.linear_q_up_proj if cfg.q_lora_rank is not None else self.linear_q_proj)(q_compressed)
        heads = self.num_attention_heads_per_partition
        q = q.view(*q.shape[:-1], heads, self.q_head_dim)
        kv, _ = self.linear_kv_up_proj(kv_compressed)
        kv = kv.view(*kv.shape[:-1], heads, cfg.qk_head_dim + cfg.v_head_dim)
        freqs = freqs[: q.shape[0]]
        rope = turbo_ops.get("ops.apply_rotary_pos_emb")
        query = rope(q, freqs, interleaved_input=True, mscale=mscale, nope_dim=cfg.qk_head_dim)
        k_pe = rope(k_pe.unsqueeze(-2), freqs, interleaved_input=True, mscale=mscale)
        key, value = turbo_ops.get("ops.mla_key_value")(kv, k_pe, cfg.qk_head_dim)
        return query, key, value, q_compressed, kv_compressed
