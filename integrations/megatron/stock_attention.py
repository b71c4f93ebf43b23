"""Stock-PyTorch core attention for MLA without Transformer Engine (gap fix ``fix.mla_core_attention``).

MLASelfAttention (Megatron-Core 0.16.1) builds its core attention with ``k_channels=qk_head_dim +
qk_pos_emb_head_dim`` and ``v_channels=v_head_dim`` (192 / 128 for DeepSeek-V2/V3). Only TE's
DotProductAttention accepts those; the local one has no such arguments and sizes its output as
``kv_channels * heads``, so the stock MLA spec cannot be built without TE. ``MLADotProductAttention`` is
Megatron's DotProductAttention that accepts them and computes with ``torch.nn.functional
.scaled_dot_product_attention``. No turbo op is used here: it is the stock side of turbo on/off comparisons.
"""

from __future__ import annotations

import contextlib
import math

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

# Flash needs equal q/k/v head dims (MLA has 192 vs 128), so MLA lands on memory-efficient attention; math
# is the fallback for shapes/devices the fused kernels refuse (and the CPU path). cuDNN is left out on
# purpose: its d_qk != d_v support depends on the cuDNN build, and this path must just work.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class MLADotProductAttention(DotProductAttention):
    """DotProductAttention with separate q/k and v head dims, over SDPA.

    q [sq, b, hq, k_channels], k [sk, b, hk, k_channels], v [sk, b, hk, v_channels] -> [sq, b, hq*v_channels]
    (hq, hk per tensor-parallel rank; hk divides hq, kv heads are repeated for GQA). Causal masks are SDPA's
    ``is_causal`` (sq == sk in training); an explicit ``attention_mask`` follows Megatron's convention
    (bool, True = masked out). Only the vanilla softmax without sliding windows is supported.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None):  # fmt: skip
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)  # fmt: skip
        if config.softmax_type != "vanilla":
            raise ValueError(f"MLADotProductAttention: softmax_type={config.softmax_type!r}; only 'vanilla'")
        if config.window_size is not None:
            raise ValueError(f"MLADotProductAttention: window_size={config.window_size}; sliding windows are "
                             "not supported")  # fmt: skip
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        tp = self.pg_collection.tp.size()
        self.hidden_size_per_partition = divide(self.v_channels * config.num_attention_heads, tp)
        self.hidden_size_per_attention_head = self.v_channels
        # The parent divides the scale by layer_number under apply_query_key_layer_scaling and multiplies
        # it back inside its softmax; SDPA applies the scale once, so keep the undivided value.
        self.softmax_scale = 1.0 / math.sqrt(self.k_channels) if softmax_scale is None else softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("MLADotProductAttention: packed sequences and attention_bias are not supported")
        sq, b, hq, _ = query.shape
        repeats = hq // key.shape[2]
        if repeats > 1:
            key = key.repeat_interleave(repeats, dim=2)
            value = value.repeat_interleave(repeats, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, h, s, d]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask = None if attention_mask is None else ~attention_mask  # SDPA: True = attend
        causal = mask is None and mask_type == AttnMaskType.causal and sq > 1  # sq=1 (decode): no mask
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # Megatron draws attention dropout from the tensor-parallel RNG stream unless sequence-parallel.
        forked = dropout_p > 0 and not self.config.sequence_parallel
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext()
        with sdpa_kernel(_SDPA_BACKENDS), rng:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale
            )
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
