"""Grouped GEMM for MoE experts: ``turbo.ops.grouped_gemm`` (forward + backward), sync-free."""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import GlobalBackendManager, precision_of_dtype
from primus_turbo.pytorch.core.main_grad import (
    accumulate_into_main_grads_,
    main_grad_block,
    split_for_autograd,
)
from primus_turbo.pytorch.core.utils import autocast_enabled_on, debug_checks_enabled, zero_rows_from
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (
    cutlass_offsets,
    grouped_gemm_impl,
    grouped_gemm_variable_k_impl,
    grouped_gemm_variable_k_into_,
)

__all__ = [
    "grouped_gemm", "validate_grouped_gemm_args", "debug_checks_enabled", "check_wgrad_into",
    "check_main_grad_into",
]  # fmt: skip


def validate_grouped_gemm_args(
    op: str,
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None,
    trans_b: bool,
    float_dtypes: tuple[torch.dtype, ...],
) -> None:
    """Shape/dtype/device checks shared by grouped_gemm and grouped_gemm_fp8 (no host sync).

    Value checks on group_lens (non-negative, summing to a.shape[0]) and group_offs (equal to the
    exclusive cumsum) need a host sync and run only with PRIMUS_TURBO_DEBUG_CHECKS=1.
    """
    for name, t in (("a", a), ("b", b), ("group_lens", group_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(trans_b, bool):  # a string like "false" would be truthy: b read in the other layout
        raise TypeError(f"{op}: trans_b must be a bool, got {trans_b!r}")
    if a.dim() != 2:
        raise ValueError(f"{op}: a must be 2-D [sum(M_i), K], got shape {tuple(a.shape)}")
    if b.dim() != 3:
        raise ValueError(
            f"{op}: b must be 3-D [G, {'N, K' if trans_b else 'K, N'}] (trans_b={trans_b}), "
            f"got shape {tuple(b.shape)}"
        )
    if a.dtype not in float_dtypes or b.dtype != a.dtype:
        raise TypeError(
            f"{op}: a and b must share one dtype among {[str(d) for d in float_dtypes]}, "
            f"got a {a.dtype}, b {b.dtype}"
        )
    k_b = b.shape[2] if trans_b else b.shape[1]
    if k_b != a.shape[1]:
        raise ValueError(
            f"{op}: reduction dims differ: a is {tuple(a.shape)} (K={a.shape[1]}) but b is "
            f"{tuple(b.shape)} with trans_b={trans_b} (K={k_b})"
        )
    if group_lens.dtype not in (torch.int64, torch.int32) or group_lens.dim() != 1:
        raise TypeError(
            f"{op}: group_lens must be a 1-D int64 (or int32) tensor, got dtype {group_lens.dtype}, "
            f"shape {tuple(group_lens.shape)}"
        )
    if group_lens.shape[0] != b.shape[0]:
        raise ValueError(
            f"{op}: group_lens has {group_lens.shape[0]} groups but b has G={b.shape[0]} (b.shape[0])"
        )
    if group_lens.shape[0] == 0:
        raise ValueError(f"{op}: need at least one group, got G=0")
    if group_lens.device != a.device or b.device != a.device:
        raise ValueError(
            f"{op}: a, b and group_lens must be on one device, got a on {a.device}, b on {b.device}, "
            f"group_lens on {group_lens.device}"
        )
    if group_offs is not None:
        if group_offs.dtype != torch.int64 or tuple(group_offs.shape) != (b.shape[0] + 1,):
            raise ValueError(
                f"{op}: group_offs must be int64 of shape ({b.shape[0] + 1},) (exclusive cumsum of "
                f"group_lens with a leading 0), got {group_offs.dtype} {tuple(group_offs.shape)}"
            )
        if group_offs.device != a.device:
            raise ValueError(f"{op}: group_offs is on {group_offs.device}, expected {a.device}")
    if debug_checks_enabled():
        _debug_check_values(op, a, group_lens, group_offs)


def _debug_check_values(op, a, group_lens, group_offs) -> None:
    """Host-syncing value checks (PRIMUS_TURBO_DEBUG_CHECKS=1 only)."""
    lens = group_lens.cpu()
    if (lens < 0).any():
        raise ValueError(f"{op}: group_lens has negative lengths: {lens.tolist()}")
    if int(lens.sum()) > a.shape[0]:  # fewer is fine: rows past the groups give zeros (an upper-bound buffer)
        raise ValueError(
            f"{op}: group_lens sums to {int(lens.sum())} but a has only {a.shape[0]} rows (a.shape[0]); "
            "sum(group_lens) <= a.shape[0] is required"
        )
    if group_offs is not None:
        expect = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        if not torch.equal(group_offs.cpu(), expect):
            raise ValueError(f"{op}: group_offs {group_offs.tolist()} != exclusive cumsum {expect.tolist()}")


def check_wgrad_into(op: str, b: torch.Tensor, trans_b: bool, wgrad_into) -> tuple[torch.Tensor, ...]:
    """``wgrad_into`` (a tensor or a list/tuple of them) as a tuple of weights whose ``.grad`` can take b's
    gradient split along N (see :func:`grouped_gemm`); () for None. Raises naming the argument and what is
    accepted."""
    if wgrad_into is None:
        return ()
    if isinstance(wgrad_into, torch.Tensor):  # one weight, as gemm's wgrad_into (not its G slices)
        weights = (wgrad_into,)
    elif isinstance(wgrad_into, (list, tuple)):
        weights = tuple(wgrad_into)
    else:
        got = type(wgrad_into).__name__
        raise TypeError(f"{op}: wgrad_into must be a tensor or a list/tuple of tensors, got {got}")
    if not trans_b:
        raise ValueError(f"{op}: wgrad_into needs trans_b=True (b and the weights are [G, N, K])")
    want = f"[{b.shape[0]}, N_i, {b.shape[2]}] with sum(N_i) = {b.shape[1]}"
    for i, w in enumerate(weights):
        if not isinstance(w, torch.Tensor) or not w.is_leaf or not w.requires_grad:
            raise ValueError(f"{op}: wgrad_into[{i}] must be a leaf tensor that requires grad (a parameter)")
        if w.dim() != 3 or w.shape[0] != b.shape[0] or w.shape[2] != b.shape[2] or w.device != b.device:
            raise ValueError(f"{op}: wgrad_into[{i}] is {tuple(w.shape)} on {w.device}; expected {want}")
    if sum(w.shape[1] for w in weights) != b.shape[1] or not weights:
        raise ValueError(f"{op}: wgrad_into shapes {[tuple(w.shape) for w in weights]}; expected {want}")
    return weights


def check_main_grad_into(op: str, b: torch.Tensor, trans_b: bool, main_grad_into, wgrad_into) -> tuple:
    """``main_grad_into`` as a tuple of G weights ([N, K] each, with an fp32 ``main_grad``); () for None."""
    if main_grad_into is None:
        return ()
    if not isinstance(main_grad_into, (list, tuple)):  # a tensor: G slices, none with a main_grad
        raise TypeError(
            f"{op}: main_grad_into must be a list/tuple of the G weights, got {type(main_grad_into).__name__}"
        )
    weights = tuple(main_grad_into)
    if wgrad_into is not None:
        raise ValueError(f"{op}: pass wgrad_into or main_grad_into, not both")
    if not trans_b:
        raise ValueError(f"{op}: main_grad_into needs trans_b=True (b is [G, N, K], weights[g] is [N, K])")
    if len(weights) != b.shape[0]:
        raise ValueError(f"{op}: main_grad_into has {len(weights)} weights; b has G={b.shape[0]} (dim 0)")
    for i, w in enumerate(weights):  # every one: the FP8 path writes them flat, unchecked, in backward
        main_grad = getattr(w, "main_grad", None)
        is_tensor = isinstance(main_grad, torch.Tensor)
        if not is_tensor or main_grad.shape != b.shape[1:] or main_grad.device != b.device:
            got = f"{tuple(main_grad.shape)} on {main_grad.device}" if is_tensor else "none"
            raise ValueError(
                f"{op}: main_grad_into[{i}].main_grad must be a tensor of shape {tuple(b.shape[1:])} on "
                f"{b.device} (Megatron DDP allocates it); got {got}"
            )
    return weights


def wgrad_into_main_grads(a, grad_out, group_lens, weights, offs=None) -> None:
    """The trans_b weight gradient dC_g^T @ A_g ([N, K]) added into ``weights[g].main_grad``. When the buffers
    form one equally spaced block (Megatron's DDP, reverse order included) through the in-place variable-K
    dispatcher (default CUTLASS, then one add launch at the block's stride; TRITON sums inside the GEMM);
    else the gradient, then one add pass per equally spaced run."""
    grad = grad_out if grad_out.dtype == a.dtype else grad_out.to(a.dtype)
    block = main_grad_block(weights)
    if block is None:
        accumulate_into_main_grads_(weights, grouped_wgrad(a, grad, group_lens, True, offs))
        return
    out, reverse = block
    grouped_gemm_variable_k_into_(grad, a, group_lens, out, True, offs, reverse)


def wgrad_into_weights(a, grad_out, group_lens, weights, offs=None) -> None:
    """The trans_b weight gradient dC^T @ A ([G, N, K]) into each weight's ``.grad``, split along N in order:
    written in the weight's dtype where ``.grad`` is None, added to it otherwise (summed in fp32 inside the
    GEMM where the backend can: no [G, N, K] gradient in a's precision, no add pass)."""
    grad = grad_out if grad_out.dtype == a.dtype else grad_out.to(a.dtype)
    start = 0
    for w in weights:
        x = grad[:, start : start + w.shape[1]]
        start += w.shape[1]
        if w.grad is None:
            w.grad = torch.empty(w.shape, dtype=w.dtype, device=w.device)
            grouped_gemm_variable_k_into_(x, a, group_lens, w.grad, False, offs)
        elif w.grad.shape == w.shape and w.grad.is_contiguous():
            grouped_gemm_variable_k_into_(x, a, group_lens, w.grad, True, offs)
        else:  # a .grad someone else laid out: the gradient, then autograd's add
            w.grad.add_(grouped_gemm_variable_k_impl(x, a, group_lens, offs))


def _runs_dense(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One expert runs as a dense GEMM, unless the user pinned a grouped_gemm backend for a's precision: a pin
    is honoured (and one that cannot serve the inputs raises) as for G > 1. Two dict lookups, only at G == 1;
    traced calls keep the dense path (Dynamo does not trace the environment lookup)."""
    if b.shape[0] != 1:
        return False
    if torch.compiler.is_compiling():
        return True
    return GlobalBackendManager.user_backend("grouped_gemm", precision_of_dtype(a.dtype))[0] is None


def _dense(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w in the inputs' dtype, as the grouped kernels compute it: torch.autocast would otherwise round an
    fp32 G == 1 forward to its dtype (and the backward then failed on a bf16 x fp32 matmul)."""
    if autocast_enabled_on(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            return x @ w
    return x @ w


def _dense_one_group(out: torch.Tensor, group_lens: torch.Tensor) -> torch.Tensor:
    """One expert's dense GEMM output [M, N] with the rows past group_lens[0] zeroed (a sync-free upper-bound
    buffer, e.g. after TURBO EP dispatch with one local expert: those rows belong to no group and may hold
    anything). Writes only the tail rows; nothing when group_lens[0] == M."""
    zero_rows_from(out, None, group_lens[0])
    return out


class GroupedGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group_lens, trans_b, main_grad_into, *wgrad_into):
        ctx.trans_b = trans_b
        ctx.wgrad_into = wgrad_into  # the Parameter objects: their .grad is read and written in backward
        ctx.main_grad_into = main_grad_into  # a tuple, not autograd inputs: no edge to the weights
        ctx.dense = _runs_dense(a, b)
        if ctx.dense:  # one expert: a dense GEMM (cuBLAS); rows past group_lens[0] zeroed
            ctx.save_for_backward(a, b, group_lens, None)
            return _dense_one_group(_dense(a, b[0].t() if trans_b else b[0]), group_lens)
        # torch._grouped_mm offsets: built once here (a few tiny kernels), reused by dgrad and wgrad
        offs = cutlass_offsets(group_lens, a.shape[0]) if a.is_cuda and a.dtype == torch.bfloat16 else None
        ctx.save_for_backward(a, b, group_lens, offs)
        return grouped_gemm_impl(a, b, group_lens, trans_b, offs)

    @staticmethod
    def backward(ctx, grad_out):
        a, b, group_lens, offs = ctx.saved_tensors
        trans_b = ctx.trans_b
        grad_out = grad_out.contiguous()  # no-op (no copy) for the usual contiguous gradient
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            if ctx.dense:
                grad_a = _dense_one_group(_dense(grad_out, b[0] if trans_b else b[0].t()), group_lens)
            else:  # dA = dC @ B_g^T: the same grouped kernel with b read the other way round
                grad_a = grouped_gemm_impl(grad_out, b, group_lens, not trans_b, offs)
        if ctx.main_grad_into:  # into Megatron's main_grad buffers; b gets no gradient
            wgrad_into_main_grads(a, grad_out, group_lens, ctx.main_grad_into, offs)
        elif ctx.needs_input_grad[1] and not ctx.wgrad_into:  # with wgrad_into b gets none: a b cast from
            grad_b = grouped_wgrad(a, grad_out, group_lens, trans_b, offs)  # the weights would pass it twice
        weights = ctx.wgrad_into
        if not weights:
            return grad_a, grad_b, None, None, None
        if torch.is_grad_enabled():  # create_graph: the weights' gradients must stay differentiable
            wgrad = grad_b
            if wgrad is None:
                wgrad = grouped_wgrad(a, grad_out, group_lens, True, offs)
            return grad_a, grad_b, None, None, None, *split_for_autograd(wgrad, weights)
        wgrad_into_weights(a, grad_out, group_lens, weights, offs)
        return grad_a, grad_b, None, None, None, *(None for _ in weights)


def grouped_wgrad(a, grad_out, group_lens, trans_b: bool, offs=None) -> torch.Tensor:
    """The weight gradient of a grouped GEMM in a's precision: dB_g = A_g^T @ dC_g ([G, K, N]), or
    dC_g^T @ A_g ([G, N, K]) when trans_b; variable-K over each expert's rows, also for G = 1: a dense GEMM
    over all rows would take in the rows past group_lens[0] (an upper-bound buffer's, whatever they hold).
    ``offs``: torch._grouped_mm offsets, built here when not given (CUDA bf16)."""
    grad = grad_out if grad_out.dtype == a.dtype else grad_out.to(a.dtype)
    if offs is None and a.is_cuda and a.dtype == torch.bfloat16:
        offs = cutlass_offsets(group_lens, a.shape[0])
    x, y = (grad, a) if trans_b else (a, grad)
    return grouped_gemm_variable_k_impl(x, y, group_lens, offs)


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    group_offs: torch.Tensor | None = None,
    trans_b: bool = False,
    *,
    wgrad_into=None,
    main_grad_into=None,
) -> torch.Tensor:
    """Grouped GEMM: ``out[rows_g] = a[rows_g] @ b[g]`` (``@ b[g].T`` when ``trans_b``).

    Args:
        a: [sum(M_i), K], bf16/fp16/fp32; rows sorted by group (group g owns rows
            ``[offs_g, offs_g + group_lens[g])``).
        b: [G, K, N], or [G, N, K] with ``trans_b=True`` (the Megatron/TE weight layout).
        group_lens: [G] int64 on a's device; zero-length groups are fine. int32 (e.g. ``token_permute``'s
            tokens_per_expert) is taken too: cast on the device, no host sync.
        group_offs: optional [G + 1] int64 exclusive cumsum of group_lens (AMD-API compatible);
            every backend derives offsets from group_lens on the device, so it is only validated.
        trans_b: see ``b``.
        wgrad_into: optional weights W_1..W_n (a list/tuple, or one tensor for n = 1; [G, N_i, K] leaves
            that require grad, sum(N_i) = N; needs trans_b), e.g. fp32 parameters of which ``b`` is the
            cast copy (w1 and w3 concatenated): b's gradient goes into their ``.grad`` split along N (b
            itself gets none), in W's dtype: written where ``.grad`` is None, added to it otherwise, summed
            in fp32 inside the wgrad GEMM (TRITON; CUTLASS / TORCH: the gradient then one add pass;
            PRIMUS_TURBO_GROUPED_WGRAD_ACCUMULATE_BACKEND). Autograd hands them no gradient (no
            AccumulateGrad, no hooks fire) except under ``create_graph``.
        main_grad_into: optional G weights ([N, K] each, needs trans_b; not with wgrad_into), each with
            an fp32 ``main_grad`` (Megatron's gradient_accumulation_fusion): b[g]'s gradient is added into
            ``weights[g].main_grad`` from the backward itself (G buffers laid out as Megatron's DDP does,
            in reverse order, take one launch; TRITON sums inside the wgrad GEMM, CUTLASS, the default,
            adds its bf16 gradient in one pass; PRIMUS_TURBO_GROUPED_WGRAD_ACCUMULATE_BACKEND). b gets no
            gradient and the weights are not autograd inputs (the caller hands DDP its placeholders, e.g.
            through a function on b that ignores the None gradient).

    Returns [sum(M_i), N] in a's dtype; differentiable in a and b (dgrad is a grouped GEMM, wgrad
    a variable-K grouped GEMM; an empty expert's weight gradient is exactly zero).

    No host synchronisation on group_lens in forward or backward (CUDA-graph capturable) except
    with the TORCH backend (the CPU default). G == 1 runs a dense matmul forward and dgrad (the pinned
    backend instead when one is pinned). Checks: shapes, dtypes, devices and G always (no sync); negative
    lengths, sum(group_lens) > a.shape[0] and a wrong group_offs only with PRIMUS_TURBO_DEBUG_CHECKS=1
    (they need a sync). Without it, inconsistent lengths give wrong values but never out-of-bounds accesses
    or uninitialised output rows.
    sum(group_lens) < a.shape[0] is supported (a sync-free upper-bound buffer, e.g. after TURBO EP
    dispatch): rows past the last group belong to no group; their outputs and input gradients are
    zeros, they add nothing to the weight gradient and cost no GEMM time (CUTLASS and TRITON).
    Backend: PRIMUS_TURBO_GROUPED_GEMM_BACKEND = CUTLASS | TRITON | TORCH.
    """
    validate_grouped_gemm_args(
        "grouped_gemm", a, b, group_lens, group_offs, trans_b, (torch.bfloat16, torch.float16, torch.float32)
    )
    weights = check_wgrad_into("grouped_gemm", b, trans_b, wgrad_into)
    main_grads = check_main_grad_into("grouped_gemm", b, trans_b, main_grad_into, wgrad_into)
    group_lens = group_lens.to(torch.int64).contiguous()  # no-op for int64; the kernels index it flat
    return GroupedGemmFunction.apply(
        a.contiguous(), b.contiguous(), group_lens, bool(trans_b), main_grads, *weights
    )  # fmt: skip
