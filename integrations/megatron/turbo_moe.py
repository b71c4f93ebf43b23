"""Sync-free MoE path for one expert-parallel rank (Megatron-Core 0.16.1): dispatcher and experts.

With ep = 1 and tp = 1 Megatron's ``MoEAlltoAllTokenDispatcher`` has nothing to communicate but still
(1) copies the per-expert token counts to the host and waits on that copy: one event synchronize per MoE
layer per micro-batch, which drains the GPU queue (the GPU then idles while the host issues the next
kernels); and (2) re-sorts the permuted tokens by an identity order (``sort_chunks_by_idxs``: a split into
E chunks and a cat of them, for the tokens and the probs, and again in combine): full copies of every
routed token, forward and backward, and E views each way on the host. ``TEGroupedMLP`` then reads the
counts with ``.tolist()`` and runs the gated activation as five eager ops (chunk, silu, mul, mul by the
probs, cast).

- ``TurboLocalTokenDispatcher``: turbo ``token_permute`` by the routing map (the output size is the static
  T * topk of dropless routing; the counts stay on the device), no re-sort, ``token_unpermute`` to combine
  (the probs are applied inside the experts, as in Megatron's alltoall path).
- ``TurboGroupedMLP``: ``TEGroupedMLP`` that hands the counts to the turbo grouped linears as they come (a
  device tensor stays on the device: the grouped GEMMs schedule on the GPU) and runs SwiGLU x probs as one
  ``turbo.ops.swiglu_with_probs`` kernel each way. Configurations it does not fuse (non-gated or non-SiLU
  activations, activation recompute or offload, clamped GLU) run the stock forward.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from primus_turbo.integrations.megatron import turbo_ops

__all__ = ["TurboGroupedMLP", "TurboLocalTokenDispatcher", "local_dispatch_unsupported"]

_LOG = logging.getLogger(__name__)
_REPORTED: set[str] = set()  # unfused reasons already logged (once per run, not once per layer)


def local_dispatch_unsupported(config) -> str | None:
    """Why ``TurboLocalTokenDispatcher`` cannot serve this MoE config, or None."""
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        return "token dropping (moe_expert_capacity_factor / pad to capacity)"
    if config.moe_router_padding_for_quantization:
        return "moe_router_padding_for_quantization"
    if config.moe_shared_expert_overlap:
        return "moe_shared_expert_overlap"
    if getattr(config, "moe_latent_size", None):
        return "moe_latent_size"
    return None


class TurboLocalTokenDispatcher(MoETokenDispatcher):
    """``MoEAlltoAllTokenDispatcher`` for ep = 1 and tp = 1: local permute/unpermute, no host sync."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.ep_size > 1 or self.tp_size > 1:
            raise ValueError(
                f"TurboLocalTokenDispatcher: needs expert-parallel size 1 and expert tensor-parallel size 1, "
                f"got ep={self.ep_size}, tp={self.tp_size} (use TurboTokenDispatcher)"
            )
        reason = local_dispatch_unsupported(config)
        if reason is not None:
            raise ValueError(
                f"TurboLocalTokenDispatcher: {reason} is not supported; set turbo.dispatch=false"
            )
        self.topk = config.moe_router_topk
        self.num_experts = config.num_moe_experts
        self._permute = turbo_ops.get("ops.moe.permute.token_permute")
        self._unpermute = turbo_ops.get("ops.moe.permute.token_unpermute")
        self.hidden_shape = None
        self.row_id_map = None
        self.tokens_per_expert = None

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
        # dropless top-k: exactly T * topk routes (an upper bound if a route is ever masked: rows past the
        # last expert group belong to no group, and unpermute never reads them)
        permuted, permuted_probs, self.row_id_map, counts = self._permute(
            tokens, routing_map, probs, num_out_tokens=tokens.shape[0] * self.topk
        )
        self.tokens_per_expert = counts.to(torch.int64)
        return permuted, permuted_probs

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        counts, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, counts, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        out = self._unpermute(hidden_states, self.row_id_map)
        self.row_id_map = None
        return out

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


class TurboGroupedMLP(TEGroupedMLP):
    """``TEGroupedMLP`` over the turbo grouped linears without the ``.tolist()`` of the token counts and with
    the fused SwiGLU x probs (see the module docstring for the configurations that keep the stock forward)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_reason = reason = self._unfused_reason()
        if reason is not None and reason not in _REPORTED:
            _REPORTED.add(reason)
            _LOG.warning("TurboGroupedMLP: %s: the experts' activation runs Megatron's eager ops", reason)
        self._swiglu_with_probs = turbo_ops.get("ops.swiglu_with_probs")

    def _unfused_reason(self) -> str | None:
        c = self.config
        checks = (
            (not c.gated_linear_unit or self.activation_func is not F.silu, "activation is not SwiGLU"),
            (self.activation_recompute, "MoE activation recompute"),
            (getattr(self, "offload_expert_fc1", False) or getattr(self, "offload_moe_act", False),
             "activation offloading"),
            (c.activation_func_clamp_value is not None or c.glu_linear_offset != 0.0, "clamped/offset GLU"),
            (c.moe_apply_probs_on_input, "moe_apply_probs_on_input"),
            (c.fp8 or c.fp4, "Transformer Engine FP8/FP4 padding"),
            (c.use_te_activation_func or c.add_bias_linear, "TE activation or expert bias"),
        )  # fmt: skip
        return next((why for bad, why in checks if bad), None)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.fused_reason is not None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        fc1_output, _ = self.linear_fc1(permuted_local_hidden_states, tokens_per_expert)
        activated = self._swiglu_with_probs(fc1_output, permuted_probs)
        output, _ = self.linear_fc2(activated, tokens_per_expert)
        return output, None
