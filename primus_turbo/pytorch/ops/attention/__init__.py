"""Attention ops: flash-attn compatible API, varlen, and context-parallel (Ulysses + ring)."""

from primus_turbo.pytorch.ops.attention.attention import flash_attn_func, flash_attn_varlen_func

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]
