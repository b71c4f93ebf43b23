"""Attention ops: flash-attn compatible API, varlen, and context parallel (Ulysses + ring)."""

from primus_turbo.pytorch.ops.attention.attention import flash_attn_func, flash_attn_varlen_func
from primus_turbo.pytorch.ops.attention.attention_cp import (
    flash_attn_usp_func,
    gather_sequence_for_cp,
    split_sequence_for_cp,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_usp_func",
    "split_sequence_for_cp",
    "gather_sequence_for_cp",
]
