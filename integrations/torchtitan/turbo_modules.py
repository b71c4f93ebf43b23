"""Turbo replacements for TorchTitan 0.2.2 leaf modules: same parameter names, shapes and init hooks.

Each class is built from the stock module it replaces (``from_stock``) and shares its Parameters, so the
model's state_dict keys and shapes do not change and TorchTitan checkpoints load with turbo on or off.
All of them work on the meta device (TorchTitan converts the model before ``to_empty`` + ``init_weights``).

- ``TitanLinear`` / ``TitanFloat8Linear``: ``turbo.modules.Linear`` / ``Float8Linear`` that follow
  ``torch.autocast`` like ``nn.Linear`` (single-GPU TorchTitan runs bf16 through AMP, not FSDP).
- ``TitanInnerAttention``: ``turbo.modules.TurboAttention`` (layout "bhsd") with the SDPA wrapper's call
  signature; covers DeepSeek-V3 MLA (q/k 192, v 128) and Llama3/Qwen3 GQA.
- ``TitanEmbedding``: ``nn.Embedding``, its weight gradient added into ``.grad`` by ``turbo.ops.embedding``.
- ``TurboMLA``: DeepSeek-V3 MLA ``Attention`` with q's and k_pe's RoPE in ``apply_rotary_emb_complex`` and
  the keys / values in ``mla_key_value``.
- ``TitanRMSNorm``: ``turbo.modules.RMSNorm`` honouring ``nn.RMSNorm(eps=None)`` (eps = finfo(dtype).eps).
- ``TurboGroupedExperts``: ``GroupedExperts`` over ``turbo.ops.grouped_gemm`` / ``grouped_gemm_fp8`` on the
  stacked ``w1/w2/w3`` [G, ...] parameters.
- ``TurboTopKRouter``: ``TokenChoiceTopKRouter`` over ``turbo.ops.fused_topk_routing``.
- ``TurboMoE``: ``MoE.forward`` with the token reorder in ``token_permute`` / ``token_unpermute``.
- ``TurboEPMoE``: ``TurboMoE`` whose expert-parallel token exchange is ``TokenDispatcher`` (``moe_dispatch`` /
  ``moe_combine``)
  (``leave_token_exchange_to_turbo`` keeps TorchTitan's ExpertParallel from adding its own all-to-all).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from primus_turbo.integrations.torchtitan import amp_weights as amp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.deepseek_v3.model.model import Attention as MLAAttention
from torchtitan.models.moe.moe import GroupedExperts, MoE, TokenChoiceTopKRouter

from primus_turbo.pytorch.core.fp8_autocast import resolve_fp8_config
from primus_turbo.pytorch.core.low_precision import ScalingStrategy
from primus_turbo.pytorch.core.utils import autocast_cast
from primus_turbo.pytorch.modules import Float8Linear, Linear, RMSNorm, TurboAttention
from primus_turbo.pytorch.modules.token_dispatcher import TokenDispatcher
from primus_turbo.pytorch.ops import (
    embedding,
    fused_topk_routing,
    gemm,
    gemm_fp8,
    grouped_gemm,
    grouped_gemm_fp8,
    swiglu,
)
from primus_turbo.pytorch.ops.mla import mla_key_value
from primus_turbo.pytorch.ops.moe.permute import token_permute, token_unpermute
from primus_turbo.pytorch.ops.rope import apply_rotary_emb_complex

# Cast ``x`` to the active autocast dtype, as autocast does for ``F.linear`` (turbo ops are custom functions,
# which autocast passes through unchanged)
autocast_input = autocast_cast


class _CastOnce(torch.autograd.Function):
    """``x.to(dtype)`` once for ``n`` consumers; backward: their gradients summed in x's dtype, as the
    consumers' own casts (one ToCopyBackward each) and autograd's sum of those did, bitwise for n = 2."""

    @staticmethod
    def forward(ctx, x, dtype, n):
        ctx.in_dtype = x.dtype
        ctx.set_materialize_grads(False)
        y = x.to(dtype)
        return tuple(y.view_as(y) for _ in range(n))

    @staticmethod
    def backward(ctx, *grads):
        total = None
        for g in grads:
            if g is not None:
                total = g.to(ctx.in_dtype, copy=True) if total is None else total.add_(g)
        return total, None, None


def autocast_inputs(x: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """``autocast_input(x)`` for ``n`` linears reading the same ``x`` (an fp32 norm output under autocast):
    one cast kernel forward and one backward instead of n each."""
    y = autocast_input(x)
    if y is x or not torch.is_grad_enabled() or not x.requires_grad:
        return (y,) * n
    return _CastOnce.apply(x, y.dtype, n)


def _share_linear_params(new: nn.Module, linear: nn.Linear) -> nn.Module:
    new.weight = linear.weight
    new.bias = linear.bias
    return new


class TitanLinear(Linear):
    """``turbo.modules.Linear`` (bf16/fp32 ``turbo.ops.gemm``) following autocast."""

    @classmethod
    def from_stock(cls, linear: nn.Linear) -> TitanLinear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        return _share_linear_params(new, linear)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if amp.applies(self.weight, x2d):  # fp32 weight under autocast: cast once per step
            if x2d.is_cuda:  # the wgrad GEMM writes / sums into the fp32 .grad (cuBLAS beta=1)
                weight, into = amp.weights_for_wgrad_into(self, "weight", (self.weight,), x2d.dtype)
                return gemm(x2d, weight, trans_b=True, wgrad_into=into[0] if into else None)
            weight = amp.cast_weight(self, "weight", self.weight, x2d.dtype)
        else:
            weight = self.weight if self.weight.dtype == x2d.dtype else self.weight.to(x2d.dtype)
        return gemm(x2d, weight, trans_b=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        out = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class TitanFloat8Linear(Float8Linear):
    """``turbo.modules.Float8Linear`` (forward, dgrad and wgrad in FP8) following autocast."""

    @classmethod
    def from_stock(cls, linear: nn.Linear, config) -> TitanFloat8Linear:
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config,
                  device="meta")  # fmt: skip
        return _share_linear_params(new, linear)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        config = resolve_fp8_config(self.config, fp8_by_default=True)
        if config is None or config.strategy is ScalingStrategy.DELAYED or not amp.applies(self.weight, x2d):
            return super()._matmul(x2d)
        w8 = amp.fp8_weight(self, "weight", self.weight, config)  # fp32 weight: once per step
        return gemm_fp8(x2d, w8, trans_b=True, out_dtype=x2d.dtype, config=config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = autocast_input(x)
        out = self._matmul(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class TitanInnerAttention(TurboAttention):
    """Causal ``turbo.ops.flash_attn_func`` with ``ScaledDotProductAttentionWrapper``'s signature:
    q [B, Hq, S, Dqk], k [B, Hkv, S, Dqk], v [B, Hkv, S, Dv] -> [B, Hq, S, Dv]; GQA when Hkv < Hq."""

    def __init__(self, softmax_scale: float | None = None):
        super().__init__(causal=True, softmax_scale=softmax_scale, layout="bhsd")

    def forward(self, q, k, v, *, scale: float | None = None, enable_gqa: bool = False, is_causal=True):
        if not is_causal:
            raise ValueError("TitanInnerAttention: only causal attention is supported (is_causal=False seen)")
        if scale is not None and (self.softmax_scale is None or abs(scale - self.softmax_scale) > 1e-12):
            raise ValueError(
                f"TitanInnerAttention: scale={scale} differs from the converted {self.softmax_scale}"
            )
        if isinstance(q, DTensor):  # TP plans that keep q/k/v DTensors (qwen3): per-rank heads, run locally
            placements = q.placements
            if any(t.placements != placements for t in (k, v)) or not all(
                isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 1) for p in placements
            ):
                raise ValueError(
                    "TitanInnerAttention: q/k/v DTensors must share placements that shard the heads "
                    f"(Shard(1)) or replicate, got {q.placements}, {k.placements}, {v.placements}"
                )
            out = super().forward(q.to_local(), k.to_local(), v.to_local())
            return DTensor.from_local(out, q.device_mesh, placements, run_check=False)
        return super().forward(q, k, v)


class TitanEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight gradient ``turbo.ops.embedding`` adds into the fp32 ``.grad`` over the
    touched rows only (one deterministic kernel), instead of a dense [V, H] gradient (zero-fill + scatter)
    that AccumulateGrad then adds; the step's first micro-batch zero-fills ``.grad``. For weights
    ``amp_weights.grad_fusable`` accepts (single-device runs); otherwise, and with padding_idx, max_norm,
    scale_grad_by_freq or sparse, the stock forward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = self.weight
        plain = self.padding_idx is not None or self.max_norm is not None or self.scale_grad_by_freq
        if plain or self.sparse or not (torch.is_grad_enabled() and w.requires_grad and amp.grad_fusable(w)):
            return super().forward(input)
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.main_grad = w.grad  # where turbo.ops.embedding accumulates (Megatron's main_grad contract)
        return embedding(input, w, accumulate_into_main_grad=True)


class TurboMLA(MLAAttention):
    """TorchTitan's DeepSeek-V3 MLA ``Attention`` with q's RoPE as one kernel that also copies the nope part
    (``apply_rotary_emb_complex``): no split, casts, complex multiply and cat of q, nor the cat of their
    gradients in the backward; k_pe's RoPE likewise; keys and values from the wkv_b output in one kernel each
    way (``mla_key_value``: no split + cat of the keys, nor the cat of kv's gradient and the expand's sum).
    The rest is the stock forward, line for line. With ``positions`` (a per-sample RoPE cache order), the
    stock forward."""

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        if positions is not None or freqs_cis.dtype != torch.complex64:
            return super().forward(x, freqs_cis, attention_masks, positions)
        bsz, seqlen, _ = x.size()
        x_q, x_kv = autocast_inputs(x, 2)  # the q and kv_a projections read the same norm output
        q = self.wq(x_q) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x_q)))
        q = q.view(bsz, seqlen, -1, self.qk_head_dim)  # (bsz, seqlen, n_heads, qk_head_dim)
        q = apply_rotary_emb_complex(q, freqs_cis, self.qk_rope_head_dim)
        kv, k_pe = torch.split(self.wkv_a(x_kv), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb_complex(k_pe.unsqueeze(2), freqs_cis)  # (bsz, seqlen, 1, qk_rope_head_dim)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k, v = mla_key_value(kv, k_pe, self.qk_nope_head_dim)  # split + cat(k_nope, k_pe over heads)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.attn_type == "flex":
            output = self.inner_attention(q, k, v, block_mask=attention_masks, scale=self.softmax_scale)
        else:
            if attention_masks is not None:
                raise ValueError("TurboMLA: SDPA attention takes no attention_masks (as the stock forward)")
            output = self.inner_attention(q, k, v, scale=self.softmax_scale)
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class TitanRMSNorm(RMSNorm):
    """``turbo.modules.RMSNorm``; ``eps=None`` resolves per call to finfo(x.dtype).eps like nn.RMSNorm."""

    @classmethod
    def from_stock(cls, norm: nn.RMSNorm) -> TitanRMSNorm:
        (hidden,) = norm.normalized_shape
        new = cls(hidden, eps=norm.eps or 1e-6, device="meta")
        new.eps_from_dtype = norm.eps is None
        new.weight = norm.weight
        return new

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if getattr(self, "eps_from_dtype", False):
            self.eps = torch.finfo(x.dtype).eps
        return super().forward(x, residual)


# FP8 config of the grouped experts; set by the converter's fp8 patch (None: bf16 grouped GEMM).
EXPERTS_FP8_CONFIG = None


# One GEMM on [w1; w3] + turbo.ops.swiglu for the gate/up pair of the experts and FeedForwards whose fp32
# weights run under autocast (the concatenation is cached per step, so it costs nothing per micro-batch).
FUSE_GATE_UP = True


def _gate_up_fp8_fusable(config, hidden: int) -> bool:
    """Whether [w1; w3] quantized as one weight keeps each half's forward scales: rowwise (a scale per
    output row; the dgrad copy's per-column scales then span both halves, as for Megatron's fused fc1
    [2F, K] weight), or 128 x 128 blocks that do not straddle the halves (exact both ways). Tensorwise
    would share one scale: not fused."""
    g = config.granularity.name
    return g == "ROWWISE" or (g == "BLOCKWISE" and hidden % config.block_size == 0)


class TurboGroupedExperts(GroupedExperts):
    """``GroupedExperts`` with the SwiGLU expert MLP on turbo grouped GEMMs (trans_b: the [G, N, K] layout
    TorchTitan stores). Rows of ``x`` are grouped by expert as ``num_tokens_per_expert`` says; with EP,
    TorchTitan's ExpertParallel (or ``TurboEPMoE``) has already grouped them. No host sync. Under
    single-device AMP (fp32 weights, see ``amp_weights``) w1 and w3 run as one grouped GEMM on their
    per-step concatenation, followed by ``turbo.ops.swiglu`` (one kernel each way); otherwise one grouped
    GEMM per weight and silu * mul."""

    def _grouped(self, x: torch.Tensor, name: str, w: torch.Tensor, group_lens: torch.Tensor) -> torch.Tensor:
        config = EXPERTS_FP8_CONFIG
        if amp.applies(w, x):  # fp32 weights under autocast: cast (quantize) once per step
            b, into = amp.weights_for_wgrad_into(self, name, (w,), x.dtype, config)
            if config is not None:
                return grouped_gemm_fp8(x, b, group_lens, trans_b=True, config=config, wgrad_into=into)
            return grouped_gemm(x, b, group_lens, trans_b=True, wgrad_into=into)
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        if config is not None:
            return grouped_gemm_fp8(x, w, group_lens, trans_b=True, config=config)
        return grouped_gemm(x, w, group_lens, trans_b=True)

    def _gate_up(self, x, w1, w3, group_lens) -> torch.Tensor | None:
        """silu(x @ w1^T) * (x @ w3^T) from one grouped GEMM on [w1; w3], or None: not this path."""
        config = EXPERTS_FP8_CONFIG
        if not (FUSE_GATE_UP and amp.applies(w1, x) and amp.applies(w3, x)):
            return None
        if config is None:
            b, into = amp.weights_for_wgrad_into(self, "w13", (w1, w3), x.dtype)
            h = grouped_gemm(x, b, group_lens, trans_b=True, wgrad_into=into)
        elif _gate_up_fp8_fusable(config, w1.shape[-2]):
            b, into = amp.weights_for_wgrad_into(self, "w13", (w1, w3), x.dtype, config)
            h = grouped_gemm_fp8(x, b, group_lens, trans_b=True, config=config, wgrad_into=into)
        else:
            return None
        return swiglu(h)

    @staticmethod
    def input_dtype(x: torch.Tensor) -> torch.dtype:
        """The dtype the expert GEMMs read ``x`` in: bf16 on CUDA or under autocast, as the stock grouped_mm
        path; else x's. The output comes back in x's dtype."""
        if x.device.type == "cuda" or torch.is_autocast_enabled(x.device.type):
            return torch.bfloat16
        return x.dtype

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        in_dtype = x.dtype
        x = x.to(self.input_dtype(x))
        group_lens = num_tokens_per_expert.to(torch.int64)  # the router's histc gives float counts
        h = self._gate_up(x, w1, w3, group_lens)
        if h is None:
            h = F.silu(self._grouped(x, "w1", w1, group_lens)) * self._grouped(x, "w3", w3, group_lens)
        return self._grouped(h, "w2", w2, group_lens).to(in_dtype)


class GateUpFeedForward:
    """Mixin over TorchTitan's FeedForward classes (``w2(silu(w1(x)) * w3(x))``; see ``feed_forward_class``):
    when w1 and w3 are bf16 turbo linears over fp32 weights under autocast, they run as one GEMM on the
    step's cached [w1; w3] followed by ``turbo.ops.swiglu``; otherwise the stock forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1, w3 = self.w1, self.w3
        x16 = autocast_input(x)
        fused = FUSE_GATE_UP and all(
            type(lin) is TitanLinear and lin.bias is None and amp.applies(lin.weight, x16) for lin in (w1, w3)
        )
        if not fused:
            return super().forward(x)
        w13 = amp.cast_weights(self, "w13", (w1.weight, w3.weight), x16.dtype)
        h = swiglu(gemm(x16.reshape(-1, x16.shape[-1]), w13, trans_b=True))
        return self.w2(h.reshape(*x16.shape[:-1], h.shape[-1]))


_FEED_FORWARD_CLASSES: dict[type, type] = {}


def feed_forward_class(stock: type) -> type:
    """The ``GateUpFeedForward`` subclass of a TorchTitan FeedForward class (one per stock class)."""
    if stock not in _FEED_FORWARD_CLASSES:
        _FEED_FORWARD_CLASSES[stock] = type(f"Turbo{stock.__name__}", (GateUpFeedForward, stock), {})
    return _FEED_FORWARD_CLASSES[stock]


class TurboTopKRouter(TokenChoiceTopKRouter):
    """``TokenChoiceTopKRouter.forward`` in one fused routing kernel (incl. group-limited routing).

    Same results as the stock router for the semantics ``router_semantics_problem`` accepts: softmax over
    all experts or sigmoid, each with or without ``route_norm`` (``norm_topk``); group-limited routing that
    ranks groups by the sum of their top-2 scores (top_k / num_limited_groups == 2, as DeepSeek-V2/V3).
    """

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None):
        logits = self.gate(x)
        probs, _, indices = fused_topk_routing(
            logits.float(), self.top_k, score_function=self.score_func,
            use_pre_softmax=self.score_func == "softmax", num_groups=self.num_expert_groups,
            topk_groups=self.num_limited_groups, scaling_factor=self.route_scale, expert_bias=expert_bias,
            norm_topk=bool(self.route_norm), return_indices=True,
        )  # fmt: skip
        top_scores = probs.gather(1, indices)
        # int64 counts like CUDA histc on int64 indices (sync-free; defined on CPU, where histc is not)
        flat = indices.view(-1)
        num_tokens_per_expert = torch.zeros(self.num_experts, device=x.device, dtype=flat.dtype)
        num_tokens_per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        return top_scores, indices, num_tokens_per_expert


class TurboMoE(MoE):
    """``MoE.forward`` with the token reorder, gather and un-sort in turbo's permute / unpermute kernels.

    Stock: argsort by expert + ``histc`` + an index gather of [T*K, dim], then a zero-filled [T*K, dim]
    scatter and a batched matmul with the scores. Here: ``token_permute`` groups the tokens by expert
    (ascending expert id; within an expert, token order: the layout TorchTitan's ExpertParallel all-to-all
    expects) and ``token_unpermute`` sums each token's K expert outputs weighted by its scores in fp32,
    one pass each way. ``score_before_experts`` scales the permuted rows instead (the probs travel with
    them). With an fp32 residual stream (TorchTitan's single-device AMP) and the turbo experts, the permute
    writes the bf16 rows the experts read and the unpermute sums their bf16 outputs into fp32 tokens: no
    cast passes over the top_k-times larger permuted buffer, and bitwise the same values either way."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        # the router gate and the shared experts cast the same fp32 tokens under autocast: once here (the
        # permute keeps reading fp32 x, so its gradient is summed over the K routes in fp32 as before)
        x_router, x_shared = autocast_inputs(x, 2) if self.shared_experts is not None else (x, None)
        top_scores, selected, num_tokens_per_expert = self.router(x_router, self.expert_bias)
        with torch.no_grad():  # expert-bias balancing / usage counts, as the stock forward keeps them
            self.tokens_per_expert.add_(num_tokens_per_expert)
        out_experts = self._routed_experts(x, top_scores, selected)
        if self.shared_experts is None:
            return out_experts.reshape(bs, slen, dim)
        return (self.shared_experts(x_shared) + out_experts).reshape(bs, slen, dim)

    def _routed_experts(self, x, top_scores, selected) -> torch.Tensor:
        before = self.score_before_experts
        rows_dtype = x.dtype  # the scores scale fp32 rows before the experts' cast: kept as stock
        if not before and x.dtype == torch.float32 and isinstance(self.experts, TurboGroupedExperts):
            rows_dtype = TurboGroupedExperts.input_dtype(x)
        routed_input, routed_scores, row_id_map, tokens_per_expert = token_permute(
            x, selected, top_scores if before else None, num_out_tokens=x.shape[0] * self.router.top_k,
            num_experts=self.router.num_experts, out_dtype=rows_dtype,
        )  # fmt: skip
        if before:
            routed_input = (routed_input.float() * routed_scores.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, tokens_per_expert)
        return token_unpermute(routed_output, row_id_map, None if before else top_scores, out_dtype=x.dtype)


class TurboEPMoE(TurboMoE):
    """``TurboMoE`` with expert parallelism done by ``turbo.modules.TokenDispatcher``: ``moe_dispatch`` sends
    each token once to every EP rank owning one of its top-k experts (with its local expert ids and probs),
    ``token_permute`` groups the received rows by local expert, and ``moe_combine`` returns each rank's
    per-token partial sum (the probs merged in the unpermute, or applied to the rows before the experts).

    Replaces TorchTitan's ExpertParallel all-to-all (a host sync on the split sizes, one row per (token,
    expert) pair, a second permute on the receiver). The EP group is the one TorchTitan's ExpertParallel
    sharded the experts over (``leave_token_exchange_to_turbo``); backends: ``kernels/moe/dispatch_impl.py``
    (NCCL: one host sync per dispatch; TURBO: none)."""

    def _routed_experts(self, x, top_scores, selected) -> torch.Tensor:
        group = getattr(self.experts, "ep_group", None)
        if group is None:
            raise RuntimeError(
                "TurboEPMoE: the experts carry no EP group, so TorchTitan's ExpertParallel._apply did not "
                "shard them with turbo.dispatch (another EP style ran?); refusing to run the MoE rank-locally"
            )
        before = self.score_before_experts
        cached = getattr(self, "_turbo_ep_dispatcher", None)  # a tuple: not registered as a submodule
        if cached is None or cached[0] is not group:
            dispatcher = TokenDispatcher(
                self.router.num_experts, self.router.top_k, group, probs_in_experts=before
            )
            cached = self._turbo_ep_dispatcher = (group, dispatcher)
        dispatcher = cached[1]
        routed_input, tokens_per_expert, routed_scores = dispatcher.token_dispatch(x, top_scores, selected)
        if before:
            routed_input = (routed_input.float() * routed_scores.reshape(-1, 1)).to(x.dtype)
        # With the NCCL backend the buffer holds exactly the local (token, expert) pairs; with TURBO (no host
        # sync) it is an upper bound whose rows after the last group are zeros. Turbo grouped GEMMs skip rows
        # past the groups (zero outputs, no GEMM time, no weight-gradient share); the stock experts'
        # torch._grouped_mm would leave them uninitialised, so there they join the last expert's group (zero
        # rows add nothing to outputs, weight gradients or FP8 amax; they do cost GEMM time).
        group_lens = tokens_per_expert.to(torch.int64)
        if not isinstance(self.experts, TurboGroupedExperts):
            tail = routed_input.shape[0] - group_lens.sum()
            group_lens = torch.cat([group_lens[:-1], group_lens[-1:] + tail])
        return dispatcher.token_combine(self.experts(routed_input, group_lens)).to(x.dtype)


_STOCK_EP_APPLY = ExpertParallel._apply


def _expert_parallel_apply(self, module: nn.Module, device_mesh):
    if not getattr(module, "turbo_dispatch", False):
        return _STOCK_EP_APPLY(self, module, device_mesh)
    module.ep_group = device_mesh.get_group()
    return distribute_module(module, device_mesh, partition_fn=self._partition_fn)


def leave_token_exchange_to_turbo() -> None:
    """Patch ``ExpertParallel._apply`` (idempotent): for experts marked ``turbo_dispatch`` it still shards
    w1/w2/w3 on dim 0 over the EP mesh (the same DTensor parameters and checkpoints) and records the EP
    process group on the module for ``TurboEPMoE``, but installs no ``_token_dispatch`` / ``_token_combine``
    hooks. Unmarked experts (a stock model in the same process) get the stock ``_apply``."""
    ExpertParallel._apply = _expert_parallel_apply


def router_semantics_problem(router: TokenChoiceTopKRouter) -> str | None:
    """Why the fused routing kernel would route ``router`` differently from the stock one (None: same)."""
    if router._debug_force_load_balance:
        return "debug.moe_force_load_balance is set"
    if router.num_expert_groups and router.top_k // (router.num_limited_groups or 1) != 2:
        return (
            f"group-limited routing with top_k/num_limited_groups = {router.top_k}/"
            f"{router.num_limited_groups} != 2 (TorchTitan ranks groups by their top-2 sum)"
        )
    return None
