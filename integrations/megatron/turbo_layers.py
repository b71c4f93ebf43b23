"""Turbo leaf modules for Megatron-Core 0.16.1 specs: same constructor signatures, parameter names and
parallel attributes as the stock modules they replace, compute through primus_turbo ops.

- TurboColumnParallelLinear / TurboRowParallelLinear: Megatron's classes with ``_forward_impl`` swapped for
  turbo GEMM (bf16) or turbo FP8 GEMM; TP communication (sequence-parallel all-gather / dgrad all-reduce)
  stays Megatron's autograd mappings, and the weight gradient accumulates straight into DDP's fp32
  ``main_grad`` (Megatron's gradient_accumulation_fusion semantics, without its CUDA extension).
- TurboRMSNorm: WrappedTorchNorm replacement (parameter ``weight``).
- TurboCoreAttention: DotProductAttention replacement over ``turbo.ops.flash_attn_func`` (GQA, MLA 192/128).
- TurboColumn/RowParallelGroupedLinear: TE GroupedLinear-compatible experts for ``TEGroupedMLP``
  (parameters ``weight0..weight{G-1}``, so expert checkpoints match TE's layout) over turbo grouped GEMM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    _initialize_affine_weight_gpu,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from primus_turbo.integrations.megatron import turbo_async_tp, turbo_ops

from primus_turbo.pytorch.core.main_grad import (
    check_main_grad,
    wgrad_placeholders,
)

# Set by the registry's fp8 entry before the model is built (primus_turbo Float8QuantConfigs), else None:
# FP8_CONFIG for the linears, FP8_GROUPED_CONFIG for the experts (grouped FP8 has no delayed scaling).
FP8_CONFIG = None
# Set by the turbo.async_tp entry: sequence-parallel turbo linears fuse their collectives into the GEMMs.
ASYNC_TP = False
FP8_GROUPED_CONFIG = None

# Weight cache for gradient accumulation: a linear quantizes its weight once per optimizer step and
# the other microbatches reuse that FP8 copy (Transformer Engine's is_first_microbatch); the grouped
# experts likewise stack their G weights (and, under FP8, quantize the stack) once per step. On only
# while a training loop announces its steps (``new_weight_step`` before each step's first microbatch,
# as our trainer does); the key also holds the weights' storage and version, so an in-place write
# between microbatches rebuilds. A loop that never calls ``new_weight_step`` rebuilds on every call.
_WEIGHT_STEP: int | None = None


def new_weight_step() -> None:
    """Start an optimizer step: weights are requantized (experts restacked) once, then reused by its
    microbatches."""
    global _WEIGHT_STEP
    _WEIGHT_STEP = 0 if _WEIGHT_STEP is None else _WEIGHT_STEP + 1


def disable_weight_cache() -> None:
    global _WEIGHT_STEP
    _WEIGHT_STEP = None


# True while the trainer runs a micro-batch that is not the last of its step (inside DDP's no_sync, no
# pipelining): the experts then add their weight gradient into main_grad without a per-weight autograd
# edge (see _expert_weight_operand).
_SKIP_EXPERT_GRAD_HOOKS = False


@contextlib.contextmanager
def accumulating_microbatch(no_sync):
    """Wrap DDP's ``no_sync`` (the schedule runs every micro-batch but the last inside it).

    Megatron's DDP hook of each parameter only acts on the last micro-batch (it registers the gradient as
    ready for the bucket's reduction); before that, for weights whose gradient the op already added into
    main_grad, it is pure host cost: 2 x G hooks + AccumulateGrad nodes per MoE layer and micro-batch
    (3408 per step of deepseek_moe_fp8, ~45 ms under the profiler). Only for pipeline size 1, where each
    micro-batch's forward and backward both run inside (or both outside) ``no_sync``.
    """
    global _SKIP_EXPERT_GRAD_HOOKS
    previous = _SKIP_EXPERT_GRAD_HOOKS
    _SKIP_EXPERT_GRAD_HOOKS = parallel_state.get_pipeline_model_parallel_world_size() == 1
    try:
        with no_sync():
            yield
    finally:
        _SKIP_EXPERT_GRAD_HOOKS = previous


def _delayed_state(config):
    """A per-module amax history when the linears use DELAYED scaling (fp8.recipe=delayed), else None."""
    if FP8_CONFIG is None or FP8_CONFIG.strategy.name != "DELAYED":
        return None
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    return turbo_ops.get("core.fp8_autocast.DelayedScalingState")(FP8_CONFIG, device=device)


def _cached_fp8_weight(owner, weight: torch.Tensor, fp8_config):
    """The FP8 weight of ``owner`` for this optimizer step (see ``new_weight_step``), or None: no cache."""
    if _WEIGHT_STEP is None or owner is None:
        return None
    key = (_WEIGHT_STEP, weight.data_ptr(), weight._version, fp8_config)
    cached = getattr(owner, "_fp8_weight_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, turbo_ops.get("modules.float8_linear.quantize_weight")(weight, fp8_config))
        owner._fp8_weight_cache = cached
    return cached[1]


def _linear_2d(x2d, weight, fp8_config, delayed_state=None, cache_owner=None) -> torch.Tensor:
    accumulate = weight.requires_grad and isinstance(getattr(weight, "main_grad", None), torch.Tensor)
    if fp8_config is not None:
        gemm_fp8 = turbo_ops.get("ops.gemm_fp8")
        # a bf16 wgrad accumulates into main_grad in fp32 like the bf16 path; the FP8 wgrad returns bf16
        acc = accumulate and fp8_config.high_precision_wgrad
        w8 = None if delayed_state is not None else _cached_fp8_weight(cache_owner, weight, fp8_config)
        if w8 is not None:
            return gemm_fp8(
                x2d, w8, trans_b=True, out_dtype=x2d.dtype, config=fp8_config, accumulate_into_main_grad=acc
            )
        return gemm_fp8(
            x2d, weight, trans_b=True, config=fp8_config, delayed_state=delayed_state,
            accumulate_into_main_grad=acc,
        )  # fmt: skip
    return turbo_ops.get("ops.gemm")(x2d, weight, trans_b=True, accumulate_into_main_grad=accumulate)


def turbo_linear_forward_impl(
    input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
    grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, fp8_config=None, delayed_state=None,
    cache_owner=None, **_unused,
):  # fmt: skip
    """Drop-in for ``linear_with_grad_accumulation_and_async_allreduce`` (same arguments)."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    out = _linear_2d(input.reshape(-1, input.shape[-1]), weight, fp8_config, delayed_state, cache_owner)
    out = out.view(*input.shape[:-1], weight.shape[0])
    return out + bias if bias is not None else out


class _TurboLinearMixin:
    """Megatron's linear with ``_forward_impl`` through turbo GEMM (bf16) or turbo FP8 GEMM."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8_delayed_state = _delayed_state(self.config)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not weight.requires_grad:
            return super()._forward_impl(input, weight, *args, **kwargs)
        if (
            ASYNC_TP
            and FP8_CONFIG is None
            and not args
            and kwargs.get("sequence_parallel")
            and kwargs.get("grad_output_buffer") is None  # deferred embedding wgrad: Megatron's own path
        ):
            # the column layer (the row layer passes sequence_parallel=False and scatters in forward)
            return turbo_async_tp.column_forward(input, weight, kwargs.get("bias"), kwargs["tp_group"])
        return turbo_linear_forward_impl(
            input, weight, *args, fp8_config=FP8_CONFIG, delayed_state=self.fp8_delayed_state,
            cache_owner=self, **kwargs,
        )  # fmt: skip


class TurboColumnParallelLinear(_TurboLinearMixin, ColumnParallelLinear):
    pass


class TurboRowParallelLinear(_TurboLinearMixin, RowParallelLinear):
    def forward(self, input_):
        if not self._async_tp_applies():
            return super().forward(input_)
        out = turbo_async_tp.row_forward(input_, self.weight, self.tp_group)  # GEMM + reduce-scatter fused
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    def _async_tp_applies(self) -> bool:
        """Megatron's plain sequence-parallel case; everything else keeps its forward."""
        offload = getattr(self.config, "_cpu_offloading_context", None)
        return (
            ASYNC_TP
            and FP8_CONFIG is None
            and self.sequence_parallel
            and self.input_is_parallel
            and not self.explicit_expert_comm
            and self.weight.requires_grad
            and (offload is None or not offload.inside_context)
        )


class TurboRMSNorm(torch.nn.Module):
    """RMSNorm with WrappedTorchNorm's constructor; ``weight`` marked sequence_parallel like Megatron's."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.config = config
        self.eps = eps
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return turbo_ops.get("ops.rmsnorm")(x, self.weight, self.eps, self.zero_centered_gamma)


class TurboCoreAttention(MegatronModule):
    """DotProductAttention's interface: q [sq, b, hq, d], k/v [sk, b, hk, d|dv] -> [sq, b, hq*dv], causal.

    Under context parallelism (cp > 1) each rank holds Megatron's zigzag shard of the sequence (chunks r
    and 2cp-1-r of 2cp, as ``get_batch_on_this_cp_rank`` cuts it): ring attention over the CP group
    (``turbo.ops.flash_attn_usp_func``), whose causal layout is that same zigzag split."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **_unused):  # fmt: skip
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.cp_group = None
        if config.context_parallel_size > 1:
            if self.dropout_p > 0.0:
                raise ValueError(
                    f"TurboCoreAttention: attention dropout {self.dropout_p} is not supported under context "
                    "parallelism (cp > 1); set model.attention_dropout=0"
                )
            cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
            self.cp_group = cp_group or parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused):  # fmt: skip
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("TurboCoreAttention: packed sequences and attention_bias are not supported")
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # -> [b, s, h, d]
        if self.cp_group is not None:
            out = turbo_ops.get("ops.flash_attn_usp_func")(
                q, k, v, softmax_scale=self.softmax_scale, causal=True, ring_group=self.cp_group
            )
            return out.transpose(0, 1).reshape(query.shape[0], query.shape[1], -1)
        out = turbo_ops.get("ops.flash_attn_func")(
            q, k, v, dropout_p=self.dropout_p if self.training else 0.0, softmax_scale=self.softmax_scale,
            causal=True,
        )  # fmt: skip
        sq, b = query.shape[0], query.shape[1]
        return out.transpose(0, 1).reshape(sq, b, -1)


class _ExpertWeights(torch.autograd.Function):
    """The G expert weights as the one [G, out, in] tensor the grouped GEMM reads, without a copy.

    forward returns ``stacked`` (this step's cached stack, a fresh one, or a zero-storage stand-in when
    the GEMM reads only a pre-quantized FP8 copy). backward hands each weight{i} its slice of the
    [G, out, in] gradient like ``torch.stack``'s backward, or, under Megatron's main_grad fusion (the grouped
    GEMM's ``main_grad_into`` has added the gradient into the G ``main_grad`` buffers and hands this function
    None), returns the placeholders DDP expects: every weight still receives a gradient on every microbatch,
    so DDP's per-parameter hooks fire.
    """

    @staticmethod
    def forward(ctx, stacked, accumulate, *weights):
        ctx.set_materialize_grads(False)  # main_grad fusion: no [G, out, in] zeros for the None gradient
        ctx.weights = weights if accumulate else None  # the Python objects carry main_grad
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx, grad):
        if ctx.weights is None:
            return None, None, *grad.unbind(0)
        return None, None, *wgrad_placeholders(ctx.weights)


class _ExpertWeightsMainGradOnly(torch.autograd.Function):
    """As ``_ExpertWeights`` under main_grad fusion, for a micro-batch that is not the last of its step:
    the weights are not autograd inputs (no AccumulateGrad node, no DDP hook per weight); the grouped GEMM
    adds the gradient into their main_grad. ``anchor``: a grad-requiring empty leaf, so that the GEMM's
    backward runs even when its input needs no gradient; it receives none."""

    @staticmethod
    def forward(ctx, stacked, anchor):
        ctx.set_materialize_grads(False)
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx, grad):
        return None, None


def _accumulates_into_main_grad(weights) -> bool:
    """Megatron's gradient_accumulation_fusion for the experts: decided as ``_linear_2d`` decides it."""
    return all(w.requires_grad and isinstance(getattr(w, "main_grad", None), torch.Tensor) for w in weights)


@dataclasses.dataclass
class _ExpertWeightCache:
    key: tuple  # (step, fp8 config, every weight's (data_ptr, _version))
    stacked: torch.Tensor | None  # [G, out, in] bf16 (None under FP8: only the quantized copies are kept)
    fp8: object | None  # GroupedFloat8Weight without a source
    main_grads_checked: bool = False  # check_main_grad x G costs ~120 us: once per step


def _cached_expert_weights(owner, weights, fp8_config) -> _ExpertWeightCache | None:
    """``owner``'s expert weights for this optimizer step (built on first use), or None: no cache."""
    if _WEIGHT_STEP is None:
        return None
    key = (_WEIGHT_STEP, fp8_config, [(w.data_ptr(), w._version) for w in weights])  # ~20 us for G=64
    cache = getattr(owner, "_expert_weight_cache", None)
    if cache is None or cache.key != key:
        owner._expert_weight_cache = None  # free the stale copy before building the new one
        with torch.no_grad():
            stacked = torch.stack(weights)
        if fp8_config is not None:
            quantize = turbo_ops.get("ops.grouped_gemm_fp8.quantize_grouped_weight")
            cache = _ExpertWeightCache(
                key, None, dataclasses.replace(quantize(stacked, fp8_config), source=None)
            )
        else:
            cache = _ExpertWeightCache(key, stacked, None)
        owner._expert_weight_cache = cache
    return cache


def _expert_weight_operand(owner, weights, fp8_config):
    """(b, main_grad_into) for the grouped GEMM of ``owner``'s experts: b a [G, out, in] tensor, or a
    pre-quantized FP8 weight, whose gradient reaches every weight{i}; under main_grad fusion main_grad_into
    is the weights (the wgrad GEMM adds into their main_grads; b's function only hands DDP placeholders),
    else None."""
    accumulate = _accumulates_into_main_grad(weights)
    cache = _cached_expert_weights(owner, weights, fp8_config)
    if cache is None and not accumulate:
        return torch.stack(weights), None  # uncached, no fusion: exactly the plain path
    if accumulate and not (cache is not None and cache.main_grads_checked):
        for i, w in enumerate(weights):
            check_main_grad(w, "grouped linear", f"weight{i}")
        if cache is not None:
            cache.main_grads_checked = True
    if cache is None:
        stacked, w8 = torch.stack([w.detach() for w in weights]), None
    else:
        stacked, w8 = cache.stacked, cache.fp8
    if not (torch.is_grad_enabled() and any(w.requires_grad for w in weights)):
        return (stacked if w8 is None else w8), None
    if stacked is None:  # the FP8 GEMM reads w8 only: the gradient needs a [G, out, in] carrier, no data
        stacked = weights[0].new_empty(()).expand(len(weights), *weights[0].shape)
    if accumulate and _SKIP_EXPERT_GRAD_HOOKS:
        anchor = getattr(owner, "_grad_anchor", None)
        if anchor is None or anchor.device != stacked.device:
            anchor = owner._grad_anchor = torch.empty(0, device=stacked.device, requires_grad=True)
        b = _ExpertWeightsMainGradOnly.apply(stacked, anchor)
    else:
        b = _ExpertWeights.apply(stacked, accumulate, *weights)
    main_grad_into = tuple(weights) if accumulate else None
    return (b if w8 is None else dataclasses.replace(w8, source=b)), main_grad_into


class _TurboGroupedLinear(torch.nn.Module):
    """TE GroupedLinear constructor; forward(x, m_splits) -> (out, None); weight{i} per local expert."""

    partition_dim = 0  # 0: column (split the output), 1: row (split the input)

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert, tp_comm_buffer_name=None, pg_collection=None, **_unused):  # fmt: skip
        super().__init__()
        if bias:
            raise ValueError("Turbo grouped linear: add_bias_linear=True is not supported for experts")
        self.config = config
        self.num_gemms = num_gemms
        tp = parallel_state.get_expert_tensor_parallel_world_size()
        if self.partition_dim == 0:
            output_size //= tp
        else:
            input_size //= tp
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(
                torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
            )
            if config.perform_initialization:
                if config.use_cpu_initialization:
                    init_method(weight)
                else:  # Megatron's GPU init: the expert-parallel RNG stream, distinct per EP rank
                    _initialize_affine_weight_gpu(
                        weight, init_method, self.partition_dim, is_expert=is_expert
                    )
            weight.allreduce = not is_expert  # expert params reduce over the expert-data-parallel group
            weight.tensor_model_parallel = tp > 1
            weight.partition_dim = self.partition_dim
            weight.partition_stride = 1
            setattr(self, f"weight{i}", weight)

    def forward(self, x: torch.Tensor, m_splits):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        group_lens = torch.as_tensor(m_splits, dtype=torch.int64).to(x.device, non_blocking=True)
        b, main_grad_into = _expert_weight_operand(self, weights, FP8_GROUPED_CONFIG)
        if FP8_GROUPED_CONFIG is not None:
            out = turbo_ops.get("ops.grouped_gemm_fp8")(
                x, b, group_lens, trans_b=True, config=FP8_GROUPED_CONFIG, main_grad_into=main_grad_into
            )
        else:
            grouped_gemm = turbo_ops.get("ops.grouped_gemm")
            out = grouped_gemm(x, b, group_lens, trans_b=True, main_grad_into=main_grad_into)
        return out, None


class TurboColumnParallelGroupedLinear(_TurboGroupedLinear):
    partition_dim = 0


class TurboRowParallelGroupedLinear(_TurboGroupedLinear):
    partition_dim = 1


class TurboTokenDispatcher(MoETokenDispatcher):
    """Megatron's MoETokenDispatcher over ``turbo.modules.TokenDispatcher`` (EP all-to-all + permute).

    Replaces MoEAlltoAllTokenDispatcher: the routing map [T, E] becomes top-k indices/probs [T, K], the turbo
    dispatcher sends each token once per destination expert and groups rows by local expert; the routing
    probs travel with the tokens and are applied inside the experts (TEGroupedMLP multiplies them after the
    activation), so combine is a plain sum. Expert tensor parallelism is not supported (expert TP size 1).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise ValueError("turbo.dispatch: expert tensor parallelism > 1 is not supported")
        token_dispatcher_cls = turbo_ops.get("modules.TokenDispatcher")
        self.topk = config.moe_router_topk
        self.dispatcher = token_dispatcher_cls(
            config.num_moe_experts, self.topk, self.ep_group, probs_in_experts=True
        )
        self.hidden_shape = None
        self.tokens_per_expert = None

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        indices = routing_map.to(torch.int8).topk(self.topk, dim=-1).indices
        return hidden_states.reshape(-1, self.hidden_shape[-1]), (probs.gather(1, indices), indices)

    def token_dispatch(self, hidden_states, probs):
        topk_probs, indices = probs
        expert_input, self.tokens_per_expert, expert_probs = self.dispatcher.token_dispatch(
            hidden_states, topk_probs, indices
        )
        return expert_input, expert_probs

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        return self.dispatcher.token_combine(hidden_states)

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)
