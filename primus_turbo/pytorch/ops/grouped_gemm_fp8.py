"""FP8 grouped GEMM for MoE experts: ``turbo.ops.grouped_gemm_fp8`` (forward + backward), sync-free.

Quantization (``config.granularity``; operands quantized along their reduction axis):

============  ==========================  ============================  ===========================
granularity   forward a / b               dgrad grad_out / b            wgrad a, grad_out (per op)
============  ==========================  ============================  ===========================
TENSORWISE    tensor / tensor             tensor / tensor (fwd b reused) tensor (fwd a reused)
ROWWISE       row along K / row along K   row along N / b requantized   tensor
                                          along N
BLOCKWISE     1x128 / 128x128             1x128 along N / fwd 128x128   tensor
                                          blocks reused (symmetric)
============  ==========================  ============================  ===========================

Gradients use ``config.format.bwd_dtype`` (E5M2 for HYBRID). The variable-K wgrad uses tensorwise
scales for every granularity: its reduction axis is the per-expert token range, which row/1x128
scales along tokens would have to align with expert boundaries (a known gap, see the kernels'
docstring; the kernel already takes per-group scales).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity, ScalingStrategy
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_fp8_impl import (
    SCALE_BLOCKWISE,
    SCALE_ROWWISE,
    SCALE_TENSORWISE,
    grouped_gemm_fp8_impl,
    grouped_gemm_fp8_variable_k_impl,
)
from primus_turbo.pytorch.ops.grouped_gemm import grouped_gemm, validate_grouped_gemm_args
from primus_turbo.pytorch.ops.quantization import quantize_fp8

__all__ = ["grouped_gemm_fp8"]

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


class GroupedGemmFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, trans_b, config, out_dtype):
        mode = _MODE[config.granularity]
        fwd_dtype = config.format.fwd_dtype
        groups = b.shape[0]
        w_nk = b if trans_b else b.transpose(1, 2).contiguous()  # [G, N, K]: reduce along K
        qa, sa = _quant_act(a, fwd_dtype, mode)
        qw, sw = _quant_weight(w_nk, fwd_dtype, mode)
        b_view, b_scale = _as_kernel_b(qw, sw, mode, groups)
        out = grouped_gemm_fp8_impl(qa, b_view, sa, b_scale, group_lens, mode, out_dtype)
        if mode == SCALE_ROWWISE:
            ctx.save_for_backward(a, b, group_lens, qa, sa)
        else:
            ctx.save_for_backward(a, b, group_lens, qa, sa, qw, sw)
        ctx.mode, ctx.trans_b, ctx.config = mode, trans_b, config
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_lens, qa, sa, *saved_w = ctx.saved_tensors
        mode, trans_b, config = ctx.mode, ctx.trans_b, ctx.config
        bwd_dtype, groups = config.format.bwd_dtype, b.shape[0]
        grad_out = grad_out.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            qg, sg = _quant_act(grad_out, bwd_dtype, mode)
            if mode == SCALE_ROWWISE:  # requantize the weight along N (the dgrad reduction)
                w_kn = b.transpose(1, 2).contiguous() if trans_b else b
                qw_kn, sw_kn = _quant_weight(w_kn, config.format.fwd_dtype, mode)
                b_view, b_scale = qw_kn.transpose(1, 2), sw_kn
            else:  # qw [G, N, K] is already [G, reduce=N, out=K]; 128x128 block scales are symmetric
                qw, sw = saved_w
                b_view = qw
                b_scale = sw.expand(groups) if mode == SCALE_TENSORWISE else sw
            grad_a = grouped_gemm_fp8_impl(qg, b_view, sg, b_scale, group_lens, mode, a.dtype)
        if ctx.needs_input_grad[1]:
            if mode == SCALE_TENSORWISE:
                qx, sx = qa, sa
                if not ctx.needs_input_grad[0]:
                    qg, sg = _quant_act(grad_out, bwd_dtype, mode)
            else:
                qx, sx = _quant_act(a, config.format.fwd_dtype, SCALE_TENSORWISE)
                qg, sg = _quant_act(grad_out, bwd_dtype, SCALE_TENSORWISE)
            sx, sg = _per_group(sx, groups), _per_group(sg, groups)
            if trans_b:  # dW[g] = dC_g^T @ A_g  ([N, K])
                grad_b = grouped_gemm_fp8_variable_k_impl(qg, qx, sg, sx, group_lens, b.dtype)
            else:  # dB[g] = A_g^T @ dC_g  ([K, N])
                grad_b = grouped_gemm_fp8_variable_k_impl(qx, qg, sx, sg, group_lens, b.dtype)
        return grad_a, grad_b, None, None, None, None


def grouped_gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None = None,
    trans_b: bool = True,
    out_dtype: torch.dtype | None = None,
    config: Float8QuantConfig | None = None,
) -> torch.Tensor:
    """FP8 grouped GEMM with bf16/fp16/fp32 inputs quantized on the fly (see the module docstring).

    Args as :func:`grouped_gemm` (``b`` [G, N, K] by default: ``trans_b=True``), plus
        out_dtype: bf16/fp16/fp32 output (default: a's dtype);
        config: Float8QuantConfig (default E4M3 TENSORWISE); BLOCKWISE needs block_size 128;
            DELAYED scaling is not supported here (current scaling only).

    Sync-free like grouped_gemm (CUDA-graph capturable) except with the TORCH backend, the CPU
    default; PRIMUS_TURBO_DEBUG_CHECKS=1 enables the host-syncing value checks on group_lens.
    Backends (PRIMUS_TURBO_GROUPED_GEMM_BACKEND, precision key ``fp8``): CUTLASS
    (torch._scaled_grouped_mm, ROWWISE E4M3 with bf16 output), TRITON (all), TORCH (reference).
    """
    config = Float8QuantConfig() if config is None else config
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"grouped_gemm_fp8: config must be a Float8QuantConfig, got {type(config).__name__}")
    if config.strategy is not ScalingStrategy.CURRENT:
        raise ValueError(f"grouped_gemm_fp8: config.strategy must be CURRENT, got {config.strategy.name}")
    if config.granularity is ScalingGranularity.BLOCKWISE and config.block_size != 128:
        raise ValueError(f"grouped_gemm_fp8: BLOCKWISE supports block_size=128, got {config.block_size}")
    validate_grouped_gemm_args("grouped_gemm_fp8", a, b, group_lens, group_offs, trans_b, _OUT_DTYPES)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"grouped_gemm_fp8: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if a.shape[0] == 0 or a.shape[1] == 0:  # nothing to quantize: the exact (zero/empty) answer
        return grouped_gemm(a, b, group_lens, trans_b=trans_b).to(out_dtype)
    return GroupedGemmFP8Function.apply(
        a.contiguous(), b.contiguous(), group_lens, bool(trans_b), config, out_dtype
    )
