"""TurboAttention: core attention module for Megatron-Core and TorchTitan.

Layouts (``layout=``):

* ``"sbhd"`` (Megatron core attention): q/k/v [S, B, H, D] -> out [S, B, H * Dv]. Megatron's
  ``packed_seq_params`` (THD, with ``cu_seqlens_q/kv`` and ``max_seqlen_q/kv``) switches to the varlen
  op; q/k/v are then [T, H, D] (or [T, 1, H, D]) and the output [T, H * Dv].
* ``"bshd"`` (flash-attn): [B, S, H, D] -> [B, S, H, Dv].
* ``"bhsd"`` (TorchTitan inner attention, SDPA-like): [B, H, S, D] -> [B, H, S, Dv].

The mask is defined by ``causal`` and ``window_size`` alone (bottom-right aligned, flash-attn): an
``attention_mask`` tensor passed by a framework is NOT applied, so configure ``causal``/``window_size``
to match it (Megatron's causal and sliding-window masks are expressible this way). Context
parallelism: pass ``ulysses_group`` and/or ``ring_group``; inputs are then this rank's sequence shard
(zigzag layout for causal ring, see ``ops.attention.attention_cp``).
"""

from __future__ import annotations

import torch
from torch import nn

from primus_turbo.pytorch.ops.attention import flash_attn_func, flash_attn_usp_func, flash_attn_varlen_func

_LAYOUTS = ("sbhd", "bshd", "bhsd")


class TurboAttention(nn.Module):
    def __init__(
        self,
        causal: bool = True,
        softmax_scale: float | None = None,
        window_size: tuple[int, int] = (-1, -1),
        layout: str = "bshd",
        ulysses_group=None,
        ring_group=None,
        deterministic: bool = False,
        num_sink_heads: int = 0,
        dropout_p: float = 0.0,
    ):
        super().__init__()
        if layout not in _LAYOUTS:
            raise ValueError(f"TurboAttention: layout must be one of {_LAYOUTS}, got {layout!r}")
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.window_size = tuple(window_size)
        self.layout = layout
        self.ulysses_group = ulysses_group
        self.ring_group = ring_group
        self.deterministic = deterministic
        self.dropout_p = dropout_p
        # gpt-oss style learned per-head sink logits (fp32, zero-initialised)
        self.sink = nn.Parameter(torch.zeros(num_sink_heads, dtype=torch.float32)) if num_sink_heads else None

    def extra_repr(self) -> str:
        return (
            f"causal={self.causal}, window_size={self.window_size}, layout={self.layout}, "
            f"cp={'ulysses ' if self.ulysses_group else ''}{'ring' if self.ring_group else ''}"
        )

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _sink(self):
        """The sink logits in fp32: a whole-model cast (Megatron's Float16Module, ``model.bfloat16()``) casts
        this parameter too, and the kernels take fp32 sinks (the cast is differentiable)."""
        return self.sink.float() if self.sink is not None else None

    def forward(self, query, key, value, attention_mask=None, packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            return self._forward_varlen(query, key, value, packed_seq_params)
        if self.layout == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        elif self.layout == "bhsd":
            q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        else:
            q, k, v = query, key, value
        common = dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
                      deterministic=self.deterministic, sink=self._sink(),
                      dropout_p=self._dropout())  # fmt: skip
        if self.ulysses_group is not None or self.ring_group is not None:
            out = flash_attn_usp_func(q, k, v, ulysses_group=self.ulysses_group, ring_group=self.ring_group,
                                      **common)  # fmt: skip
        else:
            out = flash_attn_func(q, k, v, **common)
        if self.layout == "sbhd":
            out = out.transpose(0, 1)
            return out.reshape(out.shape[0], out.shape[1], -1)
        if self.layout == "bhsd":
            return out.transpose(1, 2)
        return out

    def _forward_varlen(self, query, key, value, params):
        if self.ulysses_group is not None or self.ring_group is not None:
            raise ValueError(
                "TurboAttention: packed sequences (THD) are not supported with context parallelism"
            )
        q, k, v = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        out = flash_attn_varlen_func(
            q, k, v, params.cu_seqlens_q, params.cu_seqlens_kv, int(params.max_seqlen_q),
            int(params.max_seqlen_kv), softmax_scale=self.softmax_scale, causal=self.causal,
            window_size=self.window_size, deterministic=self.deterministic, sink=self._sink(),
            dropout_p=self._dropout(),
        )  # fmt: skip
        return out.reshape(out.shape[0], -1)
