"""DEEP_EP backend: the external DeepEP package (NVIDIA), used when it imports.

One ``deep_ep.Buffer`` per (group, size), grown on demand, as Megatron's fused_a2a does.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.kernels.moe.dispatch_impl import DispatchHandle

_buffers: dict = {}


def _buffer(group, hidden_bytes: int):
    import deep_ep

    n = group.size()
    configs = (deep_ep.Buffer.get_dispatch_config(n), deep_ep.Buffer.get_combine_config(n))
    nvl = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, n) for cfg in configs)
    buf = _buffers.get(id(group))
    if buf is None or buf.num_nvl_bytes < nvl:
        buf = deep_ep.Buffer(group, nvl, 0)
        _buffers[id(group)] = buf
    return buf


def deepep_dispatch(*, x, x_scale, indices, probs, num_experts, group, **_):
    buf = _buffer(group, x.shape[1] * max(x.element_size(), 2))
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(indices, num_experts)
    recv, recv_idx, recv_probs, counts, handle, _ = buf.dispatch(
        (x, x_scale) if x_scale is not None else x, topk_idx=indices, topk_weights=probs,
        num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
    )  # fmt: skip
    recv_x, recv_scale = recv if isinstance(recv, tuple) else (recv, None)
    tokens_per_expert = torch.tensor(counts, dtype=torch.int32, device=x.device)
    wrapped = DispatchHandle(
        BackendType.DEEP_EP, group, x.shape[0], num_experts, x.shape[1], in_rank, num_recv=recv_x.shape[0],
        extra={"deep_ep_handle": handle, "buffer": buf},
    )  # fmt: skip
    return recv_x, recv_scale, recv_idx, recv_probs, tokens_per_expert, wrapped


def deepep_combine(*, x, handle, topk_weights=None, **_):
    out, weights, _ = handle.extra["buffer"].combine(
        x, handle.extra["deep_ep_handle"], topk_weights=topk_weights
    )
    return out, weights


def deepep_dispatch_cached(x, handle):
    recv_x, *_ = handle.extra["buffer"].dispatch(x, handle=handle.extra["deep_ep_handle"])
    return recv_x
