"""Async tensor parallel: all-gather+GEMM and GEMM+reduce-scatter, three backends each.

Entry points (torch.library custom ops with fake twins, called by ``turbo.ops.async_tp``):

    primus_turbo::all_gather_matmul(a_shard[m, K], bs[K, N_i], a_scale?, b_scales, group_name,
                                    return_a, out_dtypes, backend) -> [a_full, a_scale_full, *outs]
    primus_turbo::matmul_reduce_scatter(a[M, K], b[K, N], a_scale?, b_scale?, reduce_op,
                                        group_name, out_dtype, backend) -> out[M / world, N]

Inputs are already 2-D with the gathered/scattered dim first (the op layer moves it there), FP8
operands already quantized (``a_scale``/``b_scales`` are the dequantization scales of
``torch._scaled_mm``: tensor-wise 0-d scalars, or row-wise ``[rows, 1]`` / ``[1, N]``). A tensor-wise
``a_scale`` must be equal on every rank (the op layer all-reduces the amax to guarantee it).
Unused outputs (``a_full`` when ``return_a`` is False, ``a_scale_full`` for bf16 / tensor-wise)
come back as empty tensors. ``out_dtypes``: one code per b (``OUT_DTYPES`` index; a custom-op schema
has no list-of-dtypes type), or empty for the default (bf16 for FP8 operands, else the input dtype).

Backends:
  NCCL      unfused: all_gather_into_tensor then GEMM / GEMM then reduce_scatter_tensor. Any group
            (gloo on CPU), any device: the reference and the fallback.
  SYMM_MEM  torch.ops.symm_mem fused ops (pull-based pipeline in torch). CUDA + NCCL group only.
  TURBO     own push-based copy-engine pipeline (symm_mem_pipeline.py). CUDA + NCCL group only.

GEMMs are torch.mm / torch._scaled_mm (cuBLAS, the fastest bf16/FP8 GEMM on H200) rather than
turbo.ops.gemm: the pipelines write each row block into a slice of the output (``out=``), which
turbo.ops.gemm does not take.

Backend choice: ``backend=`` argument (pinned; raises if it cannot handle the inputs), else the
in-code default (the measured rule next to _FUSED_MIN_FLOP): NCCL below ~0.2 ms of GEMM per rank or
off CUDA+NCCL; above it SYMM_MEM, except TURBO for comm-heavy all-gathers. Autotune is disabled for
these dispatchers: each rank would time the candidates independently and could pick different
backends, which deadlocks.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.utils import eager_direct
from primus_turbo.pytorch.kernels.async_tp.scaled_matmul import scaled_matmul
from primus_turbo.pytorch.kernels.async_tp.symm_mem_pipeline import (
    enable_symm_mem_for_group,
    matmul_reduce_scatter_cpp,
    pipelined_all_gather_consume,
    pipelined_produce_reduce_scatter,
    symm_mem_available,
)

__all__ = [
    "AllGatherMatmulDispatcher",
    "MatmulReduceScatterDispatcher",
    "all_gather_matmul_impl",
    "matmul_reduce_scatter_impl",
    "scaled_matmul",
    "group_info",
]

warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated", category=FutureWarning)

# Default backend rule, from bench_async_tp --quick on 2x H200, bf16 (ms: unfused / SYMM_MEM / TURBO):
#   AG+GEMM 8192x4096x14336  0.80 / 0.71 / 0.72    GEMM+RS  1.17 / 0.92 / 0.94
#   AG+GEMM 8192x8192x8192   1.02 / 0.80 / 0.83    GEMM+RS  1.06 / 0.90 / 0.93
#   AG+GEMM 16384x7168x2048  0.82 / 0.58 / 0.44    GEMM+RS  0.49 / 0.42 / 0.44
#   AG+GEMM 4096x4096x4096   0.20 / 0.39 / 0.33    GEMM+RS  0.20 / 0.27 / 0.32
# (1) Fused only from 2**37 flop per rank (~0.2 ms of bf16 GEMM; FP8: twice that): 4096^3 (6.9e10 per
#     rank) loses 28-49% to the pipelines' host/launch cost, 16384x7168x2048 (2.4e11) wins 14-86%.
# (2) AG+GEMM: TURBO when the gather is comm-heavy (model push time >= 0.5 x the rank's GEMM:
#     16384x7168x2048 is 0.9, TURBO 1.86x vs SYMM_MEM 1.41x), else SYMM_MEM (1-4% ahead at 0.13-0.23).
# (3) GEMM+RS: SYMM_MEM (2-5% ahead of TURBO at all three). TURBO's addmm-fused reduction is newer
#     than this table: re-measure, and set _RS_FUSED_BACKEND = BackendType.TURBO if it wins.
_FUSED_MIN_FLOP = 2**37
_AG_TURBO_MIN_COMM_RATIO = 0.5
_RS_FUSED_BACKEND = BackendType.SYMM_MEM
_RS_FUSE_OWN_MIN_S = 0.6e-3  # est. GEMM seconds per rank (650 TFLOP/s) from which the csrc GEMM+RS uses addmm


# -- helpers --------------------------------------------------------------------------------------
def group_info(group_name: str) -> tuple[Any, int, int]:
    group = c10d._resolve_process_group(group_name)
    return group, group.size(), group.rank()


def _nccl_group(group_name: str) -> bool:
    try:
        group, _, _ = group_info(group_name)
    except Exception:
        return False
    cached = _NCCL_GROUPS.get(group_name)
    if cached is None or cached[0] is not group:  # a destroyed group's name may come back
        try:
            cached = _NCCL_GROUPS[group_name] = (group, dist.get_backend(group) == "nccl")
        except Exception:
            return False
    return cached[1]


_NCCL_GROUPS: dict[str, tuple[Any, bool]] = {}


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 travels as uint8: gloo has no fp8 type and NCCL support depends on the version."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def _rowwise(scale: torch.Tensor | None) -> bool:
    """Row-wise scales are 2-D [rows, 1], tensor-wise ones 0-d (the op layer normalizes them): told apart
    by dim, not numel, since a one-row shard's row-wise scale has one element too, and each rank's differs."""
    return scale is not None and scale.dim() == 2


def _out_dtype(a: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if a.element_size() == 1 else a.dtype


OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # out_dtypes codes of all_gather_matmul


def out_dtype_codes(dtypes: list[torch.dtype]) -> list[int]:
    return [OUT_DTYPES.index(d) for d in dtypes]


def _out_dtypes(a: torch.Tensor, codes: list[int], n: int) -> list[torch.dtype]:
    return [OUT_DTYPES[c] for c in codes] if codes else [_out_dtype(a, None)] * n


# -- all-gather + matmul backends -----------------------------------------------------------------
def _ag_empty_extras(a_shard: torch.Tensor) -> torch.Tensor:
    return a_shard.new_empty(0)


def _empty_scale(a_shard: torch.Tensor) -> torch.Tensor:
    # a separate allocation: custom ops may not return aliased outputs
    return a_shard.new_empty(0, dtype=torch.float32)


class _AGNccl(KernelBackend):
    @staticmethod
    def can_handle(**kw: Any) -> bool:
        return True

    @staticmethod
    def execute(a_shard, bs, a_scale, b_scales, group_name, return_a, out_dtypes, **_) -> list[torch.Tensor]:
        group, world, _ = group_info(group_name)
        a_full = a_shard.new_empty((world * a_shard.shape[0], *a_shard.shape[1:]))
        dist.all_gather_into_tensor(_bytes_view(a_full), _bytes_view(a_shard), group=group)
        scale_full = a_scale
        if _rowwise(a_scale):
            scale_full = a_scale.new_empty((world * a_scale.shape[0], 1))
            dist.all_gather_into_tensor(scale_full, a_scale.contiguous(), group=group)
        outs = [
            scaled_matmul(a_full, b, scale_full, bs_scale, dtype if a_scale is not None else None)
            for b, bs_scale, dtype in zip(bs, b_scales or [None] * len(bs), out_dtypes)
        ]
        extras = _ag_empty_extras(a_shard)
        return [
            a_full if return_a else extras,
            scale_full if (return_a and _rowwise(a_scale)) else _empty_scale(a_shard),
            *outs,
        ]


def _fp8_dims_ok(a_scale, k: int, ns) -> bool:
    """torch's fused symm_mem FP8 ops call cuBLAS unpadded: K and every N must be multiples of 16."""
    return a_scale is None or (k % 16 == 0 and all(n % 16 == 0 for n in ns))


class _AGSymmMem(KernelBackend):
    @staticmethod
    def can_handle(a_shard, group_name, bs=(), a_scale=None, **_) -> bool:
        return (
            a_shard.is_cuda
            and symm_mem_available()
            and _nccl_group(group_name)
            and _fp8_dims_ok(a_scale, a_shard.shape[-1], [b.shape[1] for b in bs])
            # torch's op takes a one-element A_scale as tensor-wise: a one-row shard's row-wise scale would
            # then scale every gathered row by this rank's
            and not (_rowwise(a_scale) and a_scale.numel() == 1)
        )

    @staticmethod
    def execute(a_shard, bs, a_scale, b_scales, group_name, return_a, out_dtypes, **_) -> list[torch.Tensor]:
        enable_symm_mem_for_group(group_name)
        extras = _ag_empty_extras(a_shard)
        if a_scale is None:
            a_full, outs = torch.ops.symm_mem.fused_all_gather_matmul(
                a_shard, bs, 0, group_name, return_A=return_a
            )
            return [a_full if return_a else extras, _empty_scale(a_shard), *outs]
        a_full, outs = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
            a_shard,
            bs,
            a_scale,
            list(b_scales),
            0,
            group_name,
            [None] * len(bs),
            [None] * len(bs),
            list(out_dtypes),
            [False] * len(bs),
        )
        scale_full = _empty_scale(a_shard)
        if return_a and _rowwise(a_scale):  # torch does not return the gathered scales
            _, world, _ = group_info(group_name)
            scale_full = a_scale.new_empty((world * a_scale.shape[0], 1))
            dist.all_gather_into_tensor(scale_full, a_scale.contiguous(), group=group_info(group_name)[0])
        return [a_full if return_a else extras, scale_full, *outs]


class _AGTurbo(KernelBackend):
    @staticmethod
    def can_handle(a_shard, group_name, **_) -> bool:
        return a_shard.is_cuda and symm_mem_available() and _nccl_group(group_name)

    @staticmethod
    def execute(
        a_shard, bs, a_scale, b_scales, group_name, return_a, out_dtypes, num_splits=None, **_
    ) -> list[torch.Tensor]:
        _, world, rank = group_info(group_name)
        rows = a_shard.shape[0]
        outs = [a_shard.new_empty((world * rows, b.shape[1]), dtype=dt) for b, dt in zip(bs, out_dtypes)]
        rowwise = _rowwise(a_scale)
        shards = [a_shard, a_scale.contiguous()] if rowwise else [a_shard]
        b_scales = list(b_scales) or [None] * len(bs)

        def consume(block: list[torch.Tensor], row0: int) -> None:
            scale = block[1] if rowwise else a_scale
            for b, b_scale, out in zip(bs, b_scales, outs):
                rows_out = out[row0 : row0 + block[0].shape[0]]
                dtype = out.dtype if scale is not None else None
                scaled_matmul(block[0], b, scale, b_scale, dtype, out=rows_out)

        gathered = None
        extras = _ag_empty_extras(a_shard)
        if return_a:
            gathered = [a_shard.new_empty((world * rows, *a_shard.shape[1:]))]
            if rowwise:
                gathered.append(a_scale.new_empty((world * rows, 1)))
        splits = num_splits if num_splits else _default_splits(a_shard, bs, world)
        pipelined_all_gather_consume(shards, consume, gathered, group_name, world, rank, splits)
        a_full = gathered[0] if return_a else extras
        scale_full = gathered[1] if (return_a and rowwise) else _empty_scale(a_shard)
        return [a_full, scale_full, *outs]


def _default_splits(a_shard: torch.Tensor, bs: list[torch.Tensor], world: int) -> int:
    """Row blocks per pushed shard: 1 when the local GEMM hides the whole push, more when comm-heavy.

    Push time ~ bytes / 350 GB/s (copy engine, NVLink NV18); local GEMM ~ flop / 650 TFLOP/s.
    Extra blocks cost a barrier and a GEMM launch per peer each (~30 us of host time per GEMM on the
    H200 hosts measured), so split only when the push outlasts the GEMM, and at most in 2: on 2x H200
    (session 13) 4 blocks lost to 1-2 at every issue shape, the comm-heavy 16384x7168x2048 included.
    """
    push_s = a_shard.numel() * a_shard.element_size() * (world - 1) / 350e9
    gemm_s = 2 * a_shard.shape[0] * a_shard.shape[1] * sum(b.shape[1] for b in bs) / 650e12
    return 1 if push_s <= 0.8 * gemm_s else 2


def _rs_default_splits(out: torch.Tensor, k: int, n: int, world: int, fused: bool) -> int:
    """Row blocks for the GEMM+RS push pipeline, from push ~ bytes / 350 GB/s vs GEMM ~ 650 TFLOP/s.

    Fused (addmm onto the arrived partials): own block j waits for the peers' block j, so with P
    blocks the pushes hide when push <= (P - 1) x one peer block's GEMM; 2x margin for the copy
    engine slowing down next to a running GEMM. Unfused (reduction pass): the last push overlaps
    the whole own-block GEMM, so 1 block unless the push outlasts it.
    """
    push_s = out.numel() * out.element_size() * (world - 1) / 350e9
    gemm_s = 2 * out.shape[0] * k * n / 650e12  # one rank block
    if not fused:
        return 1 if push_s <= 0.8 * gemm_s else 2
    ratio = push_s / max(gemm_s * (world - 1), 1e-12)
    return 2 if ratio <= 0.5 else 3 if ratio <= 1.0 else 4


def _has_cpp_rs() -> bool:
    """The csrc GEMM+RS schedule is built (a CUDA torch build; it is part of the CUDA extension).
    PRIMUS_TURBO_ASYNC_TP_CPP=0 keeps the Python schedule (same kernels, more host time)."""
    global _CPP_RS
    if _CPP_RS is None:
        from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION

        _CPP_RS = (
            HAS_CPP_EXTENSION
            and os.environ.get("PRIMUS_TURBO_ASYNC_TP_CPP", "1") != "0"
            and hasattr(torch.ops.primus_turbo_cpp_extension, "async_tp_rs_fused")
        )
    return _CPP_RS


_CPP_RS: bool | None = None


# -- matmul + reduce-scatter backends -------------------------------------------------------------
class _RSNccl(KernelBackend):
    @staticmethod
    def can_handle(**kw: Any) -> bool:
        return True

    @staticmethod
    def execute(a, b, a_scale, b_scale, reduce_op, group_name, out_dtype, **_) -> torch.Tensor:
        group, world, _ = group_info(group_name)
        partial = scaled_matmul(a, b, a_scale, b_scale, _out_dtype(a, out_dtype))
        out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
        op = dist.ReduceOp.SUM if reduce_op == "sum" else dist.ReduceOp.AVG
        if op == dist.ReduceOp.AVG and dist.get_backend(group) != "nccl":
            dist.reduce_scatter_tensor(out, partial, op=dist.ReduceOp.SUM, group=group)
            return out.div_(world)
        dist.reduce_scatter_tensor(out, partial, op=op, group=group)
        return out


class _RSSymmMem(KernelBackend):
    @staticmethod
    def can_handle(a, group_name, b=None, a_scale=None, **_) -> bool:
        ns = [b.shape[1]] if b is not None else []
        return (
            a.is_cuda
            and symm_mem_available()
            and _nccl_group(group_name)
            and _fp8_dims_ok(a_scale, a.shape[-1], ns)
        )

    @staticmethod
    def execute(a, b, a_scale, b_scale, reduce_op, group_name, out_dtype, **_) -> torch.Tensor:
        enable_symm_mem_for_group(group_name)
        if a_scale is None:
            return torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, reduce_op, 0, group_name)
        op = torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter.default
        names = {arg.name for arg in op._schema.arguments}
        kwargs = dict(A=a, B=b, A_scale=a_scale, B_scale=b_scale, reduce_op=reduce_op, group_name=group_name)
        if "orig_scatter_dim" in names:  # torch >= 2.8 schema (reshape-aware scatter dims)
            kwargs.update(orig_scatter_dim=0, scatter_dim_after_maybe_reshape=0)
            kwargs.update(output_shape=[a.shape[0], b.shape[1]])
        else:
            kwargs.update(scatter_dim=0)
        return op(**kwargs, out_dtype=_out_dtype(a, out_dtype))


class _RSTurbo(KernelBackend):
    @staticmethod
    def can_handle(a, group_name, **_) -> bool:
        return a.is_cuda and symm_mem_available() and _nccl_group(group_name)

    @staticmethod
    def execute(
        a, b, a_scale, b_scale, reduce_op, group_name, out_dtype, num_splits=None, **_
    ) -> torch.Tensor:
        _, world, rank = group_info(group_name)
        dtype = _out_dtype(a, out_dtype)
        out = a.new_empty((a.shape[0] // world, b.shape[1]), dtype=dtype)
        rowwise = _rowwise(a_scale)

        def produce(r0: int, r1: int, dst: torch.Tensor) -> None:
            scale = a_scale[r0:r1] if rowwise else a_scale
            scaled_matmul(a[r0:r1], b, scale, b_scale, dtype, out=dst)

        def accumulate(r0: int, r1: int, c: torch.Tensor, alpha: float, beta: float, dst: torch.Tensor):
            torch.addmm(c, a[r0:r1], b, beta=beta, alpha=alpha, out=dst)

        # bf16/fp16/fp32: the own block is computed onto the peers' pushed partials (addmm epilogue,
        # no reduction kernel); FP8 (_scaled_mm has no C input) keeps the reduction pass.
        fused = a_scale is None
        if fused and _has_cpp_rs():
            # GEMM-bound calls: own block in the addmm epilogue (no extra pass); host-bound ones (the
            # rank's GEMM under _RS_FUSE_OWN_MIN_S): fewer GEMM launches, one add pass, one block (the own
            # GEMM overlaps the whole push)
            fuse_own = 2 * a.shape[0] * a.shape[1] * b.shape[1] / 650e12 >= _RS_FUSE_OWN_MIN_S
            default = _rs_default_splits(out, a.shape[1], b.shape[1], world, True) if fuse_own else 1
            splits = num_splits or default
            matmul_reduce_scatter_cpp(a, b, out, reduce_op, group_name, world, rank, splits, fuse_own)
            return out
        splits = num_splits if num_splits else _rs_default_splits(out, a.shape[1], b.shape[1], world, fused)
        pipelined_produce_reduce_scatter(
            produce, out, reduce_op, group_name, world, rank, splits, accumulate if fused else None
        )
        return out


# -- dispatchers ----------------------------------------------------------------------------------
class _AsyncTPDispatcher(AutoKernelDispatcher):
    """Automatic choice: on CUDA with a group of >= 2 ranks, measured once per key (every backend timed on
    every rank, the slowest rank's time counts, unfused NCCL unless another is >= 3% faster), so the
    dispatcher is never slower than unfused beyond noise and all ranks agree. The static heuristic
    (``default_backend``) decides elsewhere and with PRIMUS_TURBO_ASYNC_TP_MEASURE=0."""

    op_name = "async_tp"
    cache_default = True  # the measured answer is kept per key
    autotune_warmup, autotune_iters = 2, 5
    last_measured: dict = {}

    @classmethod
    def _measure(cls, kwargs: dict[str, Any]) -> BackendType | None:
        from primus_turbo.pytorch.core.collective_choice import (
            can_measure,
            measured_choice,
            measuring_enabled,
        )

        group, _, _ = group_info(kwargs["group_name"])
        if not measuring_enabled("PRIMUS_TURBO_ASYNC_TP_MEASURE") or not can_measure(group, kwargs):
            return None
        best, times = measured_choice(cls, group, BackendType.NCCL, kwargs)
        cls.last_measured = {b.name: ms for b, ms in times.items()}
        return best

    @classmethod
    def _automatic(cls, **kwargs: Any) -> BackendType:
        return cls._measure(kwargs) or super()._automatic(**kwargs)

    @classmethod
    def _autotune(cls, **kwargs: Any) -> BackendType | None:
        return cls._measure(kwargs)  # rank-consistent; a per-rank autotune could deadlock


class AllGatherMatmulDispatcher(_AsyncTPDispatcher):
    backends = {BackendType.NCCL: _AGNccl, BackendType.SYMM_MEM: _AGSymmMem, BackendType.TURBO: _AGTurbo}

    @classmethod
    def make_key(cls, a_shard, bs, group_name, a_scale=None, **_) -> tuple:
        return (
            tuple(a_shard.shape),
            a_shard.dtype,
            tuple(tuple(b.shape) for b in bs),
            group_name,
            _rowwise(a_scale),
        )

    @classmethod
    def default_backend(cls, a_shard, bs, group_name, a_scale=None, **kw) -> BackendType | None:
        _, world, _ = group_info(group_name)
        gemm_flop = 2 * world * a_shard.shape[0] * a_shard.shape[1] * sum(b.shape[1] for b in bs)
        fusable = _AGTurbo.can_handle(a_shard=a_shard, group_name=group_name)
        if gemm_flop < _fused_min_flop(a_scale) or not fusable:
            return BackendType.NCCL
        push_s = a_shard.numel() * a_shard.element_size() * (world - 1) / 350e9
        gemm_s = gemm_flop / (1300e12 if a_scale is not None else 650e12)
        return BackendType.TURBO if push_s >= _AG_TURBO_MIN_COMM_RATIO * gemm_s else BackendType.SYMM_MEM


class MatmulReduceScatterDispatcher(_AsyncTPDispatcher):
    backends = {BackendType.NCCL: _RSNccl, BackendType.SYMM_MEM: _RSSymmMem, BackendType.TURBO: _RSTurbo}

    @classmethod
    def make_key(cls, a, b, group_name, a_scale=None, **_) -> tuple:
        return (tuple(a.shape), a.dtype, tuple(b.shape), group_name, _rowwise(a_scale))

    @classmethod
    def default_backend(cls, a, b, group_name, a_scale=None, **kw) -> BackendType | None:
        flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        if flop >= _fused_min_flop(a_scale) and _RSTurbo.can_handle(a=a, group_name=group_name):
            return _RS_FUSED_BACKEND
        return BackendType.NCCL


def _fused_min_flop(a_scale: torch.Tensor | None) -> int:
    return _FUSED_MIN_FLOP * (2 if a_scale is not None else 1)  # FP8 GEMMs run ~2x faster


def _run(dispatcher: type[_AsyncTPDispatcher], backend: str, **kw: Any) -> Any:
    if not backend:
        return dispatcher.dispatch(**kw)
    pinned = BackendType.parse(backend, source="async_tp(backend=...)")
    impl = dispatcher.backends.get(pinned)
    if impl is None:
        raise ValueError(
            f"async_tp: backend {pinned.name} is not implemented; "
            f"available: {', '.join(b.name for b in dispatcher.backends)}"
        )
    if not impl.can_handle(**kw):
        raise ValueError(
            f"async_tp: backend {pinned.name} cannot handle these inputs ({dispatcher.describe(**kw)}); "
            f"it needs CUDA tensors, an NCCL process group and torch symmetric memory (SYMM_MEM with FP8: "
            f"K and every N multiples of 16, and row-wise scales over shards of more than one row)"
            if pinned is not BackendType.NCCL
            else f"async_tp: backend NCCL cannot handle ({dispatcher.describe(**kw)})"
        )
    dispatcher.last_backend = pinned
    return impl.execute(**kw)


# -- custom ops -----------------------------------------------------------------------------------
# Opaque nodes with fake shapes for torch.compile; eager calls run the bodies directly (eager_direct).
@eager_direct
@torch.library.custom_op("primus_turbo::all_gather_matmul", mutates_args=())
def all_gather_matmul_impl(
    a_shard: torch.Tensor,
    bs: list[torch.Tensor],
    a_scale: torch.Tensor | None,
    b_scales: list[torch.Tensor],
    group_name: str,
    return_a: bool,
    out_dtypes: list[int],
    backend: str,
    num_splits: int,
) -> list[torch.Tensor]:
    return _run(
        AllGatherMatmulDispatcher,
        backend,
        a_shard=a_shard,
        bs=list(bs),
        a_scale=a_scale,
        b_scales=list(b_scales),
        group_name=group_name,
        return_a=return_a,
        out_dtypes=_out_dtypes(a_shard, list(out_dtypes), len(bs)),
        num_splits=num_splits,
    )


@all_gather_matmul_impl.register_fake
def _(a_shard, bs, a_scale, b_scales, group_name, return_a, out_dtypes, backend, num_splits):
    _, world, _ = group_info(group_name)
    rows = world * a_shard.shape[0]
    dtypes = _out_dtypes(a_shard, list(out_dtypes), len(bs))
    a_full = a_shard.new_empty((rows, *a_shard.shape[1:])) if return_a else a_shard.new_empty(0)
    rowwise = _rowwise(a_scale)
    scale_full = (
        a_scale.new_empty((rows, 1)) if (return_a and rowwise) else a_shard.new_empty(0, dtype=torch.float32)
    )
    outs = [a_shard.new_empty((rows, b.shape[1]), dtype=dt) for b, dt in zip(bs, dtypes)]
    return [a_full, scale_full, *outs]


@eager_direct
@torch.library.custom_op("primus_turbo::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter_impl(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor | None,
    b_scale: torch.Tensor | None,
    reduce_op: str,
    group_name: str,
    out_dtype: torch.dtype | None,
    backend: str,
    num_splits: int,
) -> torch.Tensor:
    return _run(
        MatmulReduceScatterDispatcher,
        backend,
        a=a,
        b=b,
        a_scale=a_scale,
        b_scale=b_scale,
        reduce_op=reduce_op,
        group_name=group_name,
        out_dtype=out_dtype,
        num_splits=num_splits,
    )


@matmul_reduce_scatter_impl.register_fake
def _(a, b, a_scale, b_scale, reduce_op, group_name, out_dtype, backend, num_splits):
    _, world, _ = group_info(group_name)
    return a.new_empty((a.shape[0] // world, b.shape[1]), dtype=_out_dtype(a, out_dtype))
