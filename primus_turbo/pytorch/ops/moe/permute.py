"""Token permutation for MoE: group token copies by expert, and the inverse.

    permuted, permuted_probs, row_id_map, tokens_per_expert = token_permute(tokens, indices, probs,
                                                                           num_experts=E)
    out = token_unpermute(expert_out, row_id_map, merging_probs=probs)    # [T, H]

Routing is either a bool ``routing_map`` [T, E] (Megatron) or int ``indices`` [T, K] (-1 = no route,
e.g. an expert on another EP rank). Rows of the permuted buffer are grouped by expert, tokens in
order within an expert; ``tokens_per_expert`` (a device tensor, int32) gives each group's size.

Sizes and host syncs: with indices, the output has T * K rows (an upper bound when some indices are
-1: rows after the last expert group are unspecified, or zeros with ``zero_fill=True``); with a
routing map, pass ``num_out_tokens`` (the routed count), or the op reads it from the device once (a
host sync). ``pad_multiple`` rounds every expert group up to a multiple (16 or 128 for FP8 grouped
GEMM) with zero rows; ``capacity`` keeps at most that many tokens per expert (later tokens are
dropped) and pads every group to exactly ``capacity`` rows.
"""

from __future__ import annotations

import numbers

import torch

from primus_turbo.pytorch.core.utils import debug_checks_enabled, triton_can_run_on, zero_rows_from
from primus_turbo.pytorch.kernels.moe.permute_impl import (
    build_row_id_map,
    convertible,
    moe_permute_fp8_rowwise,
    moe_permute_fwd,
    moe_unpermute_bwd_probs,
    moe_unpermute_fwd,
    zero_rows_outside_map,
)

__all__ = ["token_permute", "token_unpermute", "token_permute_fp8"]


def _validate(tokens, routing, probs, num_experts, num_out_tokens, pad_multiple, capacity, name):
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ValueError(f"{name}: tokens must be a [num_tokens, hidden] tensor")
    if not isinstance(routing, torch.Tensor) or routing.dim() != 2 or routing.shape[0] != tokens.shape[0]:
        raise ValueError(
            f"{name}: routing must be a routing_map [T, E] (bool) or indices [T, K] (int) with "
            f"T = {tokens.shape[0]}, got {getattr(routing, 'shape', type(routing))}"
        )
    if routing.device != tokens.device:
        raise ValueError(f"{name}: routing on {routing.device}, tokens on {tokens.device}")
    if routing.dtype == torch.bool:
        if num_experts is not None and num_experts != routing.shape[1]:
            raise ValueError(
                f"{name}: num_experts={num_experts} but routing_map has {routing.shape[1]} columns"
            )
        num_experts = routing.shape[1]
    elif routing.dtype in (torch.int32, torch.int64):
        if num_experts is None or num_experts < 1:
            raise ValueError(f"{name}: num_experts (>= 1) is required with indices, got {num_experts}")
    else:
        raise TypeError(f"{name}: routing dtype {routing.dtype}; accepted bool (routing map) or int32/int64")
    if probs is not None:
        _check_probs(probs, routing, tokens, name, "probs", "routing")
    for arg, value in (
        ("pad_multiple", pad_multiple),
        ("capacity", capacity),
        ("num_out_tokens", num_out_tokens),
    ):
        # a float size reached the kernels (an interpreter TypeError) or torch.empty (a size error)
        if value is not None and not isinstance(value, (numbers.Integral, torch.SymInt)):
            raise TypeError(f"{name}: {arg}={value!r} must be an int")
    if pad_multiple < 0 or (capacity is not None and capacity < 0):
        raise ValueError(f"{name}: pad_multiple={pad_multiple} and capacity={capacity} must be >= 0")
    if capacity is not None and pad_multiple > 1:
        raise ValueError(
            f"{name}: capacity and pad_multiple are exclusive (capacity already fixes group sizes)"
        )
    if num_out_tokens is not None and num_out_tokens < 0:
        raise ValueError(f"{name}: num_out_tokens={num_out_tokens} must be >= 0")
    if routing.numel() and _host_checks(routing):
        _check_values(routing, num_experts, num_out_tokens if capacity is None else None, name)
    return num_experts


def _check_probs(probs, like, tokens, name, arg, like_name, tokens_name="tokens"):
    """probs are weights laid out like ``like``: same shape, a float dtype, on the tokens' device."""
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) != tuple(like.shape):
        raise ValueError(
            f"{name}: {arg} shape {tuple(getattr(probs, 'shape', ()))} must match {like_name} shape "
            f"{tuple(like.shape)}"
        )
    if not probs.is_floating_point():
        raise TypeError(f"{name}: {arg} dtype {probs.dtype}; accepted a floating-point dtype")
    if probs.device != tokens.device:
        raise ValueError(f"{name}: {arg} on {probs.device}, {tokens_name} on {tokens.device}")


def _check_values(routing, num_experts, num_out_tokens, name):
    if routing.dtype != torch.bool:
        lo, hi = int(routing.min()), int(routing.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"{name}: indices must be in [-1, {num_experts}), got range [{lo}, {hi}]")
        # one token naming an expert twice would get one row for two routes (a group row left unwritten)
        ranked = routing.sort(dim=1).values
        repeated = ((ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)).any(1)
        if bool(repeated.any()):
            row = int(repeated.nonzero()[0, 0])
            raise ValueError(
                f"{name}: token {row} names an expert twice in its indices row {routing[row].tolist()}; "
                "each route needs its own expert (-1 for no route)"
            )
    if num_out_tokens is not None:
        routes = int(routing.sum()) if routing.dtype == torch.bool else int((routing >= 0).sum())
        if num_out_tokens < routes:
            raise ValueError(
                f"{name}: num_out_tokens={num_out_tokens} is below the {routes} routed (token, expert) "
                "pairs; pass their number or an upper bound (with zero_fill=True: rows past the groups are 0)"
            )


def _host_checks(routing: torch.Tensor) -> bool:
    """Value checks read the routing on the host: free on CPU, one sync on CUDA, so there they run only with
    PRIMUS_TURBO_DEBUG_CHECKS=1. Without it, out-of-range indices on CUDA are treated as dropped routes (-1):
    never an out-of-bounds write or a device assert."""
    return not torch.compiler.is_compiling() and (routing.device.type == "cpu" or debug_checks_enabled())


def _check_out_dtype(x: torch.Tensor, out_dtype, name: str, arg: str) -> None:
    """out_dtype: None, x's dtype, or fp32 <-> fp16/bf16."""
    if out_dtype is not None and out_dtype != x.dtype and not convertible(x.dtype, out_dtype):
        raise TypeError(
            f"{name}: out_dtype={out_dtype} with {arg} of {x.dtype}; accepted: None, {x.dtype}, or a "
            "conversion between float32 and float16/bfloat16"
        )


def _zero_by_map(x: torch.Tensor) -> bool:
    """Eager GPU/interpreter path: permute into an uninitialised buffer, then zero only the rows the
    map does not name (``zero_rows_outside_map``) instead of zero-filling the whole buffer first."""
    return not torch.compiler.is_compiling() and triton_can_run_on(x)


def _converted_from(in_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a converting op's input gradient goes back to (None: not converted)."""
    return None if in_dtype == out_dtype else in_dtype


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, probs, row_id_map, num_rows, zero_fill, written, out_dtype=None):
        by_map = zero_fill and written is None and _zero_by_map(tokens)
        full_fill = zero_fill and written is None and not by_map
        out, out_probs = moe_permute_fwd(tokens, row_id_map, probs, num_rows, full_fill, out_dtype)
        if zero_fill and written is not None:
            zero_rows_from(out, out_probs if probs is not None else None, written)
        elif by_map:
            zero_rows_outside_map(out, row_id_map, out_probs if probs is not None else None)
        ctx.save_for_backward(row_id_map)
        ctx.num_tokens = tokens.shape[0]
        ctx.in_dtype = _converted_from(tokens.dtype, out.dtype)
        return out, (out_probs if probs is not None else None)

    @staticmethod
    def backward(ctx, grad_out, grad_probs):
        (row_id_map,) = ctx.saved_tensors
        # the gradients of a converting permute are summed in fp32 and stored in the tokens' dtype
        grad_tokens = moe_unpermute_fwd(grad_out.contiguous(), row_id_map, None, ctx.num_tokens, ctx.in_dtype)
        grad_in_probs = None
        if grad_probs is not None and grad_probs.shape[0] == 0:  # no permuted row: nothing to gather
            grad_in_probs = grad_probs.new_zeros(row_id_map.shape)
        elif grad_probs is not None:
            idx = row_id_map.clamp(min=0).long()
            # a Python 0.0, not a CPU zero-dim tensor: copying that to the GPU is a host sync per call
            grad_in_probs = torch.where(row_id_map >= 0, grad_probs[idx], 0.0)
        return grad_tokens, grad_in_probs, None, None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, row_id_map, probs, num_tokens, out_dtype=None):
        out = moe_unpermute_fwd(y, row_id_map, probs, num_tokens, out_dtype)
        ctx.save_for_backward(y if probs is not None else None, row_id_map, probs)
        ctx.num_rows = y.shape[0]
        ctx.y_dtype = _converted_from(y.dtype, out.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y, row_id_map, probs = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if probs is None:
            by_map = _zero_by_map(grad_out)
            grad_y, _ = moe_permute_fwd(grad_out, row_id_map, None, ctx.num_rows, not by_map, ctx.y_dtype)
            if by_map:
                zero_rows_outside_map(grad_y, row_id_map)
            return grad_y, None, None, None, None
        grad_y, grad_probs = moe_unpermute_bwd_probs(grad_out, y, row_id_map, probs)  # grad_y in y's dtype
        return grad_y, None, grad_probs.to(probs.dtype), None, None


def token_permute(
    tokens: torch.Tensor,
    routing: torch.Tensor,
    probs: torch.Tensor | None = None,
    num_out_tokens: int | None = None,
    pad_multiple: int = 0,
    *,
    num_experts: int | None = None,
    capacity: int | None = None,
    zero_fill: bool = False,
    out_dtype: torch.dtype | None = None,
):
    """Permute tokens (and probs) into expert-grouped order.

    Args:
        tokens: [T, H].
        routing: bool routing map [T, E] or int indices [T, K] (-1 = no route; a token names each expert at
            most once, checked on CPU and with PRIMUS_TURBO_DEBUG_CHECKS=1).
        probs: laid out like ``routing`` ([T, E] dense or [T, K]); carried to the permuted rows.
        num_out_tokens: number of routed (token, expert) pairs, or an upper bound (then see zero_fill);
            avoids a host sync for routing maps. A smaller value raises on CPU and with
            PRIMUS_TURBO_DEBUG_CHECKS=1 (on CUDA without it, the routes past it are dropped and
            tokens_per_expert still counts them).
        pad_multiple: pad every expert group to a multiple of this (zero rows), e.g. 16 / 128 for FP8;
            tokens_per_expert then counts the padded group sizes.
        num_experts: required with indices.
        capacity: per-expert capacity (drop-and-pad mode): output is exactly E * capacity rows, expert e's
            group is rows [e * capacity, (e + 1) * capacity) (kept tokens first, then zero rows), and
            tokens_per_expert counts the kept tokens (min(routes, capacity)), not the group size: a grouped
            GEMM over this buffer takes group_lens = capacity for every expert.
        zero_fill: rows after the last expert group (an upper-bound ``num_out_tokens``) are zeros
            (and their probs 0), so a grouped GEMM may cover them, e.g. as part of the last group.
        out_dtype: dtype of the permuted rows (default: the tokens'); fp32 tokens may be permuted straight
            into fp16/bf16 rows and back (round to nearest even), e.g. an fp32 residual stream into the
            experts' bf16 inputs. The tokens' gradient is summed in fp32 and returned in their dtype.

    Returns:
        (permuted_tokens [N, H], permuted_probs [N] or None, row_id_map [T, K or E] int32,
        tokens_per_expert [E] int32 device tensor).
    """
    num_experts = _validate(
        tokens, routing, probs, num_experts, num_out_tokens, pad_multiple, capacity, "token_permute"
    )
    _check_out_dtype(tokens, out_dtype, "token_permute", "tokens")
    tokens = tokens.contiguous()
    row_id_map, tokens_per_expert, num_rows = build_row_id_map(
        routing, num_experts, num_out_tokens, pad_multiple, capacity
    )
    # Padding rows inside expert groups must be zero (grouped GEMMs read them); rows after the last
    # group (an upper-bound size with -1 routes) are outside every group: unwritten unless zero_fill.
    # Without padding or capacity the groups are dense, so the permute writes rows [0, sum(tokens_per_expert))
    # and only the rows after them are zeroed (the TURBO EP bound is ~2x the real rows at DeepSeek-V3 size:
    # a zero-filled allocation wrote the whole buffer, 276 us of 1.3 ms per dispatch on H200).
    dense = pad_multiple <= 1 and capacity is None
    written = tokens_per_expert.sum() if zero_fill and dense and not torch.compiler.is_compiling() else None
    zero_fill = zero_fill or not dense
    probs = probs.contiguous() if probs is not None else None
    out, out_probs = _Permute.apply(tokens, probs, row_id_map, num_rows, zero_fill, written, out_dtype)
    return out, out_probs, row_id_map, tokens_per_expert


def token_unpermute(
    permuted_tokens: torch.Tensor,
    row_id_map: torch.Tensor,
    merging_probs: torch.Tensor | None = None,
    num_tokens: int | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Inverse of ``token_permute``: out[t] = sum_k permuted[row_id_map[t, k]] (* merging_probs[t, k]).

    Accumulates in fp32, no atomics (deterministic). ``num_tokens`` defaults to row_id_map.shape[0].
    ``out_dtype`` (default: the permuted rows'): fp16/bf16 rows may be summed into fp32 tokens and back;
    the rows' gradient comes back in their dtype.
    """
    if not isinstance(permuted_tokens, torch.Tensor) or permuted_tokens.dim() != 2:
        raise ValueError("token_unpermute: permuted_tokens must be a [N, hidden] tensor")
    _check_out_dtype(permuted_tokens, out_dtype, "token_unpermute", "permuted_tokens")
    if row_id_map.dtype != torch.int32 or row_id_map.dim() != 2:
        raise ValueError("token_unpermute: row_id_map must be the int32 [T, K] map returned by token_permute")
    if row_id_map.device != permuted_tokens.device:
        raise ValueError(
            f"token_unpermute: row_id_map on {row_id_map.device}, permuted_tokens on {permuted_tokens.device}"
        )
    if merging_probs is not None:
        _check_probs(
            merging_probs, row_id_map, permuted_tokens, "token_unpermute", "merging_probs", "row_id_map",
            "permuted_tokens",
        )  # fmt: skip
    if num_tokens is not None and num_tokens != row_id_map.shape[0]:
        raise ValueError(f"token_unpermute: num_tokens={num_tokens} != row_id_map rows {row_id_map.shape[0]}")
    if row_id_map.numel() and _host_checks(row_id_map):
        # the kernels gather row_id_map's rows unchecked: a smaller buffer would be read out of bounds
        lo, hi = int(row_id_map.min()), int(row_id_map.max())
        if lo < -1 or hi >= permuted_tokens.shape[0]:
            raise ValueError(
                f"token_unpermute: row_id_map names rows [{lo}, {hi}] but permuted_tokens has "
                f"{permuted_tokens.shape[0]} rows (-1 = no row)"
            )
    probs = merging_probs.contiguous() if merging_probs is not None else None
    return _Unpermute.apply(
        permuted_tokens.contiguous(), row_id_map.contiguous(), probs, row_id_map.shape[0], out_dtype
    )


def token_permute_fp8(
    tokens: torch.Tensor,
    routing: torch.Tensor,
    num_out_tokens: int | None = None,
    pad_multiple: int = 0,
    *,
    num_experts: int | None = None,
    capacity: int | None = None,
    fp8_dtype: torch.dtype = torch.float8_e4m3fn,
):
    """Permute and quantize row-wise to FP8 in one pass (forward only: feeds an FP8 grouped GEMM).

    Returns (permuted_fp8 [N, H], row_scales [N] fp32 with x = fp8 * scale, row_id_map,
    tokens_per_expert). Padding rows are zero with scale 1.
    """
    num_experts = _validate(
        tokens, routing, None, num_experts, num_out_tokens, pad_multiple, capacity, "token_permute_fp8"
    )
    if fp8_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"token_permute_fp8: fp8_dtype {fp8_dtype}; accepted float8_e4m3fn, float8_e5m2")
    row_id_map, tokens_per_expert, num_rows = build_row_id_map(
        routing, num_experts, num_out_tokens, pad_multiple, capacity
    )
    out, scales = moe_permute_fp8_rowwise(tokens.detach().contiguous(), row_id_map, num_rows, fp8_dtype)
    return out, scales, row_id_map, tokens_per_expert
