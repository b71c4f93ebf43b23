"""Megatron-Core helpers for the integration tests (import after pytest.importorskip("megatron.core"))."""

import torch


def transformer_config(**extra):
    """A one-layer fp32 CPU TransformerConfig; keyword arguments override."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                  params_dtype=torch.float32, add_bias_linear=False, gradient_accumulation_fusion=False,
                  attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False)  # fmt: skip
    kwargs.update(extra)
    return TransformerConfig(**kwargs)
