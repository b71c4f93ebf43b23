"""Async tensor parallel: all-gather + GEMM and GEMM + reduce-scatter with overlapped communication.

    a_full, [y0, y1] = fused_all_gather_matmul(a_shard, [w0, w1], gather_dim=0, group=tp_group)
    y_shard = fused_matmul_reduce_scatter(a, w, "sum", scatter_dim=0, group=tp_group)

Signatures follow ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``
(``group`` may be a ProcessGroup, a group name or None for WORLD). ``b`` operands are [K, N]
(``a @ b``). FP8: pass ``fp8_config=Float8QuantConfig(...)`` (TENSORWISE or ROWWISE, current
scaling) to quantize inside the op, or call the ``*_scaled_*`` variants with pre-quantized
operands and dequantization scales (``torch._scaled_mm`` convention; ``b`` column-major).

Preconditions (checked, ValueError/TypeError otherwise):
  * the gathered / scattered dim is not the last dim (that one is contracted / the GEMM's N);
  * reduce-scatter: the scattered dim's size is divisible by the group size (no padding: pad the
    sequence to a multiple of the TP size, as Megatron's sequence parallel does);
  * same dtype and device for ``a`` and every ``b``; FP8 operands only through the scaled variants;
  * a tensor-wise ``a_scale`` must be the same on every rank (``fp8_config`` guarantees it by an
    amax all-reduce over the group); a scale of ``a``'s row-wise shape [..., 1] is row-wise, also
    when the shard has one row;
  * every rank passes the same shapes, dtypes and flags: a mismatch hangs or aborts a rank; with
    PRIMUS_TURBO_DEBUG_CHECKS=1 every rank raises ValueError instead (one all_gather_object per call).
A group of size 1 runs a plain GEMM; zero-size problems run the unfused NCCL path.

Backends: ``backend=None`` (dispatcher default on CUDA+NCCL from ~0.2 ms of GEMM per rank: SYMM_MEM,
or TURBO for comm-heavy all-gathers; NCCL otherwise; the measured rule is in async_tp_impl.py), or
pin ``"NCCL"``, ``"SYMM_MEM"``, ``"TURBO"``. These ops are not differentiable by themselves;
``turbo.modules.ColumnParallelLinear`` / ``RowParallelLinear`` use them with their own backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    ScalingGranularity,
    ScalingStrategy,
    fp8_max,
    is_fp8_dtype,
)
from primus_turbo.pytorch.core.utils import check_ranks_agree, debug_checks_enabled
from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import (
    all_gather_matmul_impl,
    matmul_reduce_scatter_impl,
    out_dtype_codes,
    scaled_matmul,
)

__all__ = [
    "fused_all_gather_matmul",
    "fused_all_gather_scaled_matmul",
    "fused_matmul_reduce_scatter",
    "fused_scaled_matmul_reduce_scatter",
    "quantize_for_async_tp",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# -- validation -----------------------------------------------------------------------------------
def _group_name(group, arg: str = "group") -> str:
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, str):
        return group
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what dist.new_group returns on the ranks left out
        raise ValueError(
            f"{arg}: this rank (global rank {dist.get_rank()}) is not a member of the process group; "
            f"call the op only on the group's ranks"
        )
    raise TypeError(f"{arg}: expected a ProcessGroup, a group name or None, got {type(group).__name__}")


def _world(group_name: str) -> int:
    from torch.distributed import distributed_c10d as c10d

    return c10d._resolve_process_group(group_name).size()


def _check_dim(name: str, dim: int, t: torch.Tensor) -> int:
    if not isinstance(dim, int):
        raise TypeError(f"{name}: expected an int, got {type(dim).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{name}: the input must have >= 2 dims [..., K], got shape {tuple(t.shape)}")
    d = dim + t.dim() if dim < 0 else dim
    if not 0 <= d < t.dim() - 1:
        raise ValueError(
            f"{name}={dim}: must index a dim of {tuple(t.shape)} other than the last (contracted) one, "
            f"i.e. in [{-t.dim()}, {t.dim() - 2}]"
        )
    return d


def _check_operands(a: torch.Tensor, bs: list[torch.Tensor], a_name: str, scaled: bool) -> None:
    if not isinstance(a, torch.Tensor):
        raise TypeError(f"{a_name}: expected a tensor, got {type(a).__name__}")
    if not bs:
        raise ValueError("b_list: expected at least one [K, N] tensor")
    for i, b in enumerate(bs):
        if not isinstance(b, torch.Tensor) or b.dim() != 2:
            raise ValueError(f"b[{i}]: expected a 2-D [K, N] tensor, got {getattr(b, 'shape', type(b))}")
        if b.shape[0] != a.shape[-1]:
            raise ValueError(f"b[{i}]: K mismatch: {a_name} is {tuple(a.shape)}, b is {tuple(b.shape)}")
        if b.device != a.device:
            raise ValueError(f"b[{i}]: device {b.device} differs from {a_name}'s {a.device}")
        if scaled:
            if not (is_fp8_dtype(a.dtype) and is_fp8_dtype(b.dtype)):
                raise TypeError(
                    f"scaled variant: {a_name} and b[{i}] must be float8_e4m3fn/float8_e5m2, "
                    f"got {a.dtype}, {b.dtype}"
                )
        elif a.dtype not in _FLOAT_DTYPES or b.dtype != a.dtype:
            hint = (
                " (FP8 operands: use fp8_config= or the *_scaled_* variant)" if is_fp8_dtype(a.dtype) else ""
            )
            raise TypeError(
                f"{a_name}/b[{i}]: dtypes must match and be one of bfloat16/float16/float32, "
                f"got {a.dtype} and {b.dtype}{hint}"
            )


def _to_front_2d(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, list[int]]:
    if dim == 0 and t.dim() == 2 and t.is_contiguous():  # the common case: no view ops (host time)
        return t, [t.shape[0]]
    moved = t.movedim(dim, 0)
    rows = moved.shape[:-1].numel()
    return moved.contiguous().view(rows, t.shape[-1]), list(moved.shape[:-1])


def _a_scale_2d(a_scale: torch.Tensor, a: torch.Tensor, dim: int, a_name: str) -> torch.Tensor:
    """fp32 row-wise [rows, 1] (in ``_to_front_2d(a, dim)``'s row order) or tensor-wise 0-d ``a_scale``.

    A scale of a's row-wise shape [..., 1] is row-wise even with one element: a one-row shard's scale
    differs per rank and must travel with its row (the kernels tell the two apart by dim).
    """
    if not isinstance(a_scale, torch.Tensor):
        raise TypeError(f"a_scale: expected a tensor, got {type(a_scale).__name__}")
    rowwise_shape = (*a.shape[:-1], 1)
    if tuple(a_scale.shape) == rowwise_shape:
        return a_scale.movedim(dim, 0).contiguous().view(-1, 1).float()
    if a_scale.numel() != 1:
        raise ValueError(
            f"a_scale: expected a scalar or the row-wise shape {rowwise_shape} of {a_name} "
            f"{tuple(a.shape)}, got {tuple(a_scale.shape)}"
        )
    return a_scale.reshape(()).float()


def _from_front_2d(t2d: torch.Tensor, lead: list[int], dim: int) -> torch.Tensor:
    if dim == 0 and len(lead) == 1:
        return t2d
    return t2d.reshape(*lead, t2d.shape[-1]).movedim(0, dim)


# -- FP8 quantization (current scaling) -----------------------------------------------------------
def quantize_for_async_tp(
    x: torch.Tensor, dtype: torch.dtype, rowwise_dim: int | None, group_name: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8, dequant_scale). Tensor-wise when ``rowwise_dim`` is None: the amax is all-reduced
    (MAX) over ``group_name`` when given, so every rank's shard shares one scale.
    """
    xf = x.float()
    if rowwise_dim is None:
        amax = xf.abs().amax()
        if group_name is not None and _world(group_name) > 1:
            from torch.distributed import distributed_c10d as c10d

            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=c10d._resolve_process_group(group_name))
    else:
        amax = xf.abs().amax(dim=rowwise_dim, keepdim=True)
    scale = fp8_max(dtype) / amax.clamp(min=1e-12)
    q = (xf * scale).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return q, scale.reciprocal()


def _quantize_operands(a2d, bs, fp8_config: Float8QuantConfig, group_name):
    if not isinstance(fp8_config, Float8QuantConfig):
        raise TypeError(f"fp8_config: expected Float8QuantConfig, got {type(fp8_config).__name__}")
    gran = fp8_config.granularity
    if gran not in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
        raise ValueError(f"fp8_config.granularity: async_tp supports TENSORWISE and ROWWISE, got {gran.name}")
    if fp8_config.strategy is not ScalingStrategy.CURRENT:
        raise ValueError("fp8_config.strategy: async_tp supports CURRENT scaling only")
    dtype = fp8_config.format.fwd_dtype
    rowwise = gran is ScalingGranularity.ROWWISE
    a_q, a_scale = quantize_for_async_tp(a2d, dtype, 1 if rowwise else None, group_name)
    b_q, b_scales = [], []
    for b in bs:
        bt_q, bt_scale = quantize_for_async_tp(b.t().contiguous(), dtype, 1 if rowwise else None)
        b_q.append(bt_q.t())  # column-major [K, N] as torch._scaled_mm wants
        b_scales.append(bt_scale.view(1, -1) if rowwise else bt_scale)
    return a_q, a_scale, b_q, b_scales


def _out_dtype_list(out_dtypes, n: int, default: torch.dtype, rowwise_fp8: bool) -> list[torch.dtype]:
    """One output dtype per b: None (the default), one dtype for all, or a list of n (None entries: default).
    Row-wise FP8 GEMMs on CUDA (cuBLAS) produce bf16 only (``rowwise_fp8``: check that)."""
    if out_dtypes is None:
        return [default] * n
    dts = list(out_dtypes) if isinstance(out_dtypes, (list, tuple)) else [out_dtypes] * n
    dts = [default if d is None else d for d in dts]
    if len(dts) != n or any(d not in _FLOAT_DTYPES for d in dts):
        raise ValueError(
            f"out_dtypes: expected a dtype or a list of {n} (one per b) from bfloat16/float16/float32, "
            f"got {out_dtypes}"
        )
    if rowwise_fp8 and any(d != torch.bfloat16 for d in dts):
        raise ValueError(f"out_dtypes: row-wise FP8 GEMMs (cuBLAS) return bfloat16 only, got {out_dtypes}")
    return dts


# -- all-gather + matmul --------------------------------------------------------------------------
def _check_ag_ranks_agree(op, a_shard, dim, fp8, return_a, backend, group_name) -> None:
    if not debug_checks_enabled():  # the signature is built only when it is checked (every call otherwise)
        return
    sig = dict(a_shard=(tuple(a_shard.shape), a_shard.dtype), gather_dim=dim, fp8=fp8, return_a=return_a)
    check_ranks_agree(op, dict(sig, backend=_backend_key(backend)), group_name)


def _backend_key(backend) -> str | None:
    """The pinned backend as the ranks must agree on it ("nccl" and BackendType.NCCL are one choice)."""
    name = getattr(backend, "name", backend)
    return name.strip().upper() if isinstance(name, str) and name.strip() else None


def _all_gather_matmul_2d(a2d, bs, a_scale, b_scales, group_name, return_a, out_dtypes, backend, num_splits):
    """out_dtypes: one dtype per b (FP8), or None (bf16/fp16/fp32 GEMMs return the input dtype)."""
    world = _world(group_name)
    if world == 1:
        dts, scales = out_dtypes or [None] * len(bs), b_scales or [None] * len(bs)
        outs = [scaled_matmul(a2d, b, a_scale, s, d) for b, s, d in zip(bs, scales, dts)]
        return (a2d if return_a else None), a_scale, outs
    if a2d.numel() == 0 or any(b.numel() == 0 for b in bs):
        backend = "NCCL"  # nothing to overlap
    codes = out_dtype_codes(out_dtypes) if out_dtypes else []
    op = _op(all_gather_matmul_impl, a2d, *bs)
    res = op(a2d, bs, a_scale, b_scales, group_name, return_a, codes, backend or "", num_splits or 0)
    scale_full = res[1] if res[1].numel() else a_scale
    return (res[0] if return_a else None), scale_full, list(res[2:])


def fused_all_gather_matmul(
    a_shard: torch.Tensor,
    b_list: list[torch.Tensor],
    gather_dim: int,
    group=None,
    *,
    return_a: bool = True,
    out_dtypes=None,
    fp8_config: Float8QuantConfig | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(all_gather(a_shard, gather_dim) or None, [a_full @ b for b in b_list]), comm overlapped.

    With ``fp8_config`` the GEMMs run in FP8 (a_shard is quantized before the gather: half the
    bytes on the wire) and the returned ``a_full`` is the gathered *FP8* tensor; call
    ``fused_all_gather_scaled_matmul`` directly when the gathered scales are needed too.
    ``out_dtypes``: one dtype for every output or a list with one per b (None entries: the default,
    a_shard's dtype); bf16/fp16/fp32 GEMMs return the input dtype, FP8 ones any of bf16/fp16/fp32
    (row-wise FP8 on CUDA: bf16 only, as cuBLAS).
    ``num_splits`` (TURBO): row blocks per pushed shard; None picks from a comm/GEMM time model.
    """
    group_name = _group_name(group)
    bs = list(b_list) if isinstance(b_list, (list, tuple)) else [b_list]
    _check_operands(a_shard, bs, "a_shard", scaled=False)
    dim = _check_dim("gather_dim", gather_dim, a_shard)
    fp8 = getattr(fp8_config, "granularity", None)
    _check_ag_ranks_agree("fused_all_gather_matmul", a_shard, dim, fp8, return_a, backend, group_name)
    a2d, lead = _to_front_2d(a_shard, dim)
    if fp8_config is None:
        dts = _out_dtype_list(out_dtypes, len(bs), a_shard.dtype, False)
        if any(d != a_shard.dtype for d in dts):
            raise ValueError(
                f"out_dtypes: bf16/fp16/fp32 GEMMs return the input dtype {a_shard.dtype}, got {out_dtypes}"
            )
        a_full, _, outs = _all_gather_matmul_2d(
            a2d, bs, None, [], group_name, return_a, None, backend, num_splits
        )
    else:
        rowwise = getattr(fp8_config, "granularity", None) is ScalingGranularity.ROWWISE
        dts = _out_dtype_list(out_dtypes, len(bs), a_shard.dtype, rowwise and a_shard.is_cuda)
        a_q, a_scale, b_q, b_scales = _quantize_operands(a2d, bs, fp8_config, group_name)
        a_full, _, outs = _all_gather_matmul_2d(
            a_q, b_q, a_scale, b_scales, group_name, return_a, dts, backend, num_splits
        )
    full_lead = [lead[0] * _world(group_name), *lead[1:]]
    outs = [_from_front_2d(o, full_lead, dim) for o in outs]
    if a_full is not None:
        a_full = _from_front_2d(a_full, full_lead, dim)
    return a_full, outs


def fused_all_gather_scaled_matmul(
    a_shard: torch.Tensor,
    b_list: list[torch.Tensor],
    a_scale: torch.Tensor,
    b_scales: list[torch.Tensor],
    gather_dim: int,
    group=None,
    *,
    return_a: bool = True,
    out_dtypes=None,
    backend: str | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[torch.Tensor]]:
    """FP8 operands with dequant scales: (a_full fp8 or None, a_scale_full, outs).

    a_scale: a scalar (tensor-wise, equal on every rank) or [..., 1] row-wise matching a_shard's
    leading dims; b_scales[i]: scalar or [1, N_i]; b_list[i] column-major [K, N_i].
    """
    group_name = _group_name(group)
    bs = list(b_list)
    _check_operands(a_shard, bs, "a_shard", scaled=True)
    dim = _check_dim("gather_dim", gather_dim, a_shard)
    if len(b_scales) != len(bs):
        raise ValueError(f"b_scales: expected {len(bs)} scales (one per b), got {len(b_scales)}")
    a2d, lead = _to_front_2d(a_shard, dim)
    a_scale = _a_scale_2d(a_scale, a_shard, dim, "a_shard")
    kind = "rowwise" if a_scale.dim() == 2 else "tensorwise"
    _check_ag_ranks_agree("fused_all_gather_scaled_matmul", a_shard, dim, kind, return_a, backend, group_name)
    dts = _out_dtype_list(out_dtypes, len(bs), torch.bfloat16, a_scale.dim() == 2 and a_shard.is_cuda)
    a_full, scale_full, outs = _all_gather_matmul_2d(
        a2d, bs, a_scale, [s.float() for s in b_scales], group_name, return_a, dts, backend, num_splits
    )
    full_lead = [lead[0] * _world(group_name), *lead[1:]]
    outs = [_from_front_2d(o, full_lead, dim) for o in outs]
    if a_full is not None:
        a_full = _from_front_2d(a_full, full_lead, dim)
        if scale_full is not None and scale_full.dim() == 2:
            scale_full = _from_front_2d(scale_full, full_lead, dim)
    return a_full, (scale_full if return_a else None), outs


# -- matmul + reduce-scatter ----------------------------------------------------------------------
def _check_reduce_scatter(a, b, reduce_op, scatter_dim, group_name, scaled, op, **flags):
    """Validate; ``flags`` (fp8 granularity, out dtype, backend) join the ranks' debug-mode comparison."""
    _check_operands(a, [b], "a", scaled=scaled)
    if reduce_op not in ("sum", "avg"):
        raise ValueError(f"reduce_op: expected 'sum' or 'avg', got {reduce_op!r}")
    dim = _check_dim("scatter_dim", scatter_dim, a)
    world = _world(group_name)
    if a.shape[dim] % world:
        raise ValueError(
            f"scatter_dim={scatter_dim}: size {a.shape[dim]} of a {tuple(a.shape)} is not divisible by the "
            f"group size {world}; pad it to a multiple of {world}"
        )
    if debug_checks_enabled():
        sig = dict(a=(tuple(a.shape), a.dtype), n=b.shape[1], scatter_dim=dim, reduce_op=reduce_op)
        check_ranks_agree(op, dict(sig, **flags), group_name)
    return dim, world


def _fp8_out_dtype(out_dtype) -> torch.dtype:
    """An FP8 GEMM+RS output dtype: the CPU path cast to anything (int32 truncated the sums silently)."""
    if out_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"out_dtype: FP8 GEMMs return bfloat16, float16 or float32, got {out_dtype}")
    return out_dtype


def _op(op, *tensors: torch.Tensor):
    """``op`` (eager_direct: its body in eager mode, the custom op when traced), or the registered
    custom op itself while autograd records ``tensors``: the body's out= GEMMs do not support autograd."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return op.custom_op
    return op


def _matmul_reduce_scatter_2d(
    a2d, b, a_scale, b_scale, reduce_op, group_name, out_dtype, backend, num_splits
):
    if _world(group_name) == 1:
        return scaled_matmul(a2d, b, a_scale, b_scale, out_dtype)
    if a2d.numel() == 0 or b.numel() == 0:
        backend = "NCCL"
    op = _op(matmul_reduce_scatter_impl, a2d, b)
    return op(a2d, b, a_scale, b_scale, reduce_op, group_name, out_dtype, backend or "", num_splits or 0)


def fused_matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    reduce_op: str = "sum",
    scatter_dim: int = 0,
    group=None,
    *,
    fp8_config: Float8QuantConfig | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """reduce_scatter(a @ b, reduce_op, scatter_dim) over ``group``, comm overlapped with the GEMM."""
    group_name = _group_name(group)
    fp8 = getattr(fp8_config, "granularity", None)
    dim, world = _check_reduce_scatter(
        a, b, reduce_op, scatter_dim, group_name, False, "fused_matmul_reduce_scatter",
        fp8=fp8, out_dtype=out_dtype or a.dtype, backend=_backend_key(backend),
    )  # fmt: skip
    a2d, lead = _to_front_2d(a, dim)
    if fp8_config is None:
        if out_dtype not in (None, a.dtype):
            raise ValueError(
                f"out_dtype: bf16/fp16/fp32 GEMMs return the input dtype {a.dtype}, got {out_dtype}"
            )
        out = _matmul_reduce_scatter_2d(a2d, b, None, None, reduce_op, group_name, None, backend, num_splits)
    else:
        out_dtype = _fp8_out_dtype(out_dtype or a.dtype)
        a_q, a_scale, (b_q,), (b_scale,) = _quantize_operands(a2d, [b], fp8_config, None)
        out = _matmul_reduce_scatter_2d(
            a_q, b_q, a_scale, b_scale, reduce_op, group_name, out_dtype, backend, num_splits
        )
    return _from_front_2d(out, [lead[0] // world, *lead[1:]], dim)


def fused_scaled_matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    reduce_op: str = "sum",
    scatter_dim: int = 0,
    group=None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """FP8 ``a`` [..., K] and column-major ``b`` [K, N] with dequant scales (scalar or row-wise)."""
    group_name = _group_name(group)
    out_dtype = _fp8_out_dtype(out_dtype)
    dim, world = _check_reduce_scatter(
        a, b, reduce_op, scatter_dim, group_name, True, "fused_scaled_matmul_reduce_scatter",
        out_dtype=out_dtype, backend=_backend_key(backend),
    )  # fmt: skip
    a2d, lead = _to_front_2d(a, dim)
    a_scale = _a_scale_2d(a_scale, a, dim, "a")
    out = _matmul_reduce_scatter_2d(
        a2d, b, a_scale, b_scale.float(), reduce_op, group_name, out_dtype, backend, num_splits
    )
    return _from_front_2d(out, [lead[0] // world, *lead[1:]], dim)
