"""FP8 grouped GEMM for MoE experts: ``turbo.ops.grouped_gemm_fp8`` (forward + backward), sync-free.

Quantization (``config.granularity``; every operand quantized along its reduction axis):

* forward  a: tensor / row along K / 1x128 along K;  b: tensor / row along K / 128x128 blocks.
* dgrad    grad_out: same granularity along N;  b (with trans_b; BLOCKWISE also needs N % 128 == 0):
           a transposed (K-major) fp8 copy made in the forward's quantization pass (ROWWISE: one
           scale per K column shared by the experts, see ``_quant_weight_with_dgrad_copy``);
           otherwise the forward's copy (TENSORWISE; BLOCKWISE: 128x128 scales are symmetric) or
           requantized along N (ROWWISE).
* wgrad    the reduction axis is the per-expert token range. TENSORWISE: one scale per tensor;
           ROWWISE and BLOCKWISE: one scale per column of a and of grad_out over all tokens (it
           factors out of every expert's sum, so no scale straddles an expert boundary). The fp8
           operands are token-contiguous transposed copies made in the same pass as the forward /
           dgrad copies (``quantize_fp8_with_transpose``), the layout Hopper FP8 MMAs read.

``config.high_precision_wgrad``: the wgrad is the bf16 variable-K grouped GEMM of the high-precision
a (saved instead of its FP8 transposed copy) and grad_out; only the forward/dgrad copies are quantized.

Gradients use ``config.format.bwd_dtype`` (E5M2 for HYBRID). Saved for backward: the fp8
transposed a (not the bf16 a), and the fp8 weight copy (or b itself for ROWWISE).

Pre-quantized weights: ``quantize_grouped_weight(b, config)`` makes the forward and dgrad copies
once (a ``GroupedFloat8Weight``, the grouped analogue of ``Float8Tensor`` for ``gemm_fp8``); passed
as ``b`` it replaces the per-call weight quantization, e.g. once per optimizer step under gradient
accumulation. The gradient then flows to its ``source``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingStrategy
from primus_turbo.pytorch.core.main_grad import (
    accumulate_into_main_grads_,
    add_into_grads,
    split_for_autograd,
)
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
    SCALE_BLOCKWISE,
    SCALE_ROWWISE,
    SCALE_TENSORWISE,
    grouped_gemm_fp8_impl,
    grouped_gemm_fp8_variable_k_impl,
)
from primus_turbo.pytorch.ops.grouped_gemm import (
    check_main_grad_into,
    check_wgrad_into,
    grouped_gemm,
    grouped_wgrad,
    validate_grouped_gemm_args,
    wgrad_into_main_grads,
    wgrad_into_weights,
)
from primus_turbo.pytorch.ops.quantization import quantize_fp8, quantize_fp8_with_transpose

__all__ = ["grouped_gemm_fp8", "GroupedFloat8Weight", "quantize_grouped_weight"]

_MODE = {
    ScalingGranularity.TENSORWISE: SCALE_TENSORWISE,
    ScalingGranularity.ROWWISE: SCALE_ROWWISE,
    ScalingGranularity.BLOCKWISE: SCALE_BLOCKWISE,
}
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _quant_act(x, dtype, mode):
    """x [M, R] quantized along R -> (q, scale in the kernel's a_scale layout)."""
    if mode == SCALE_TENSORWISE:
        q, s = quantize_fp8(x, dtype, ScalingGranularity.TENSORWISE)
        return q, s.reshape(1)
    if mode == SCALE_ROWWISE:
        q, s = quantize_fp8(x, dtype, ScalingGranularity.ROWWISE)
        return q, s[:, 0]
    return quantize_fp8(x, dtype, ScalingGranularity.BLOCKWISE, block_size=128)


def _quant_weight(w, dtype, mode):
    """w [G, O, R] quantized along R -> (q [G, O, R], scale [G, O] / [G, O/128, R/128] / [1])."""
    if mode == SCALE_TENSORWISE:
        q, s = quantize_fp8(w, dtype, ScalingGranularity.TENSORWISE)
        return q, s.reshape(1)
    if mode == SCALE_ROWWISE:
        q, s = quantize_fp8(w, dtype, ScalingGranularity.ROWWISE)
        return q, s[..., 0]
    return quantize_fp8(w, dtype, ScalingGranularity.BLOCKWISE, block_size=(128, 128))


def _as_kernel_b(q, s, mode, groups):
    """(q [G, O, R], s) -> (b_view [G, R, O], b_scale in the kernel layout)."""
    if mode == SCALE_TENSORWISE:
        return q.transpose(1, 2), s.expand(groups)
    if mode == SCALE_ROWWISE:
        return q.transpose(1, 2), s
    return q.transpose(1, 2), s.transpose(1, 2)


def _per_group(scale, groups):
    return scale.reshape(1).expand(groups).contiguous()


def _quant_for_wgrad(x, dtype, mode):
    """x [M, R] -> (x_t view [M, R] of a token-contiguous [R, M] fp8 copy, its wgrad scale).

    TENSORWISE: one scale (expanded per group by the caller); ROWWISE/BLOCKWISE: one scale per
    column of x over all tokens ([R]): it factors out of every expert's sum over tokens.
    """
    if mode == SCALE_TENSORWISE:
        _, _, q_t, s_t = quantize_fp8_with_transpose(x, dtype, ScalingGranularity.TENSORWISE)
        return q_t.t(), s_t.reshape(1)
    _, _, q_t, s_t = quantize_fp8_with_transpose(x, dtype, ScalingGranularity.ROWWISE)
    return q_t.t(), s_t.reshape(-1)


def _quant_act_and_wgrad(x, dtype, mode):
    """Both quantized copies of x in one fused pass where the granularities allow it."""
    if mode == SCALE_TENSORWISE:
        q, s, q_t, _ = quantize_fp8_with_transpose(x, dtype, ScalingGranularity.TENSORWISE)
        return (q, s.reshape(1)), (q_t.t(), s.reshape(1))
    if mode == SCALE_ROWWISE:
        q, s, q_t, s_t = quantize_fp8_with_transpose(x, dtype, ScalingGranularity.ROWWISE)
        return (q, s[:, 0]), (q_t.t(), s_t.reshape(-1))
    return _quant_act(x, dtype, mode), _quant_for_wgrad(x, dtype, mode)


def _quant_weight_with_dgrad_copy(b, dtype, mode):
    """b [G, N, K]: the forward copy (scaled along K) and the dgrad copy in one fused pass over b
    (``quantize_fp8_with_transpose`` of b as [G*N, K]).

    The dgrad copy is the [K, G*N] transpose: reduction axis N contiguous, the K-major operand
    layout Hopper FP8 MMAs need (the forward copy read as [G, N, K] is MN-major). TENSORWISE: the
    same single scale; BLOCKWISE: the transposed 128x128 blocks (needs N % 128 == 0). ROWWISE:
    scaled along G*N, one scale per k shared by all experts; it is along the dgrad output axis
    (dA[:, k] = sum_n dC[:, n] * W_g[n, k]), so it factors out of every expert's sum exactly and
    only costs precision if experts' weight magnitudes in one column differ by orders of
    magnitude. This replaces (ROWWISE) a bf16 transpose copy of b plus a second quantization pass
    in every backward.
    Returns (qw [G, N, K], sw, (dgrad b_view [G, N, K] strided view, dgrad scale)).
    """
    g, n, k = b.shape
    if mode == SCALE_BLOCKWISE:  # 128x128 blocks of [G*N, K] (N % 128 == 0) and of its transpose
        q, s, q_t, s_t = quantize_fp8_with_transpose(
            b.reshape(g * n, k), dtype, ScalingGranularity.BLOCKWISE, block_size=(128, 128)
        )
        nb = n // 128
        sw = s.reshape(g, nb, s.shape[-1])  # [G, N/128, K/128]
        dgrad_scale = s_t.reshape(s_t.shape[0], g, nb).permute(1, 2, 0)  # [G, N/128, K/128]
        return q.view(g, n, k), sw, (q_t.view(k, g, n).permute(1, 2, 0), dgrad_scale)
    gran = ScalingGranularity.TENSORWISE if mode == SCALE_TENSORWISE else ScalingGranularity.ROWWISE
    q, s, q_t, s_t = quantize_fp8_with_transpose(b.reshape(g * n, k), dtype, gran)
    dgrad_view = q_t.view(k, g, n).permute(1, 2, 0)  # [G, N(reduce), K(out)], N contiguous
    if mode == SCALE_TENSORWISE:
        return q.view(g, n, k), s.reshape(1), (dgrad_view, s_t.reshape(1))
    return q.view(g, n, k), s.reshape(g, n), (dgrad_view, s_t.reshape(1, k).expand(g, k))


def _quant_b(b, trans_b, dtype, mode, need_dgrad):
    """b -> (qw [G, N, K] scaled along K, its scale, saved_w: what the dgrad reads)."""
    blocks_fit = mode != SCALE_BLOCKWISE or b.shape[1] % 128 == 0  # no block straddles experts
    if trans_b and blocks_fit and need_dgrad:
        return _quant_weight_with_dgrad_copy(b, dtype, mode)
    w_nk = b if trans_b else b.transpose(1, 2).contiguous()  # [G, N, K]: reduce along K
    qw, sw = _quant_weight(w_nk, dtype, mode)
    # ROWWISE dgrad requantizes b along N; the other modes reuse the forward's weight copy
    return qw, sw, ((b,) if mode == SCALE_ROWWISE else (qw, sw))


@dataclass
class GroupedFloat8Weight:
    """An expert weight b [G, N, K] (the ``trans_b=True`` layout) quantized once, e.g. per optimizer
    step, for ``grouped_gemm_fp8``: what the op's forward would otherwise quantize on every call.

    ``data`` [G, N, K] fp8 scaled along K with ``scale_inv`` (the forward operand), ``dgrad``: the
    operands the dgrad reads (the fused K-major copy and its scales, or ``data``/``scale_inv``
    themselves for BLOCKWISE with N % 128 != 0). Like ``Float8Tensor`` it is a plain container:
    the weight gradient flows to ``source``, a high-precision [G, N, K] tensor of which the op uses
    only the shape, dtype, device and autograd history, never the values (a caller may pass a
    stand-in, e.g. ``dataclasses.replace(w8, source=...)`` per call); None: no weight gradient.
    Make one with :func:`quantize_grouped_weight`.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    dgrad: tuple[torch.Tensor, ...]
    granularity: ScalingGranularity
    source: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def quantize_grouped_weight(b: torch.Tensor, config: Float8QuantConfig | None = None) -> GroupedFloat8Weight:
    """Quantize b [G, N, K] (bf16/fp16/fp32) as ``grouped_gemm_fp8(a, ., trans_b=True, config=config)``
    reads it: the forward copy and the dgrad copy in one fused pass. ``source`` is b."""
    config = _check_config(config)
    if not isinstance(b, torch.Tensor) or b.dim() != 3 or b.dtype not in _OUT_DTYPES:
        raise TypeError(
            f"quantize_grouped_weight: b must be a 3-D [G, N, K] tensor of one of {_OUT_DTYPES}, got "
            f"{getattr(b, 'dtype', type(b).__name__)} {tuple(getattr(b, 'shape', ()))}"
        )
    mode = _MODE[config.granularity]
    qw, sw, dgrad = _quant_b(b.detach().contiguous(), True, config.format.fwd_dtype, mode, True)
    return GroupedFloat8Weight(qw, sw, tuple(dgrad), config.granularity, source=b)


class GroupedGemmFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, trans_b, config, out_dtype, b_fp8, main_grad_into, *wgrad_into):
        # b_fp8: a GroupedFloat8Weight made from b (b is then only the gradient's destination)
        mode = _MODE[config.granularity]
        fwd_dtype = config.format.fwd_dtype
        groups = b.shape[0]
        ctx.wgrad_into = wgrad_into  # the Parameter objects: their .grad is read and written in backward
        ctx.main_grad_into = main_grad_into  # a tuple, not autograd inputs: no edge to the weights
        wgrad_needed = ctx.needs_input_grad[1] or bool(wgrad_into) or bool(main_grad_into)
        ctx.hp_wgrad = config.high_precision_wgrad and wgrad_needed
        if ctx.hp_wgrad:  # the wgrad reads a itself (saved below in place of its FP8 copy)
            (qa, sa), qa_t, sa_t = _quant_act(a, fwd_dtype, mode), a, None
        elif wgrad_needed:
            (qa, sa), (qa_t, sa_t) = _quant_act_and_wgrad(a, fwd_dtype, mode)
        else:
            (qa, sa), qa_t, sa_t = _quant_act(a, fwd_dtype, mode), None, None
        if b_fp8 is not None:
            qw, sw, saved_w = b_fp8.data, b_fp8.scale_inv, b_fp8.dgrad
        else:
            qw, sw, saved_w = _quant_b(b, trans_b, fwd_dtype, mode, ctx.needs_input_grad[0])
        b_view, b_scale = _as_kernel_b(qw, sw, mode, groups)
        out = grouped_gemm_fp8_impl(qa, b_view, sa, b_scale, group_lens, mode, out_dtype)
        ctx.save_for_backward(group_lens, qa_t, sa_t, *saved_w)
        ctx.mode, ctx.trans_b, ctx.config = mode, trans_b, config
        ctx.a_dtype, ctx.b_dtype, ctx.groups = a.dtype, b.dtype, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):
        group_lens, qa_t, sa_t, *saved_w = ctx.saved_tensors
        mode, trans_b, config, groups = ctx.mode, ctx.trans_b, ctx.config, ctx.groups
        bwd_dtype = config.format.bwd_dtype
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        weights, main_grads = ctx.wgrad_into, ctx.main_grad_into
        fused_into = bool(weights) and ctx.hp_wgrad and not torch.is_grad_enabled()
        wgrad_needed = ctx.needs_input_grad[1] or bool(weights) or bool(main_grads)
        fp8_wgrad = wgrad_needed and not ctx.hp_wgrad
        if ctx.needs_input_grad[0] and fp8_wgrad:
            (qg, sg), (qg_t, sg_t) = _quant_act_and_wgrad(grad_out, bwd_dtype, mode)
        elif ctx.needs_input_grad[0]:
            qg, sg = _quant_act(grad_out, bwd_dtype, mode)
        elif fp8_wgrad:
            qg_t, sg_t = _quant_for_wgrad(grad_out, bwd_dtype, mode)
        if ctx.needs_input_grad[0]:
            if mode == SCALE_ROWWISE and len(saved_w) == 2:  # the forward's transposed copy
                b_view, b_scale = saved_w
            elif mode == SCALE_ROWWISE:  # requantize the weight along N (the dgrad reduction)
                (b,) = saved_w
                w_kn = b.transpose(1, 2).contiguous() if trans_b else b
                qw_kn, sw_kn = _quant_weight(w_kn, config.format.fwd_dtype, mode)
                b_view, b_scale = qw_kn.transpose(1, 2), sw_kn
            else:  # [G, reduce=N, out=K]: the K-major copy, or qw itself (symmetric 128x128 scales)
                b_view, sw = saved_w
                b_scale = sw.expand(groups) if mode == SCALE_TENSORWISE else sw
            grad_a = grouped_gemm_fp8_impl(qg, b_view, sg, b_scale, group_lens, mode, ctx.a_dtype)
        if main_grads and ctx.hp_wgrad:  # the bf16 wgrad summed into Megatron's main_grads inside the GEMM
            wgrad_into_main_grads(qa_t, grad_out, group_lens, main_grads)
        elif fused_into:  # the bf16 wgrad summed into the weights' .grad inside the GEMM
            wgrad_into_weights(qa_t, grad_out, group_lens, weights)
        elif ctx.hp_wgrad:
            grad_b = grouped_wgrad(qa_t, grad_out, group_lens, trans_b).to(ctx.b_dtype)
        elif wgrad_needed:
            wmode = SCALE_TENSORWISE if mode == SCALE_TENSORWISE else SCALE_ROWWISE
            if wmode == SCALE_TENSORWISE:
                sx, sg_t = _per_group(sa_t, groups), _per_group(sg_t, groups)
            else:
                sx = sa_t
            if trans_b:  # dW[g] = dC_g^T @ A_g  ([N, K])
                grad_b = grouped_gemm_fp8_variable_k_impl(
                    qg_t, qa_t, sg_t, sx, group_lens, wmode, ctx.b_dtype
                )
            else:  # dB[g] = A_g^T @ dC_g  ([K, N])
                grad_b = grouped_gemm_fp8_variable_k_impl(
                    qa_t, qg_t, sx, sg_t, group_lens, wmode, ctx.b_dtype
                )
        if main_grads and grad_b is not None:  # the FP8 wgrad: added in one pass; b gets no gradient
            accumulate_into_main_grads_(main_grads, grad_b)
            grad_b = None
        if not weights:
            return grad_a, grad_b, None, None, None, None, None, None
        to_weights = (None,) * len(weights)
        if grad_b is not None and torch.is_grad_enabled():  # create_graph: differentiable, through autograd
            to_weights = split_for_autograd(grad_b, weights)
        elif grad_b is not None:  # the FP8 wgrad: added in one pass
            add_into_grads(weights, grad_b)
        # b itself gets none (its gradient went to the weights; a b cast from them would pass it twice)
        return grad_a, None, None, None, None, None, None, None, *to_weights


def _check_config(config) -> Float8QuantConfig:
    config = Float8QuantConfig() if config is None else config
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"grouped_gemm_fp8: config must be a Float8QuantConfig, got {type(config).__name__}")
    if config.strategy is not ScalingStrategy.CURRENT:
        raise ValueError(f"grouped_gemm_fp8: config.strategy must be CURRENT, got {config.strategy.name}")
    if config.granularity is ScalingGranularity.BLOCKWISE and config.block_size != 128:
        raise ValueError(f"grouped_gemm_fp8: BLOCKWISE supports block_size=128, got {config.block_size}")
    return config


def _check_prequantized(b: GroupedFloat8Weight, a: torch.Tensor, trans_b, config) -> torch.Tensor:
    """A pre-quantized b must match config and trans_b; returns the tensor that stands for b."""
    if not trans_b:
        raise ValueError("grouped_gemm_fp8: a GroupedFloat8Weight b is [G, N, K]: it needs trans_b=True")
    if b.granularity is not config.granularity or b.data.dtype != config.format.fwd_dtype:
        raise ValueError(
            f"grouped_gemm_fp8: b was quantized {b.granularity.name} {b.data.dtype}, config asks "
            f"{config.granularity.name} {config.format.fwd_dtype}"
        )
    if b.source is None:  # no gradient: a zero-storage stand-in for the shape/dtype checks
        dtype = a.dtype if isinstance(a, torch.Tensor) else torch.bfloat16
        return torch.empty((), dtype=dtype, device=b.data.device).expand(b.shape)
    if b.source.shape != b.shape:
        raise ValueError(f"grouped_gemm_fp8: b.source is {tuple(b.source.shape)}, b.data {tuple(b.shape)}")
    return b.source


def grouped_gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor | GroupedFloat8Weight,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None = None,
    trans_b: bool = True,
    out_dtype: torch.dtype | None = None,
    config: Float8QuantConfig | None = None,
    *,
    wgrad_into=None,
    main_grad_into=None,
) -> torch.Tensor:
    """FP8 grouped GEMM with bf16/fp16/fp32 inputs quantized on the fly (see the module docstring).

    Args as :func:`grouped_gemm` (``b`` [G, N, K] by default: ``trans_b=True``; or a
    :class:`GroupedFloat8Weight` from :func:`quantize_grouped_weight`, quantized once by the caller
    with the same config, which skips the weight quantization), plus
        out_dtype: bf16/fp16/fp32 output (default: a's dtype);
        config: Float8QuantConfig (default E4M3 TENSORWISE); BLOCKWISE needs block_size 128;
            DELAYED scaling is not supported here (current scaling only);
        wgrad_into: as in :func:`grouped_gemm` (with ``config.high_precision_wgrad`` the bf16 wgrad sums into
            the weights' ``.grad`` inside the GEMM; the FP8 wgrad is added in one pass);
        main_grad_into: as in :func:`grouped_gemm` (the bf16 wgrad of ``config.high_precision_wgrad`` sums
            into the main_grads inside the GEMM; the FP8 wgrad is added in one pass).

    Rows of ``a`` past sum(group_lens) (an upper-bound buffer) must be zeros or no larger than the real
    rows, unlike :func:`grouped_gemm`, where they may hold anything: they enter TENSORWISE's amax and the
    column scales of the wgrad's FP8 copy, so large finite values there coarsen the real rows' quantization
    (NaN / inf are skipped). ``token_permute(zero_fill=True)`` and ``TokenDispatcher`` give zeros.

    Sync-free like grouped_gemm (CUDA-graph capturable) except with the TORCH backend, the CPU
    default; PRIMUS_TURBO_DEBUG_CHECKS=1 enables the host-syncing value checks on group_lens.
    Backends (PRIMUS_TURBO_GROUPED_GEMM_BACKEND, precision key ``fp8``): CUTLASS
    (torch._scaled_grouped_mm, ROWWISE/TENSORWISE E4M3 with bf16 output, sm_90; the wgrad only when
    ``GroupedGemmFP8VariableKDispatcher.group_lens_multiple_of_16`` promises every expert a
    multiple of 16 tokens), TRITON (all; TMA kernels where the reduction axis is contiguous and the
    scales TENSORWISE / ROWWISE, the default forward and dgrad on sm_90), TORCH (reference).
    """
    config = _check_config(config)
    b_fp8 = b if isinstance(b, GroupedFloat8Weight) else None
    if b_fp8 is not None:
        b = _check_prequantized(b_fp8, a, trans_b, config)  # never read: no .contiguous() copy
    validate_grouped_gemm_args("grouped_gemm_fp8", a, b, group_lens, group_offs, trans_b, _OUT_DTYPES)
    group_lens = group_lens.to(torch.int64).contiguous()  # int32 accepted; the kernels index it flat
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"grouped_gemm_fp8: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    weights = check_wgrad_into("grouped_gemm_fp8", b, trans_b, wgrad_into)
    main_grads = check_main_grad_into("grouped_gemm_fp8", b, trans_b, main_grad_into, wgrad_into)
    if a.shape[0] == 0 or a.shape[1] == 0:  # nothing to quantize: the exact (zero/empty) answer
        # (b's values do not matter with no rows or K == 0; a stand-in b is materialized here)
        return grouped_gemm(
            a, b, group_lens, trans_b=trans_b, wgrad_into=weights or None, main_grad_into=main_grads or None
        ).to(out_dtype)
    return GroupedGemmFP8Function.apply(
        a.contiguous(), b if b_fp8 is not None else b.contiguous(), group_lens, bool(trans_b), config,
        out_dtype, b_fp8, main_grads, *weights,
    )  # fmt: skip
