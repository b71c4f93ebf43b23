"""GroupedLinear: the experts of an MoE layer as one grouped GEMM.

Parameter layout (and why)
--------------------------
The module holds ONE stacked parameter ``weight`` [G, out_features, in_features] (and ``bias``
[G, out_features]). The grouped kernels read it directly, so there is no per-step ``torch.stack``
copy of G weights (a full read+write of every expert weight per forward, and again for the
gradient), and the optimizer sees one tensor. Per-expert ``nn.Parameter`` views of one storage
were rejected: optimizers, FSDP and ``zero_grad(set_to_none)`` treat them as independent tensors
and silently break the aliasing.

Checkpoint compatibility is handled at the state-dict boundary, selected by ``state_dict_layout``:

* ``"per_expert"`` (default): keys ``weight0 .. weight{G-1}`` ([out, in] each) and ``bias{i}``:
  exactly Megatron-Core ``TEGroupedMLP``'s ``linear_fc1`` / ``linear_fc2`` (TE GroupedLinear)
  names and shapes, so those checkpoints load unchanged (TE's ``_extra_state``, its FP8 metadata, is
  dropped on load: this module keeps none), and what it saves has the same weights and biases (no
  ``_extra_state``: load it into TE with ``strict=False``).
* ``"stacked"``: keys ``weight`` [G, out, in] / ``bias`` [G, out]: TorchTitan ``GroupedExperts``
  stores ``w1``/``w3`` as [G, hidden, dim] and ``w2`` as [G, dim, hidden], i.e. this very layout
  (out, in) per expert; the TorchTitan adapter renames ``w1 -> <fc1>.weight`` with no transpose.
  ``from_stacked`` / ``to_stacked`` copy to and from such tensors explicitly.

Both layouts load either form of key, so a checkpoint written in one layout restores in the other.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm
from primus_turbo.pytorch.ops.grouped_gemm_fp8 import grouped_gemm_fp8

__all__ = ["GroupedLinear"]

_LAYOUTS = ("per_expert", "stacked")


class GroupedLinear(nn.Module):
    """``y[rows_g] = x[rows_g] @ weight[g].T (+ bias[g])`` for rows grouped by ``group_lens``.

    forward(x [sum(M_i), in_features], group_lens [G] int64 on x's device) -> [sum(M_i), out].
    Sync-free (CUDA-graph capturable) on GPU backends; with ``fp8_config`` the GEMMs run in FP8
    (``turbo.ops.grouped_gemm_fp8``), otherwise in x's dtype (``turbo.ops.grouped_gemm``).
    """

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device=None,
        dtype=None,
        fp8_config: Float8QuantConfig | None = None,
        state_dict_layout: str = "per_expert",
    ):
        super().__init__()
        for name, v in (
            ("num_groups", num_groups),
            ("in_features", in_features),
            ("out_features", out_features),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GroupedLinear: {name} must be a positive int, got {v!r}")
        if fp8_config is not None and not isinstance(fp8_config, Float8QuantConfig):
            raise TypeError(
                f"GroupedLinear: fp8_config must be a Float8QuantConfig or None, got {fp8_config!r}"
            )
        if state_dict_layout not in _LAYOUTS:
            raise ValueError(
                f"GroupedLinear: state_dict_layout must be one of {_LAYOUTS}, got {state_dict_layout!r}"
            )
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.fp8_config = fp8_config
        self.state_dict_layout = state_dict_layout
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **kw)) if bias else None
        self.reset_parameters()
        self._register_state_dict_hook(GroupedLinear._to_layout)
        self._register_load_state_dict_pre_hook(self._from_any_layout)

    def reset_parameters(self) -> None:
        """Per expert, what nn.Linear does (kaiming-uniform weight, uniform(+-1/sqrt(in)) bias)."""
        for g in range(self.num_groups):
            nn.init.kaiming_uniform_(self.weight.data[g], a=math.sqrt(5))
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, group_lens: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: x must be [tokens, {self.in_features}], got shape {tuple(x.shape)}"
            )
        w = self.weight if x.dtype == self.weight.dtype else self.weight.to(x.dtype)
        if self.fp8_config is not None:
            y = grouped_gemm_fp8(x, w, group_lens, trans_b=True, config=self.fp8_config)
        else:
            y = grouped_gemm(x, w, group_lens, trans_b=True)
        if self.bias is not None:
            # expert id of every row, on the device (searchsorted: no host sync); rows past the last group
            # (an upper-bound buffer) get id G: a zero bias row, so their output stays zero
            ends = torch.cumsum(group_lens, 0)
            rows = torch.arange(x.shape[0], device=x.device)
            expert = torch.searchsorted(ends, rows, right=True)  # in [0, G]
            y = y + torch.nn.functional.pad(self.bias.to(y.dtype), (0, 0, 0, 1))[expert]
        return y

    # -- stacked <-> per-expert -----------------------------------------------------------------
    @torch.no_grad()
    def from_stacked(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy a stacked [G, out, in] weight (TorchTitan w1/w2/w3 layout) and optional [G, out] bias."""
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"from_stacked: weight shape {tuple(weight.shape)} != {tuple(self.weight.shape)}"
            )
        self.weight.copy_(weight)
        if bias is not None:
            if self.bias is None or tuple(bias.shape) != tuple(self.bias.shape):
                raise ValueError(f"from_stacked: bias {tuple(bias.shape)} does not match this module's bias")
            self.bias.copy_(bias)

    @torch.no_grad()
    def to_stacked(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Detached (weight [G, out, in], bias [G, out] or None), sharing storage with the module."""
        return self.weight.detach(), None if self.bias is None else self.bias.detach()

    def expert_weight(self, g: int) -> torch.Tensor:
        """Expert g's [out, in] weight as a view (Megatron's ``weight{g}``)."""
        return self.weight[g]

    @staticmethod
    def _to_layout(module, state_dict, prefix, local_metadata):
        if module.state_dict_layout != "per_expert":
            return state_dict
        for name in ("weight", "bias"):
            key = prefix + name
            if key in state_dict:
                stacked = state_dict.pop(key)
                for g in range(module.num_groups):
                    state_dict[f"{key}{g}"] = stacked[g]
        return state_dict

    def _from_any_layout(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected, errors):
        state_dict.pop(prefix + "_extra_state", None)  # a TE GroupedLinear's FP8 metadata: nothing to load
        for name in ("weight", "bias"):
            per_expert = [f"{prefix}{name}{g}" for g in range(self.num_groups)]
            if all(k in state_dict for k in per_expert):
                state_dict[prefix + name] = torch.stack([state_dict.pop(k) for k in per_expert])

    def extra_repr(self) -> str:
        fp8 = "" if self.fp8_config is None else f", fp8={self.fp8_config.granularity.name}"
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}{fp8}"
        )
