"""``turbo.ops.gemm``: C = op(a) @ op(b) with autograd, fp16/bf16/fp32 (fp64 on TORCH/CUBLAS).

Layouts: a is [M, K] (``trans_a=False``) or [K, M] (``trans_a=True``); b is [K, N] or [N, K]
(``trans_b=True``, the nn.Linear weight layout). The backward uses the same op on transposed
views, never copies:

    dgrad  dA = dC @ op(b)^T        (stored [K, M] when trans_a: op(b) @ dC^T)
    wgrad  dB = op(a)^T @ dC        (stored [N, K] when trans_b: dC^T @ op(a))

Megatron-style weight-gradient accumulation (``accumulate_into_main_grad=True``): ``b`` is a
weight carrying an fp32 ``b.main_grad`` buffer of b's shape. The backward accumulates the wgrad
GEMM into it in fp32 (no bf16 rounding): ``b.main_grad += op(a)^T @ dC``. Like Megatron's
``gradient_accumulation_fusion``, the gradient returned for ``b`` is then a placeholder: ``None``
when ``b`` has no ``grad_added_to_main_grad`` attribute, otherwise an uninitialised tensor (zeros
when ``b.zero_out_wgrad`` is True) and ``b.grad_added_to_main_grad`` is set to True so Megatron's
DDP skips ``b.grad``.
With the CUBLAS backend the accumulation is fused (one cuBLASLt GEMM with beta=1 into main_grad);
TRITON/TORCH compute the fp32 product and ``add_`` it (one extra fp32 pass over the gradient).

Under ``torch.autocast`` the op follows it as ``torch.mm`` does: a and b are cast to the autocast dtype first
(floating inputs other than fp64; a differentiable cast, so fp32 leaves get fp32 gradients) and every backend
computes and returns that dtype (out_dtype defaults to it), forward and backward.

Plain CUDA calls (no main_grad or ``wgrad_into``, output in the input dtype, outside torch.compile) whose
three GEMMs all resolve to CUBLAS run as ``torch.mm`` with torch's own autograd: the
same cuBLAS calls without the autograd.Function and three dispatches (18-74 us of Python per forward on the
H100/H200 hosts, as long as a 4096 x 2048 x 2048 GEMM runs). That is the CUDA default, a CUBLAS pin, and
under autotune a forward key whose first backward ran all three on CUBLAS (its dgrad/wgrad choices are
taken for a contiguous output gradient).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.core.main_grad import check_main_grad, wgrad_placeholder
from primus_turbo.pytorch.core.utils import autocast_cast, autocast_enabled_on
from primus_turbo.pytorch.kernels.gemm.gemm_impl import (
    SUPPORTED_DTYPES,
    GemmDispatcher,
    gemm_accumulate_,
    gemm_forward,
)

__all__ = ["gemm"]


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _validate(a, b, trans_a, trans_b, out_dtype) -> None:
    # Runs on every call (a few us of Python on the GPU hosts): the error text is only built on an error
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gemm: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"gemm: {name} must be 2-D, got shape {tuple(t.shape)} ({t.dim()}-D)")
        if t.dtype not in SUPPORTED_DTYPES:
            accepted = _dtype_names(SUPPORTED_DTYPES)
            raise TypeError(f"gemm: {name}.dtype {t.dtype} is not supported; accepted: {accepted}")
    if type(trans_a) is not bool or type(trans_b) is not bool:
        name, flag = ("trans_a", trans_a) if type(trans_a) is not bool else ("trans_b", trans_b)
        raise TypeError(f"gemm: {name} must be a bool, got {type(flag).__name__}")
    if a.dtype != b.dtype:
        raise TypeError(f"gemm: a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"gemm: a and b must be on the same device, got a on {a.device} and b on {b.device}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        accepted = _dtype_names(SUPPORTED_DTYPES)
        raise TypeError(f"gemm: out_dtype {out_dtype} is not supported; accepted: {accepted}")
    k_a = a.shape[0] if trans_a else a.shape[1]
    k_b = b.shape[1] if trans_b else b.shape[0]
    if k_a != k_b:
        raise ValueError(
            f"gemm: inner dimensions differ: op(a) is {_op_shape(a, trans_a)} (a {tuple(a.shape)}, "
            f"trans_a={trans_a}) and op(b) is {_op_shape(b, trans_b)} "
            f"(b {tuple(b.shape)}, trans_b={trans_b}); "
            f"op(a) must be [M, K] and op(b) [K, N]"
        )


def _op_shape(t: torch.Tensor, trans: bool) -> list[int]:
    return list(t.shape[::-1]) if trans else list(t.shape)


class GemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, trans_a, trans_b, out_dtype, accumulate_into_main_grad, record_key, *wgrad_into):
        ctx.save_for_backward(a, b)
        ctx.trans_a, ctx.trans_b = trans_a, trans_b
        ctx.wgrad_into = wgrad_into  # () or (the Parameter whose .grad takes b's gradient,)
        ctx.accumulate_into_main_grad = accumulate_into_main_grad
        if accumulate_into_main_grad:
            ctx.weight = b  # the Python object carries main_grad / grad_added_to_main_grad
        out = gemm_forward(a, b, trans_a, trans_b, out_dtype)
        ctx.record_key = record_key  # autotuned plain call: the backward records if all three ran on CUBLAS
        ctx.fwd_backend = GemmDispatcher.last_backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors
        trans_a, trans_b = ctx.trans_a, ctx.trans_b
        # An out_dtype wider than the inputs (e.g. bf16 x bf16 -> fp32) gives an fp32 grad_out;
        # the backward GEMMs run in the input precision like the forward.
        grad = grad_out if grad_out.dtype == a.dtype else grad_out.to(a.dtype)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            if trans_a:
                grad_a = gemm_forward(b, grad, trans_b, True, a.dtype)
            else:
                grad_a = gemm_forward(grad, b, False, not trans_b, a.dtype)
            dgrad_backend = GemmDispatcher.last_backend
        if ctx.needs_input_grad[1] and not ctx.wgrad_into:  # with wgrad_into, b gets none (as documented):
            # b = w.to(bf16) would otherwise carry the gradient to w a second time through the cast
            weight = ctx.weight if ctx.accumulate_into_main_grad else None
            grad_b = gemm_wgrad(a, grad, trans_a, trans_b, b.dtype, weight)
            if ctx.record_key is not None and ctx.needs_input_grad[0] and grad.is_contiguous():
                GemmDispatcher.record_all_cublas(
                    ctx.record_key, ctx.fwd_backend, dgrad_backend, GemmDispatcher.last_backend
                )
        if not ctx.wgrad_into:
            return grad_a, grad_b, None, None, None, None, None
        (target,) = ctx.wgrad_into
        if torch.is_grad_enabled():  # create_graph: the weight's gradient through autograd
            wgrad = gemm_wgrad(a, grad, trans_a, trans_b, target.dtype)
            return grad_a, grad_b, None, None, None, None, None, wgrad
        _wgrad_into_grad(target, a, grad, trans_a, trans_b)
        return grad_a, grad_b, None, None, None, None, None, None


def _wgrad_into_grad(target, a, grad, trans_a: bool, trans_b: bool) -> None:
    """b's gradient into ``target.grad``: one GEMM writing it in target's dtype (fp32 from half inputs: the
    accumulator unrounded) when None, else accumulated by the GEMM (cuBLAS beta=1, ``gemm_accumulate_``)."""
    lhs, rhs, t_lhs, t_rhs = _wgrad_operands(a, grad, trans_a, trans_b)
    if target.grad is None:
        target.grad = gemm_forward(lhs, rhs, t_lhs, t_rhs, target.dtype)
    elif target.grad.is_contiguous() and target.grad.shape == target.shape:
        gemm_accumulate_(target.grad, lhs, rhs, t_lhs, t_rhs)
    else:
        target.grad.add_(gemm_forward(lhs, rhs, t_lhs, t_rhs, target.dtype))


def _wgrad_operands(a, grad, trans_a: bool, trans_b: bool):
    """(lhs, rhs, trans_lhs, trans_rhs) of b's gradient: dC^T @ op(a) for a [N, K] b, op(a)^T @ dC else."""
    return (grad, a, True, trans_a) if trans_b else (a, grad, not trans_a, False)


def gemm_wgrad(a, grad, trans_a: bool, trans_b: bool, out_dtype: torch.dtype, weight=None):
    """b's gradient from a (physical, op(a) = a^T with trans_a) and dC, in a's precision: dB = op(a)^T @ dC,
    stored dC^T @ op(a) when b is [N, K] (trans_b). With ``weight`` (the Python object carrying an fp32
    ``main_grad``) the GEMM accumulates into ``weight.main_grad`` and the DDP placeholder is returned."""
    grad = grad if grad.dtype == a.dtype else grad.to(a.dtype)
    lhs, rhs, t_lhs, t_rhs = _wgrad_operands(a, grad, trans_a, trans_b)
    if weight is not None:
        gemm_accumulate_(weight.main_grad, lhs, rhs, t_lhs, t_rhs)
        return wgrad_placeholder(weight)
    return gemm_forward(lhs, rhs, t_lhs, t_rhs, out_dtype)


def _autocast_operands(a, b, accumulate_into_main_grad: bool):
    """Under ``torch.autocast``, a and b in its dtype, as autocast casts ``torch.mm``'s inputs: every backend
    then computes in that dtype and returns it, the backward too (a differentiable cast, as autocast's)."""
    a_cast, b_cast = autocast_cast(a), autocast_cast(b)
    if accumulate_into_main_grad and b_cast is not b:
        raise ValueError(
            f"gemm: accumulate_into_main_grad under torch.autocast needs b already in the autocast dtype "
            f"{b_cast.dtype} (its main_grad belongs to b, not to a cast copy); got b {b.dtype}"
        )
    return a_cast, b_cast


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    trans_a: bool = False,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    *,
    accumulate_into_main_grad: bool = False,
    wgrad_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[M, N] = op(a) @ op(b), op(x) = x.T when the flag is set. Differentiable in a and b.

    Args:
        a: [M, K] (or [K, M] with ``trans_a``); fp16, bf16, fp32 or fp64, any strides.
        b: [K, N] (or [N, K] with ``trans_b``); same dtype and device as ``a``.
        out_dtype: output dtype (default ``a.dtype``); fp32 out from half inputs keeps the fp32
            accumulator unrounded.
        accumulate_into_main_grad: add b's gradient into ``b.main_grad`` instead of returning it
            (Megatron ``gradient_accumulation_fusion`` semantics; see the module docstring).
        wgrad_into: a leaf of b's shape that requires grad (e.g. the fp32 parameter b is the half-precision
            copy of): b's gradient goes into its ``.grad`` instead: written by the wgrad GEMM in its dtype
            (fp32: the accumulator unrounded) when ``.grad`` is None, summed into it by the GEMM otherwise
            (cuBLAS beta=1); b gets no gradient, autograd none for the leaf (except under create_graph).

    The backend is chosen by ``GemmDispatcher`` (CUBLAS on CUDA, TORCH on CPU, TRITON when pinned
    or when autotune finds it faster); see ``primus_turbo.pytorch.core.backend``.
    Zero-size M or N give an empty result; K == 0 gives zeros.
    """
    tensors = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    if tensors and autocast_enabled_on(a.device.type):
        a, b = _autocast_operands(a, b, accumulate_into_main_grad)
        _validate(a, b, trans_a, trans_b, out_dtype)
        # the backends compute as outside autocast (its casts would round the torch ops inside them)
        with torch.autocast(a.device.type, enabled=False):
            return _gemm(a, b, trans_a, trans_b, out_dtype, accumulate_into_main_grad, wgrad_into)
    _validate(a, b, trans_a, trans_b, out_dtype)
    return _gemm(a, b, trans_a, trans_b, out_dtype, accumulate_into_main_grad, wgrad_into)


def _gemm(a, b, trans_a, trans_b, out_dtype, accumulate_into_main_grad, wgrad_into):
    if accumulate_into_main_grad and b.requires_grad:
        check_main_grad(b, "gemm", "b")
    into = ()
    if wgrad_into is not None:
        if not (isinstance(wgrad_into, torch.Tensor) and wgrad_into.is_leaf and wgrad_into.requires_grad):
            raise ValueError("gemm: wgrad_into must be a leaf tensor that requires grad (a parameter)")
        if wgrad_into.shape != b.shape or wgrad_into.device != b.device or accumulate_into_main_grad:
            raise ValueError(
                f"gemm: wgrad_into is {tuple(wgrad_into.shape)} on {wgrad_into.device}; expected b's shape "
                f"{tuple(b.shape)} on {b.device}, without accumulate_into_main_grad"
            )
        into = (wgrad_into,)
    record_key = None
    if (
        not into
        and not accumulate_into_main_grad
        and out_dtype in (None, a.dtype)
        and a.is_cuda
        and not torch.compiler.is_compiling()
    ):
        # All three GEMMs on cuBLAS: torch.mm with torch's own autograd makes the same cuBLAS calls without
        # the autograd.Function and three dispatches (18-74 us of Python per forward on the H100/H200 hosts)
        on_cublas, record_key = GemmDispatcher.plain_call_on_cublas(a, b, trans_a, trans_b)
        if on_cublas:
            GemmDispatcher.last_backend = BackendType.CUBLAS
            return torch.mm(a.T if trans_a else a, b.T if trans_b else b)
    out_dtype = a.dtype if out_dtype is None else out_dtype
    return GemmFunction.apply(a, b, trans_a, trans_b, out_dtype, accumulate_into_main_grad, record_key, *into)
