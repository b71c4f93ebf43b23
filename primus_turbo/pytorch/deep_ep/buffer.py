"""A DeepEP-compatible ``Buffer`` (normal-mode intranode API) over the turbo EP backends.

Megatron-Core's flex dispatcher (megatron/core/transformer/moe/fused_a2a.py, 0.16.1) calls exactly:
``Buffer(group, num_nvl_bytes, num_rdma_bytes)``, ``Buffer.get_dispatch_config(n)`` /
``get_combine_config(n)`` with ``.get_nvl_buffer_size_hint`` / ``.get_rdma_buffer_size_hint``,
``get_dispatch_layout``, ``dispatch`` (fresh and cached with ``handle=``), ``combine`` (optionally
reducing ``topk_weights``), ``Buffer.set_num_sms`` and ``deep_ep.utils.EventOverlap/EventHandle``.
This class serves those calls with ``moe_dispatch_combine``'s backend choice (TURBO when it can run,
else NCCL). Install it under the name ``deep_ep`` with ``install_as_deep_ep()`` before importing
Megatron's fused_a2a. Not supported: internode (RDMA) and low-latency mode.

Work runs on the current stream; ``async_finish`` returns an already-recorded event, so callers'
``current_stream_wait()`` is correct (no extra overlap).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.deep_ep.utils import EventHandle, EventOverlap
from primus_turbo.pytorch.kernels.moe.dispatch_impl import (
    DispatchHandle,
    MoEDispatchCombineDispatcher,
    dispatch_layout,
    validate_dispatch,
    validate_routing,
)

__all__ = ["Buffer", "Config"]


class Config:
    """DeepEP's performance config; only the buffer-size hints are meaningful here."""

    def __init__(self, num_sms: int = 20, *tuning: int):
        self.num_sms = num_sms
        self.tuning = tuning

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0  # buffers are allocated on demand by the backend

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def _event(async_finish: bool) -> EventOverlap:
    return EventOverlap(EventHandle() if async_finish else None)


class Buffer:
    num_sms: int = 20

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 1, **_unused):  # fmt: skip
        if low_latency_mode:
            raise ValueError(
                "primus_turbo deep_ep.Buffer: low_latency_mode is not supported (normal mode only)"
            )
        if num_rdma_bytes:
            raise ValueError("primus_turbo deep_ep.Buffer: internode (num_rdma_bytes > 0) is not supported")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        if new_num_sms < 1:
            raise ValueError(f"Buffer.set_num_sms: {new_num_sms} must be >= 1")
        Buffer.num_sms = new_num_sms
        from primus_turbo.pytorch.kernels.moe import ep_turbo

        ep_turbo.NUM_PROGRAMS = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms)

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):  # fmt: skip
        """(num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event)."""
        validate_routing(topk_idx, num_experts, self.group_size, "Buffer.get_dispatch_layout")
        per_rank, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, self.group_size)
        return per_rank, None, per_expert, in_rank, _event(async_finish)

    def dispatch(self, x, handle: DispatchHandle | None = None, num_tokens_per_rank=None,
                 num_tokens_per_rdma_rank=None, is_token_in_rank=None, num_tokens_per_expert=None,
                 topk_idx=None, topk_weights=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):  # fmt: skip
        """(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event).

        With ``handle`` (cached layout, the backward of combine) only recv_x is returned (others None).
        """
        x_scale = None
        if isinstance(x, (tuple, list)):
            x, x_scale = x
        if handle is not None:
            from primus_turbo.pytorch.ops.moe.dispatch import _dispatch_cached

            if x_scale is not None:  # the cached layouts move one row tensor; scales would need a second one
                raise ValueError(
                    "Buffer.dispatch: a cached dispatch (handle=...) takes a bf16/fp16/fp32 x; for FP8 "
                    "(x, x_scale) dispatch with topk_idx and the layout instead"
                )
            return _dispatch_cached(x, handle), None, None, None, None, _event(async_finish)
        if topk_idx is None:
            raise ValueError("Buffer.dispatch: topk_idx is required without a handle")
        num_experts = int(num_tokens_per_expert.numel()) if num_tokens_per_expert is not None else None
        if num_experts is None:
            raise ValueError("Buffer.dispatch: num_tokens_per_expert (from get_dispatch_layout) is required")
        validate_dispatch(x, x_scale, topk_idx, topk_weights, num_experts, self.group, "Buffer.dispatch")
        if is_token_in_rank is not None and tuple(is_token_in_rank.shape) != (x.shape[0], self.group_size):
            raise ValueError(
                f"Buffer.dispatch: is_token_in_rank must be [num_tokens={x.shape[0]}, "
                f"num_ranks={self.group_size}], got {tuple(is_token_in_rank.shape)}"
            )
        result = MoEDispatchCombineDispatcher.dispatch(
            kind="dispatch", x=x.contiguous(), x_scale=x_scale, indices=topk_idx.contiguous(),
            probs=topk_weights.float().contiguous() if topk_weights is not None else None,
            num_experts=num_experts, group=self.group, is_token_in_rank=is_token_in_rank,
        )  # fmt: skip
        recv_x, recv_scale, recv_idx, recv_w, tokens_per_expert, new_handle = result
        counts = tokens_per_expert.cpu().tolist()  # DeepEP returns a host list (it syncs as well)
        if expert_alignment > 1:
            counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        recv = (recv_x, recv_scale) if x_scale is not None else recv_x
        return recv, recv_idx, recv_w, counts, new_handle, _event(async_finish)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):  # fmt: skip
        """(combined_x, combined_topk_weights or None, event)."""
        if bias is not None:
            raise ValueError("Buffer.combine: bias is not supported")
        out, weights = MoEDispatchCombineDispatcher.dispatch(
            kind="combine", x=x.contiguous(), handle=handle, topk_weights=topk_weights
        )
        return out, weights, _event(async_finish)
