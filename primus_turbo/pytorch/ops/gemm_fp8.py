"""``turbo.ops.gemm_fp8``: C = op(a) @ op(b) with FP8 forward, dgrad and wgrad.

``a`` is [M, K] ([K, M] with ``trans_a``), ``b`` is [K, N] ([N, K] with ``trans_b``; the nn.Linear
case is ``gemm_fp8(x, weight, trans_b=True)``). Each may be a high-precision tensor (fp32/bf16/fp16;
quantized here) or a ``Float8Tensor`` (quantized once by the caller, e.g. a weight once per step).

Recipe (``config: Float8QuantConfig``):

* format: E4M3 / E5M2 everywhere, or HYBRID = E4M3 operands forward, E5M2 output gradient.
* granularity: TENSORWISE, ROWWISE (scales along the reduction axis of each GEMM), BLOCKWISE
  (``a`` and the gradient 1 x bs, ``b`` bs x bs, as DeepSeek-V3 trains; a Float8Tensor ``b`` with
  1 x bs groups also works).
* strategy: CURRENT (default) or DELAYED (TENSORWISE only; needs ``delayed_state``, a
  ``DelayedScalingState`` owned by the calling module).

Every GEMM gets K-major operands: forward reads ``a`` scaled along K and ``b^T`` scaled along K;
dgrad reads dC scaled along N and ``b`` scaled along N; wgrad reads dC^T and ``a^T`` scaled along M.
``quantize_fp8_with_transpose`` makes both copies of each operand in one pass.

``config.high_precision_wgrad``: the wgrad is a bf16 GEMM of the high-precision ``a`` (saved instead
of its FP8 transposed copy) and the output gradient; only the forward copies are quantized. With
``accumulate_into_main_grad=True`` (needs that flag; ``b`` a weight carrying an fp32 ``main_grad``)
the wgrad GEMM accumulates into ``b.main_grad`` in fp32 like ``turbo.ops.gemm``'s Megatron mode.

Sizes need not be multiples of the block: partial blocks are quantized as if zero-padded and the
TRITON/TORCH backends mask them (CUBLAS declines shapes it cannot run). M == 0 (or N == 0) gives
empty outputs and zero weight gradients.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.float8_tensor import Float8Tensor
from primus_turbo.pytorch.core.fp8_autocast import AmaxHistory, DelayedScalingState
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    Format,
    ScalingGranularity,
    ScalingStrategy,
)
from primus_turbo.pytorch.core.main_grad import check_main_grad
from primus_turbo.pytorch.core.utils import autocast_enabled_on
from primus_turbo.pytorch.kernels.gemm.gemm_fp8_impl import gemm_fp8_impl
from primus_turbo.pytorch.kernels.quantization.quantization_impl import (
    finite_amax,
    quantize_fp8_impl,
    quantize_fp8_tensorwise_static_impl,
    quantize_fp8_with_transpose_impl,
)
from primus_turbo.pytorch.ops.gemm import gemm_wgrad
from primus_turbo.pytorch.ops.quantization import normalize_spec, quantize_fp8, quantize_fp8_with_transpose

__all__ = ["gemm_fp8"]

_HP = (torch.float32, torch.bfloat16, torch.float16)
G = ScalingGranularity


class _Operand:
    """The two K-major copies of a logical matrix X: ``fwd`` = X scaled along its last axis,
    ``bwd`` = X^T scaled along X's first axis; each a (data, scale_inv) pair or None."""

    def __init__(self, fwd, bwd, block):
        self.fwd, self.bwd, self.block = fwd, bwd, block


def _recomputing() -> bool:
    """A forward that runs inside a backward pass: activation checkpointing's recomputation (reentrant or
    not). Its DELAYED amaxes were pushed by the original forward already."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def _quantize_physical(p, dtype, config, block, need_t, history: AmaxHistory | None, push: bool = True):
    """Quantize contiguous 2-D p: returns ((q, s), (qt, st) | None). ``push``: append p's amax to
    ``history`` (off for a recomputed forward)."""
    g = config.granularity
    kw = {"block_size": block, "power_of_two_scales": config.power_of_two_scales}
    if history is not None:
        if history.initialized:
            q, s, qt, amax = quantize_fp8_tensorwise_static_impl(
                p, history.scale(dtype, config.power_of_two_scales), dtype, need_t
            )
            if push:
                history.update(amax)
            return (q, s), ((qt, s) if need_t else None)
        if push:
            history.update(finite_amax(p))
    if torch.compiler.is_compiling():  # the public ops trace as opaque custom ops
        if need_t:
            q, s, qt, st = quantize_fp8_with_transpose(p, dtype, g, **kw)
            return (q, s), (qt, st)
        return quantize_fp8(p, dtype, g, **kw), None
    # eager: straight to the kernels (no custom-op layer, no defensive scale clone)
    name, axis, br, bc = normalize_spec(2, g, block, None)
    pow2 = config.power_of_two_scales
    if need_t:
        q, s, qt, st = quantize_fp8_with_transpose_impl(p, dtype, name, br, bc, pow2)
        return (q, s), (qt, st)
    return quantize_fp8_impl(p, dtype, name, axis, br, bc, pow2), None


def _prepare(x, phys_is_x, dtype, config, block, need_fwd_only, history=None, push=True) -> _Operand:
    """x: the physical tensor (hp or Float8Tensor); phys_is_x: physical == logical X (else X^T)."""
    if isinstance(x, Float8Tensor):
        main = (x.data, x.scale_inv)
        other = (x.data_t, x.scale_inv_t) if x.data_t is not None else None
        fwd, bwd = (main, other) if phys_is_x else (other, main)
        if fwd is None:
            raise ValueError(
                "Float8Tensor: this layout (trans flag) reads the transposed copy (data_t), which it does "
                "not have; build it with Float8Tensor.from_tensor(..., with_transpose=True)"
            )
        return _Operand(fwd, bwd, x.block_size)
    p = x.detach()
    p = p if p.is_contiguous() else p.contiguous()
    need_t = not (need_fwd_only and phys_is_x)
    main, other = _quantize_physical(p, dtype, config, block, need_t, history, push)
    fwd, bwd = (main, other) if phys_is_x else (other, main)
    return _Operand(fwd, bwd, block)


def _mode(granularity, b_block) -> int:
    if granularity is G.TENSORWISE:
        return 0
    if granularity is G.ROWWISE:
        return 1
    return 2 if isinstance(b_block, tuple) else 3


class _GemmFP8Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_hp, b_hp, a_f8, b_f8, trans_a, trans_b, out_dtype, config, state, accumulate):
        # a_f8/b_f8: the Float8Tensor inputs (None for high-precision ones; a tensor is never passed
        # twice, which torch.compile cannot trace)
        a_in = a_f8 if a_f8 is not None else a_hp
        b_in = b_f8 if b_f8 is not None else b_hp
        fwd_dtype, bs = config.format.fwd_dtype, config.block_size
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]  # grad mode is off in here
        hp_wgrad = config.high_precision_wgrad and ctx.needs_input_grad[1]
        a_blk = bs if config.granularity is G.BLOCKWISE else None
        b_blk = (bs, bs) if a_blk else None
        hist_a, hist_b = (state.a, state.b) if state is not None else (None, None)
        push = state is None or not _recomputing()  # one amax per forward, recomputed or not
        a_op = _prepare(a_in, not trans_a, fwd_dtype, config, a_blk, not needs_grad or hp_wgrad, hist_a, push)
        b_op = _prepare(b_in, trans_b, fwd_dtype, config, b_blk, not needs_grad, hist_b, push)
        mode = _mode(config.granularity, b_op.block)
        out = gemm_fp8_impl(*a_op.fwd, *b_op.fwd, mode, bs or 0, out_dtype, True)
        ctx.trans_a, ctx.trans_b, ctx.config, ctx.state, ctx.mode = trans_a, trans_b, config, state, mode
        ctx.b_block, ctx.hp_wgrad = b_op.block, hp_wgrad
        ctx.weight = b_hp if accumulate else None  # the Python object carries main_grad
        ctx.grad_dtypes = tuple(t.dtype if t is not None else out_dtype for t in (a_hp, b_hp))
        if needs_grad:
            # Only what the backward GEMMs read is kept: the FP8 copies (1 byte/element), or the
            # high-precision a for a high-precision wgrad.
            a_saved = (a_hp.detach(), None) if hp_wgrad else (a_op.bwd or (None, None))
            ctx.save_for_backward(*a_saved, *(b_op.bwd or (None, None)))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a_t, a_t_s, b_n, b_n_s = ctx.saved_tensors
        config, bs = ctx.config, ctx.config.block_size
        need_da, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_a = grad_b = None
        if ctx.hp_wgrad:
            grad_b = gemm_wgrad(a_t, grad_out, ctx.trans_a, ctx.trans_b, ctx.grad_dtypes[1], ctx.weight)
            need_db = False
            if not need_da:
                return grad_a, grad_b, None, None, None, None, None, None, None, None
        g_blk = bs if config.granularity is G.BLOCKWISE else None
        history = ctx.state.grad if ctx.state is not None else None
        g = _prepare(grad_out, True, config.format.bwd_dtype, config, g_blk, not need_db, history)
        if need_da:  # dA[M, K] = dC[M, N] @ B[K, N]^T  (B rows scaled along N)
            grad_a = gemm_fp8_impl(
                *g.fwd, b_n, b_n_s, _mode(config.granularity, ctx.b_block), bs or 0, ctx.grad_dtypes[0]
            )
            grad_a = grad_a.t() if ctx.trans_a else grad_a
        if need_db:
            wmode = _mode(config.granularity, g_blk)
            if ctx.trans_b:  # dB^T[N, K] = dC^T[N, M] @ A^T[K, M]^T
                grad_b = gemm_fp8_impl(*g.bwd, a_t, a_t_s, wmode, bs or 0, ctx.grad_dtypes[1])
            elif config.format is Format.HYBRID and wmode != 0:
                # dB^T = dC^T @ A^T^T with the E5M2 gradient first: cuBLAS's scaled kernels take an
                # E5M2 first operand only (dB = A^T @ dC would fall back to Triton)
                grad_b = gemm_fp8_impl(*g.bwd, a_t, a_t_s, wmode, bs or 0, ctx.grad_dtypes[1]).t()
            else:  # dB[K, N] = A^T[K, M] @ dC^T[N, M]^T
                grad_b = gemm_fp8_impl(a_t, a_t_s, *g.bwd, wmode, bs or 0, ctx.grad_dtypes[1])
        return grad_a, grad_b, None, None, None, None, None, None, None, None


def _check_operand(x, name: str, trans: bool, config: Float8QuantConfig, is_b: bool):
    if isinstance(x, Float8Tensor):
        x.check_source(name)
        if x.granularity is not config.granularity:
            raise ValueError(
                f"{name}: Float8Tensor is {x.granularity.name}, config asks {config.granularity.name}"
            )
        if x.dtype != config.format.fwd_dtype:
            raise ValueError(
                f"{name}: Float8Tensor dtype {x.dtype}, config {config.format.name} needs "
                f"{config.format.fwd_dtype}"
            )
        if config.granularity is G.BLOCKWISE:
            bs = config.block_size
            ok = (bs, bs) if is_b else bs
            if x.block_size not in ((ok, bs) if is_b else (ok,)):
                raise ValueError(
                    f"{name}: Float8Tensor block_size {x.block_size!r}; with block_size={bs} "
                    f"accepted: {ok!r}" + (f" or {bs}" if is_b else "")
                )
        return x.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or Float8Tensor, got {type(x).__name__}")
    if x.dtype not in _HP:
        raise TypeError(f"{name}: expected float32/bfloat16/float16 (or a Float8Tensor), got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(x.shape)}")
    return x.shape


def gemm_fp8(
    a: torch.Tensor | Float8Tensor,
    b: torch.Tensor | Float8Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    config: Float8QuantConfig | None = None,
    *,
    delayed_state: DelayedScalingState | None = None,
    accumulate_into_main_grad: bool = False,
) -> torch.Tensor:
    """op(a) @ op(b) in FP8 with autograd (see the module docstring). ``out_dtype`` defaults to the
    high-precision input dtype (bf16 when both inputs are Float8Tensors), and under ``torch.autocast`` to
    its dtype, as ``torch.mm`` returns; the operands are quantized from their own precision either way.
    ``accumulate_into_main_grad`` (needs ``config.high_precision_wgrad``): b's gradient is added to
    ``b.main_grad`` (b a tensor, or a Float8Tensor whose ``source`` is the weight) and a placeholder
    is returned, as ``turbo.ops.gemm`` does."""
    config = Float8QuantConfig() if config is None else config
    if not isinstance(config, Float8QuantConfig):
        raise TypeError(f"config: expected a Float8QuantConfig, got {type(config).__name__}")
    if not isinstance(trans_a, bool) or not isinstance(trans_b, bool):
        raise TypeError(f"trans_a/trans_b: expected bools, got {trans_a!r}, {trans_b!r}")
    sa = _check_operand(a, "a", trans_a, config, False)
    sb = _check_operand(b, "b", trans_b, config, True)
    m, k = (sa[1], sa[0]) if trans_a else (sa[0], sa[1])
    kb, n = (sb[1], sb[0]) if trans_b else (sb[0], sb[1])
    if k != kb:
        raise ValueError(
            f"a/b: reduction sizes differ: op(a) is {m}x{k}, op(b) is {kb}x{n} "
            f"(trans_a={trans_a}, trans_b={trans_b})"
        )
    if a.device != b.device:  # a Float8Tensor's device is its data's
        raise ValueError(f"a/b: on different devices ({a.device}, {b.device})")
    hp = [x for x in (a, b) if isinstance(x, torch.Tensor)]
    device_type = (hp[0] if hp else a.data).device.type
    autocast = autocast_enabled_on(device_type)
    if out_dtype is None:  # under torch.autocast its dtype, as torch.mm / nn.Linear return
        out_dtype = hp[0].dtype if hp else torch.bfloat16
        out_dtype = torch.get_autocast_dtype(device_type) if autocast else out_dtype
    if out_dtype not in _HP:
        raise TypeError(f"out_dtype: expected float32/bfloat16/float16, got {out_dtype}")
    if config.strategy is ScalingStrategy.DELAYED:
        if not isinstance(delayed_state, DelayedScalingState):
            raise ValueError(
                "delayed_state: DELAYED scaling needs the DelayedScalingState owned by the calling "
                f"module (e.g. Float8Linear); got {type(delayed_state).__name__}"
            )
        if not delayed_state.matches(config):
            raise ValueError(
                f"delayed_state: built for another amax history (length {delayed_state.a.history.numel()}, "
                f"'{delayed_state.a.algo}'); config asks length {config.amax_history_len}, "
                f"'{config.amax_compute_algo}': build DelayedScalingState(config)"
            )
    else:
        delayed_state = None
    a_hp = a.source if isinstance(a, Float8Tensor) else a
    b_hp = b.source if isinstance(b, Float8Tensor) else b
    grad_needed = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a_hp, b_hp))
    if grad_needed:
        _check_backward_copies(a, b, a_hp, b_hp, config.high_precision_wgrad)
    accumulate = _check_accumulate(accumulate_into_main_grad, config, b_hp, grad_needed)
    a_f8 = a if isinstance(a, Float8Tensor) else None
    b_f8 = b if isinstance(b, Float8Tensor) else None
    args = (a_hp, b_hp, a_f8, b_f8, trans_a, trans_b, out_dtype, config, delayed_state, accumulate)
    if autocast:  # the quantizers and GEMMs compute as outside autocast (its casts would round them)
        with torch.autocast(device_type, enabled=False):
            return _GemmFP8Function.apply(*args)
    return _GemmFP8Function.apply(*args)


def _check_accumulate(accumulate, config, b_hp, grad_needed) -> bool:
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate_into_main_grad: expected a bool, got {accumulate!r}")
    if not accumulate:
        return False
    if not config.high_precision_wgrad:
        raise ValueError(
            "accumulate_into_main_grad=True needs config.high_precision_wgrad=True (the FP8 wgrad "
            "GEMM writes a bf16 gradient; the fused fp32 accumulation is the high-precision wgrad's)"
        )
    if b_hp is None:
        raise ValueError("accumulate_into_main_grad=True: b is a Float8Tensor without a source weight")
    if grad_needed and b_hp.requires_grad:
        check_main_grad(b_hp, "gemm_fp8", "b")
    return b_hp.requires_grad


def _check_backward_copies(a, b, a_hp, b_hp, hp_wgrad: bool) -> None:
    """wgrad reads a's transposed copy, dgrad b's: a Float8Tensor made without it cannot train."""
    if hp_wgrad and isinstance(a, Float8Tensor) and b_hp is not None and b_hp.requires_grad:
        raise ValueError(
            "a: config.high_precision_wgrad computes b's gradient from a's high-precision values; "
            "pass a as a bf16/fp16/fp32 tensor, not a Float8Tensor"
        )
    for x, other_hp, name in ((a, b_hp, "a"), (b, a_hp, "b")):
        if hp_wgrad and name == "a":
            continue
        if (
            isinstance(x, Float8Tensor)
            and x.data_t is None
            and other_hp is not None
            and other_hp.requires_grad
        ):
            raise ValueError(
                f"{name}: Float8Tensor has no transposed copy (data_t), which the backward GEMM of "
                "the other operand needs; build it with Float8Tensor.from_tensor(..., with_transpose=True)"
            )
