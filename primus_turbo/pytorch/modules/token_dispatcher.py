"""TokenDispatcher: route tokens to local experts (EP all-to-all + permute) and back.

    dispatcher = TokenDispatcher(num_experts=64, topk=6, ep_group=group, pad_multiple=16)
    expert_in, tokens_per_expert, expert_probs = dispatcher.token_dispatch(hidden, probs, indices)
    expert_out = grouped_mlp(expert_in, tokens_per_expert)          # rows grouped by local expert
    out = dispatcher.token_combine(expert_out)                       # same shape as hidden

``probs`` are applied in token_combine (weighted unpermute) unless ``probs_in_experts=True``, in
which case the caller multiplies them itself (e.g. with swiglu_with_probs on ``expert_probs``) and
combine is a plain sum. Used by the Megatron-Core and TorchTitan integrations. One dispatch's
state lives on the module until its combine (like Megatron's dispatchers): do not interleave two
dispatches on one instance.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from primus_turbo.pytorch.ops.moe.dispatch import moe_combine, moe_dispatch
from primus_turbo.pytorch.ops.moe.permute import token_permute, token_unpermute

__all__ = ["TokenDispatcher"]


class TokenDispatcher(nn.Module):
    def __init__(
        self,
        num_experts: int,
        topk: int,
        ep_group: dist.ProcessGroup | None = None,
        *,
        pad_multiple: int = 0,
        probs_in_experts: bool = False,
    ):
        super().__init__()
        self.ep_size = 1
        if ep_group is not None and dist.is_initialized():
            try:
                self.ep_size = dist.get_world_size(ep_group)
            except (AttributeError, TypeError) as err:  # not a group (str, int, list, ...)
                raise TypeError(
                    "TokenDispatcher: ep_group must be a ProcessGroup or None (no EP), "
                    f"got {type(ep_group).__name__}"
                ) from err
            if self.ep_size < 1:  # -1: dist.new_group's GroupMember.NON_GROUP_MEMBER, on the ranks left out
                raise ValueError(
                    f"TokenDispatcher: ep_group: this rank (global rank {dist.get_rank()}) is not a member "
                    "of the group"
                )
        if num_experts < 1 or num_experts % self.ep_size != 0:
            raise ValueError(
                f"TokenDispatcher: num_experts={num_experts} must be a multiple of the EP size {self.ep_size}"
            )
        if not 1 <= topk <= num_experts:
            raise ValueError(f"TokenDispatcher: topk={topk} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.topk, self.ep_group = num_experts, topk, ep_group
        self.num_local_experts = num_experts // self.ep_size
        self.pad_multiple, self.probs_in_experts = pad_multiple, probs_in_experts
        self._state: dict | None = None

    def token_dispatch(self, hidden: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor):
        """hidden [..., H], probs/indices [T, topk] -> (expert_input [N, H], tokens_per_expert
        [num_local_experts] int32, expert_probs [N] fp32)."""
        shape = hidden.shape
        x = hidden.reshape(-1, shape[-1])
        if tuple(indices.shape) != (x.shape[0], self.topk) or tuple(probs.shape) != tuple(indices.shape):
            raise ValueError(
                f"TokenDispatcher.token_dispatch: indices {tuple(indices.shape)} and probs "
                f"{tuple(probs.shape)} "
                f"must be [num_tokens={x.shape[0]}, topk={self.topk}]"
            )
        handle = None
        if self.ep_size > 1:
            x, indices, probs, _, handle = moe_dispatch(x, indices, probs, self.num_experts, self.ep_group)
        # Local (token, expert) routes: exact when the dispatch backend knows it on the host (NCCL learns
        # it with the split sizes it syncs on anyway), else an upper bound without a host sync (TURBO):
        # each received row has at most min(topk, local experts) local routes.
        num_out = x.shape[0] * min(self.topk, self.num_local_experts)
        exact = handle is not None and handle.num_recv_routes is not None
        if exact:
            num_out = handle.num_recv_routes
        # With an upper bound (after a TURBO dispatch, or without EP where a -1 index drops a route), the rows
        # after the last group are zeroed, since FP8 experts quantize the whole buffer (a tensorwise amax or
        # column scales would read garbage).
        expert_in, expert_probs, row_id_map, tokens_per_expert = token_permute(
            x,
            indices,
            probs.float(),
            num_out,
            pad_multiple=self.pad_multiple,
            num_experts=self.num_local_experts,
            zero_fill=not exact,
        )
        self._state = {"shape": shape, "handle": handle, "row_id_map": row_id_map, "probs": probs}
        return expert_in, tokens_per_expert, expert_probs

    def token_combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        if self._state is None:
            raise RuntimeError("TokenDispatcher.token_combine called without a preceding token_dispatch")
        state, self._state = self._state, None
        merging = None if self.probs_in_experts else state["probs"].float()
        y = token_unpermute(expert_output, state["row_id_map"], merging)
        if merging is not None:
            y = y.to(expert_output.dtype)
        if state["handle"] is not None:
            y = moe_combine(y, self.ep_group, state["handle"])
        return y.reshape(state["shape"])
