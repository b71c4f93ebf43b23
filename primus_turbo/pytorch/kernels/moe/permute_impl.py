"""Token permute / unpermute: row-id map construction and kernel launches (custom ops).

Backends: TRITON (primus_turbo/triton/moe/permute_kernel.py), TURBO (csrc/kernels/moe/permute.cu,
when the extension is built; same row-id map, same results) and an eager TORCH fallback for CPUs
without the Triton interpreter. ``PermuteDispatcher`` picks TURBO > TRITON > TORCH by default;
the benchmark pins each in turn.
"""

from __future__ import annotations

import functools

import torch
import triton

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.utils import ceil_div, eager_direct, triton_can_run_on


def build_row_id_map(
    routing: torch.Tensor,
    num_experts: int,
    num_out_tokens: int | None,
    pad_multiple: int,
    capacity: int | None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Destination row of every (token, route) pair, without a host sync when sizes are known.

    ``routing`` is a bool routing map [T, E] or int indices [T, K] (-1 = no route). Rows are
    grouped by expert, tokens in order within an expert. Returns (row_id_map [T, K or E] int32,
    tokens_per_expert [E] int32 with padding/capacity applied, number of output rows).
    Eager: for int indices on CUDA the C++ op (csrc/kernels/moe/row_id_map.cu) when the extension is
    built, else Triton (a memset and four launches for indices; primus_turbo/triton/moe/row_id_map_kernel.py)
    where it can run, else torch; all three agree integer for integer. Under torch.compile the torch ops
    are traced (Inductor fuses them).
    """
    eager = not torch.compiler.is_compiling()
    if eager and _cpp_map_can_run(routing, num_experts):
        return _build_row_id_map_cpp(routing, num_experts, num_out_tokens, pad_multiple, capacity)
    eager_triton = eager and triton_can_run_on(routing)
    if eager_triton and routing.shape[0] > 0 and num_experts <= _MAX_TRITON_EXPERTS:
        # the kernels treat indices outside [0, E) as dropped routes themselves
        return _build_row_id_map_triton(routing, num_experts, num_out_tokens, pad_multiple, capacity)
    return _build_row_id_map_torch(
        _safe_routing(routing, num_experts), num_experts, num_out_tokens, pad_multiple, capacity
    )


def _safe_routing(routing: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Indices on CUDA are not range-checked without PRIMUS_TURBO_DEBUG_CHECKS=1 (that needs a
    sync): out-of-range values become dropped routes (-1), never an out-of-bounds write."""
    if routing.dtype == torch.bool or routing.device.type == "cpu" or not routing.numel():
        return routing
    return torch.where((routing < -1) | (routing >= num_experts), -1, routing)


# Above this many experts the torch path runs: the count and base arrays hold E x NC ints each (for indices
# E x T x K / 64: 0.5 MB at 4096 tokens top-8 x 256 experts, 128 MB at 32768 x 8 x 8192), a bool map is E
# columns wide, and the index kernels' packed (expert, token) keys need E < 2^14
_MAX_TRITON_EXPERTS = 8192
_TILE = 4096  # elements per program tile in the bool-map kernels, the chunk scan and the offsets scan
# Bool map: token chunks per expert column (grid E x NT): aim for ~2048 programs, several waves over H100's
# 132 SMs (NT = 8 at 256 experts, 64 at 8); at most 64 chunks; at least 64 tokens a chunk so small batches
# are not cut into slivers. Not yet tuned on a GPU.
_TARGET_PROGRAMS = 2048
_MAX_CHUNKS = 64
_MIN_CHUNK_T = 64
# Indices: ~64 flat routes a program (whole tokens: 8 at top-8, 10 at top-6, 64 at top-1), one warp. H200,
# whole map, do_bench_cudagraph: 32 / 64 / 128 routes at 1 warp gave 9.4 / 10.3 / 14.0 us at 4096 x 8 x
# E256 and 19.8 / 19.2 / 25.2 us at 32768 x 6 x E64; 2 and 4 warps were slower everywhere (38 us at
# 32768 x 6 with 64 routes x 4 warps). 64 keeps the [E, NC] arrays half the size of 32's for ~1 us.
_ROUTES_PER_CHUNK = 64
_INDEX_NUM_WARPS = 1


def _num_rows(routing, counts, num_experts, num_out_tokens, pad_multiple, capacity) -> int:
    """Rows of the permuted buffer (shared by the three map builders). ``counts`` (routes per expert on
    the device) is read only for a bool map without num_out_tokens: the op's one host sync."""
    if capacity is not None:
        return num_experts * capacity
    if num_out_tokens is None:
        # Pass num_out_tokens (Megatron knows it) to avoid the sync; for indices T * K is an upper bound,
        # exact when no route is -1.
        num_out_tokens = int(counts.sum().item()) if routing.dtype == torch.bool else routing.numel()
    return num_out_tokens + (num_experts * (pad_multiple - 1) if pad_multiple > 1 else 0)


def _cpp_map_can_run(routing: torch.Tensor, num_experts: int) -> bool:
    """The CUDA twin (csrc/kernels/moe/row_id_map.cu) serves int indices on CUDA when the extension is built:
    the same kernels as the Triton index form, launched from one C++ call. H200, 4096 x 8 x E256: ~10 us of
    GPU time either way; host 47 us against 123 us for the Triton launches (bench_moe_ops, session 15)."""
    if routing.dtype == torch.bool or not routing.is_cuda or routing.shape[0] == 0:
        return False
    k = routing.shape[1]
    if not 1 <= k <= 1024 or num_experts > _MAX_TRITON_EXPERTS:
        return False
    from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION

    return HAS_CPP_EXTENSION and hasattr(torch.ops.primus_turbo_cpp_extension, "moe_row_id_map")


def _build_row_id_map_cpp(routing, num_experts, num_out_tokens, pad_multiple, capacity):
    k = routing.shape[1]
    num_rows = _num_rows(routing, None, num_experts, num_out_tokens, pad_multiple, capacity)
    dest, tokens_per_expert = torch.ops.primus_turbo_cpp_extension.moe_row_id_map(
        routing.contiguous(), num_experts, num_rows, max(pad_multiple, 1),
        -1 if capacity is None else capacity, max(1, _ROUTES_PER_CHUNK // k),
    )  # fmt: skip
    return dest, tokens_per_expert, num_rows


def _build_row_id_map_triton(routing, num_experts, num_out_tokens, pad_multiple, capacity):
    """Count, scan, offsets and row launches (primus_turbo/triton/moe/row_id_map_kernel.py)."""
    from primus_turbo.triton.moe import row_id_map_kernel as rk

    is_map = routing.dtype == torch.bool
    src = routing.contiguous()
    src = src.view(torch.uint8) if is_map else src
    t, c = src.shape
    e = num_experts
    dev = src.device
    has_cap = capacity is not None
    if is_map:
        num_chunks = max(1, min(_MAX_CHUNKS, triton.cdiv(_TARGET_PROGRAMS, e)))
        chunk_t = max(_MIN_CHUNK_T, triton.cdiv(t, num_chunks))
        block_t = min(1024, _TILE, triton.next_power_of_2(chunk_t))
        chunk_t = triton.cdiv(chunk_t, block_t) * block_t  # whole tiles per chunk
        num_chunks = triton.cdiv(t, chunk_t)
        tile_counts = torch.empty((e, num_chunks), dtype=torch.int32, device=dev)  # every cell written
        rk.map_column_count_kernel[(e, num_chunks)](src, tile_counts, t, c, chunk_t, BLOCK_T=block_t)
    else:
        chunk_t = max(1, _ROUTES_PER_CHUNK // max(c, 1))  # whole tokens: a token's routes share a chunk
        block_n = triton.next_power_of_2(max(chunk_t * c, 1))
        num_chunks = triton.cdiv(t, chunk_t)
        tile_counts = torch.zeros((e, num_chunks), dtype=torch.int32, device=dev)  # atomically added to
        rk.index_chunk_count_kernel[(num_chunks,)](
            src, tile_counts, t * c, chunk_t * c, e, num_chunks, BLOCK_N=block_n, num_warps=_INDEX_NUM_WARPS
        )

    base = torch.empty_like(tile_counts)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    block_nc = min(triton.next_power_of_2(num_chunks), _TILE)
    block_e = min(triton.next_power_of_2(e), max(1, _TILE // block_nc))
    rk.expert_chunk_scan_kernel[(triton.cdiv(e, block_e),)](
        tile_counts, base, counts, e, num_chunks, BLOCK_E=block_e, BLOCK_NC=block_nc
    )
    offsets = torch.empty(e, dtype=torch.int32, device=dev)
    tokens_per_expert = torch.empty(e, dtype=torch.int32, device=dev)
    rk.expert_offsets_kernel[(1,)](
        counts, offsets, tokens_per_expert, e, max(pad_multiple, 1), capacity or 0, HAS_CAPACITY=has_cap,
        BLOCK_E=min(triton.next_power_of_2(e), _TILE),
    )  # fmt: skip
    num_rows = _num_rows(routing, counts, e, num_out_tokens, pad_multiple, capacity)

    dest = torch.empty((t, c), dtype=torch.int32, device=dev)
    if is_map:
        rk.map_row_id_kernel[(e, num_chunks)](
            src, base, offsets, dest, t, c, chunk_t, num_rows, capacity or 0,
            HAS_CAPACITY=has_cap, BLOCK_T=block_t,
        )  # fmt: skip
    else:
        rk.index_row_id_kernel[(num_chunks,)](
            src, base, offsets, dest, t * c, chunk_t * c, max(c, 1), e, num_chunks, num_rows, capacity or 0,
            HAS_CAPACITY=has_cap, BLOCK_N=block_n, num_warps=_INDEX_NUM_WARPS,
        )  # fmt: skip
    return dest, tokens_per_expert, num_rows


def _build_row_id_map_torch(routing, num_experts, num_out_tokens, pad_multiple, capacity):
    """The reference (and the CPU path without the Triton interpreter)."""
    t = routing.shape[0]
    dev = routing.device
    if routing.dtype == torch.bool:
        mask = routing.to(torch.int32)
    else:
        valid = routing >= 0
        mask = torch.zeros((t, num_experts), dtype=torch.int32, device=dev)
        mask.scatter_add_(1, routing.clamp(min=0).long(), valid.to(torch.int32))
    # position of token within its expert: a scan over tokens, run along the contiguous dim of the [E, T]
    # transpose (one parallel scan per expert); along dim 0 of [T, E] torch's outer-dim scan kernel walks
    # each column serially (the H100 profile of deepseek_moe_fp8: int tensor_kernel_scan_outer_dim, 17.5 ms
    # over the step's 24 calls, i.e. 0.73 ms each for the 4096 x 64 routing map)
    rank = (torch.cumsum(mask.t().contiguous(), dim=1, dtype=torch.int32) - 1).t()
    counts = mask.sum(0, dtype=torch.int32)
    if capacity is not None:
        slots = torch.full_like(counts, capacity)
        keep = (mask > 0) & (rank < capacity)
        tokens_per_expert = counts.clamp(max=capacity)
    else:
        keep = mask > 0
        if pad_multiple > 1:
            slots = (counts + pad_multiple - 1) // pad_multiple * pad_multiple
        else:
            slots = counts
        tokens_per_expert = slots
    num_rows = _num_rows(routing, counts, num_experts, num_out_tokens, pad_multiple, capacity)
    offsets = torch.cumsum(slots, 0, dtype=torch.int32) - slots
    dest = offsets.unsqueeze(0) + rank
    dest = torch.where(keep & (dest < num_rows), dest, torch.full_like(dest, -1))
    if routing.dtype != torch.bool:
        dest = dest.gather(1, routing.clamp(min=0).long())
        dest = torch.where(routing >= 0, dest, torch.full_like(dest, -1))
    return dest.to(torch.int32).contiguous(), tokens_per_expert, num_rows


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def convertible(src: torch.dtype, dst: torch.dtype) -> bool:
    """Element types a permute / unpermute may read and write: the same float type, or fp32 <-> fp16/bf16
    (every backend; the CUDA C++ op checks the same pairs)."""
    return src in _FLOATS and dst in _FLOATS and (src == dst or torch.float32 in (src, dst))


# -- eager twins (also the TORCH backend) -------------------------------------------------------


def _permute_eager(x, row_id_map, probs, num_rows, zero_fill, out_dtype=None):
    out = x.new_zeros((num_rows, x.shape[1]), dtype=out_dtype or x.dtype)
    out_probs = probs.new_zeros(num_rows) if probs is not None else None
    sel = row_id_map >= 0
    dest = row_id_map[sel].long()
    src = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(row_id_map)[sel]
    out[dest] = x[src].to(out.dtype)
    if probs is not None:
        out_probs[dest] = probs[sel]
    return out, out_probs


def _unpermute_eager(y, row_id_map, probs, num_tokens, out_dtype=None):
    if y.shape[0] == 0:  # nothing came back (every route dropped): no row to gather for the -1 entries
        return y.new_zeros((num_tokens, y.shape[1]), dtype=out_dtype or y.dtype)
    sel = (row_id_map >= 0).unsqueeze(-1)
    # dropped routes gather row 0 and are then masked: by where, as an inf / NaN there times 0 would be NaN
    rows = torch.where(sel, y.float()[row_id_map.clamp(min=0).long()], 0.0)
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(1).to(out_dtype or y.dtype)


# -- backends ------------------------------------------------------------------------------------


class PermuteTorch(KernelBackend):
    @staticmethod
    def can_handle(**kw) -> bool:
        return True

    @staticmethod
    def execute(*, kind, **kw):
        if kind == "permute":
            return _permute_eager(
                kw["x"], kw["row_id_map"], kw["probs"], kw["num_rows"], kw["zero_fill"], kw.get("out_dtype")
            )
        return _unpermute_eager(kw["y"], kw["row_id_map"], kw["probs"], kw["num_tokens"], kw.get("out_dtype"))


class PermuteTriton(KernelBackend):
    @staticmethod
    def can_handle(**kw) -> bool:
        tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
        return triton_can_run_on(*tensors)

    @staticmethod
    def execute(*, kind, **kw):
        from primus_turbo.triton.moe.permute_kernel import permute_block_h, permute_kernel, unpermute_kernel

        row_id_map, probs = kw["row_id_map"], kw["probs"]
        t, k = row_id_map.shape
        if kind == "permute":
            x = kw["x"]
            h = x.shape[1]
            alloc = torch.zeros if kw["zero_fill"] else torch.empty
            out = alloc((kw["num_rows"], h), dtype=kw.get("out_dtype") or x.dtype, device=x.device)
            out_probs = (
                alloc((kw["num_rows"],), dtype=probs.dtype, device=x.device) if probs is not None else None
            )
            if t and h:
                block = permute_block_h(h)
                permute_kernel[(t, ceil_div(h, block))](
                    x, row_id_map, probs if probs is not None else x, out,
                    out_probs if out_probs is not None else out, h, k, x.stride(0), out.stride(0),
                    HAS_PROBS=probs is not None, BLOCK_H=block,
                )  # fmt: skip
            return out, out_probs
        y = kw["y"]
        h = y.shape[1]
        out = torch.empty((kw["num_tokens"], h), dtype=kw.get("out_dtype") or y.dtype, device=y.device)
        if t and h:
            block = permute_block_h(h)
            unpermute_kernel[(t, ceil_div(h, block))](
                y, row_id_map, probs if probs is not None else y, out, h, k, y.stride(0), out.stride(0),
                HAS_PROBS=probs is not None, BLOCK_H=block,
            )  # fmt: skip
        return out


class PermuteTurbo(KernelBackend):
    """CUDA C++ twin (csrc/kernels/moe/permute.cu) through torch.ops.primus_turbo_cpp_extension."""

    @staticmethod
    def _ops():
        from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION

        return torch.ops.primus_turbo_cpp_extension if HAS_CPP_EXTENSION else None

    @classmethod
    def can_handle(cls, **kw) -> bool:
        tensors = [v for v in kw.values() if isinstance(v, torch.Tensor)]
        if not tensors or not all(v.is_cuda for v in tensors):
            return False
        probs = kw.get("probs")
        if probs is not None and probs.dtype != torch.float32:
            return False
        if kw["row_id_map"].shape[1] > 1024:
            return False
        ten = kw.get("x", kw.get("y"))
        out_dtype = kw.get("out_dtype") or ten.dtype
        if out_dtype != ten.dtype or kw["kind"] == "unpermute":
            if not convertible(ten.dtype, out_dtype):
                return False
        elif ten.shape[1] * ten.element_size() % 2:  # the byte copy moves 2-byte units at least
            return False
        return cls._has_ops(converting=out_dtype != ten.dtype)

    @classmethod
    @functools.cache
    def _has_ops(cls, converting: bool) -> bool:
        ops = cls._ops()
        if ops is None or not (hasattr(ops, "moe_permute") and hasattr(ops, "moe_unpermute")):
            return False
        # an extension built before out_dtype existed cannot convert
        return not converting or "out_dtype" in str(ops.moe_unpermute.default._schema)

    @classmethod
    def execute(cls, *, kind, **kw):
        ops = cls._ops()
        if kind == "permute":
            x, out_dtype = kw["x"], kw.get("out_dtype")
            extra = () if out_dtype in (None, x.dtype) else (out_dtype,)
            out, out_probs = ops.moe_permute(
                x, kw["row_id_map"], kw["probs"], kw["num_rows"], kw["zero_fill"], *extra
            )
            return out, (out_probs if kw["probs"] is not None else None)
        y, out_dtype = kw["y"], kw.get("out_dtype")
        extra = () if out_dtype in (None, y.dtype) else (out_dtype,)
        return ops.moe_unpermute(y, kw["row_id_map"], kw["probs"], kw["num_tokens"], *extra)


class PermuteDispatcher(AutoKernelDispatcher):
    op_name = "moe_permute"
    backends = {
        BackendType.TURBO: PermuteTurbo,
        BackendType.TRITON: PermuteTriton,
        BackendType.TORCH: PermuteTorch,
    }

    @classmethod
    def make_key(cls, **kw):
        ten = kw.get("x", kw.get("y"))
        k, has_probs = kw["row_id_map"].shape[1], kw["probs"] is not None
        return (kw["kind"], ten.shape[1], ten.dtype, kw.get("out_dtype") or ten.dtype, k, has_probs)

    @classmethod
    def precision(cls, **kw):
        return "other"


# -- custom ops ---------------------------------------------------------------------------------


@eager_direct
@torch.library.custom_op("primus_turbo::moe_permute_fwd", mutates_args=())
def moe_permute_fwd(
    x: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    num_rows: int,
    zero_fill: bool,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out[row_id_map[t, k]] = x[t] (in ``out_dtype``, default x's), out_probs likewise from probs."""
    out, out_probs = PermuteDispatcher.dispatch(
        kind="permute", x=x, row_id_map=row_id_map, probs=probs, num_rows=num_rows, zero_fill=zero_fill,
        out_dtype=out_dtype,
    )  # fmt: skip
    if out_probs is None:
        out_probs = x.new_empty((0,), dtype=torch.float32)
    return out, out_probs


@moe_permute_fwd.register_fake
def _(x, row_id_map, probs, num_rows, zero_fill, out_dtype=None):
    pdt = probs.dtype if probs is not None else torch.float32
    return x.new_empty((num_rows, x.shape[1]), dtype=out_dtype or x.dtype), x.new_empty(
        (num_rows if probs is not None else 0,), dtype=pdt
    )


@eager_direct
@torch.library.custom_op("primus_turbo::moe_unpermute_fwd", mutates_args=())
def moe_unpermute_fwd(
    y: torch.Tensor,
    row_id_map: torch.Tensor,
    probs: torch.Tensor | None,
    num_tokens: int,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """out[t] = sum_k y[row_id_map[t, k]] (* probs[t, k]) accumulated in fp32, in ``out_dtype`` (or y's)."""
    return PermuteDispatcher.dispatch(
        kind="unpermute", y=y, row_id_map=row_id_map, probs=probs, num_tokens=num_tokens, out_dtype=out_dtype
    )


@moe_unpermute_fwd.register_fake
def _(y, row_id_map, probs, num_tokens, out_dtype=None):
    return y.new_empty((num_tokens, y.shape[1]), dtype=out_dtype or y.dtype)


@eager_direct
@torch.library.custom_op("primus_turbo::moe_unpermute_bwd_probs", mutates_args=())
def moe_unpermute_bwd_probs(
    grad_out: torch.Tensor, y: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    t, k = row_id_map.shape
    h = y.shape[1]
    if t == 0 or h == 0 or not triton_can_run_on(y):
        grad_y = torch.zeros_like(y)
        grad_probs = torch.zeros(row_id_map.shape, dtype=torch.float32, device=y.device)
        if t == 0 or h == 0:
            return grad_y, grad_probs
        sel = row_id_map >= 0
        d = row_id_map[sel].long()
        tok = torch.arange(t, device=y.device).unsqueeze(1).expand_as(row_id_map)[sel]
        g = grad_out.float()[tok]
        grad_y[d] = (g * probs.float()[sel].unsqueeze(-1)).to(y.dtype)
        grad_probs[sel] = (g * y.float()[d]).sum(-1)
        return grad_y, grad_probs
    from primus_turbo.triton.moe.permute_kernel import unpermute_bwd_probs_kernel

    grad_out, y = grad_out.contiguous(), y.contiguous()
    # every row the map names is written by the kernel (which flags it); the others (padding, dropped,
    # tail rows) are zeroed afterwards, instead of zero-filling the whole gradient first
    grad_y = torch.empty_like(y)
    grad_probs = torch.empty(row_id_map.shape, dtype=torch.float32, device=y.device)
    covered = torch.zeros(y.shape[0], dtype=torch.int8, device=y.device)
    block_k, block_h, routes, warps = unpermute_bwd_probs_config(k, h)
    unpermute_bwd_probs_kernel[(t, triton.cdiv(k, routes))](
        grad_out, y, row_id_map, probs, grad_y, grad_probs, covered, h, k, grad_out.stride(0), y.stride(0),
        routes, BLOCK_K=block_k, BLOCK_H=block_h, num_warps=warps,
    )  # fmt: skip
    _zero_uncovered_rows(grad_y, covered)
    return grad_y, grad_probs


def unpermute_bwd_probs_config(k: int, h: int) -> tuple[int, int, int, int]:
    """(BLOCK_K, BLOCK_H, routes per program, num_warps) of ``unpermute_bwd_probs_kernel``: 2 routes x
    2048 columns a step, all K routes of a token in one program, 8 warps (H200, 4096 x 7168 top-8,
    benchmark/ops/sweep_permute.py: 266 us vs 294 for 8 x 512 at 4 warps and 325 for 8 x 1024 at 8).
    Splitting a token's routes over programs (routes per program < K) was slower at every size swept
    (session 20: 274-292 vs 265 us at 4096 x 7168 top-8)."""
    block_k = min(2, triton.next_power_of_2(k))
    return block_k, max(16, min(triton.next_power_of_2(h), 4096 // block_k)), k, 8


def _zero_uncovered_rows(out: torch.Tensor, covered: torch.Tensor, probs: torch.Tensor | None = None) -> None:
    from primus_turbo.triton.moe.permute_kernel import zero_uncovered_rows_kernel

    n, h = out.shape
    if n == 0:
        return
    block_h = min(1024, triton.next_power_of_2(max(h, 1)))
    block_r = max(1, 4096 // block_h)
    zero_uncovered_rows_kernel[(triton.cdiv(n, block_r),)](
        out, probs if probs is not None else out, covered, n, h, out.stride(0),
        HAS_PROBS=probs is not None, BLOCK_R=block_r, BLOCK_H=block_h,
    )  # fmt: skip


def zero_rows_outside_map(
    out: torch.Tensor, row_id_map: torch.Tensor, probs: torch.Tensor | None = None
) -> None:
    """Zero the rows of a permuted-layout ``out`` (and entries of ``probs`` [N]) that no entry of
    ``row_id_map`` names (padding, dropped and tail rows), in two launches that touch N flag bytes
    plus those rows: a permute into an uninitialised buffer then equals one into a zero-filled one."""
    from primus_turbo.triton.moe.permute_kernel import mark_covered_kernel

    covered = torch.zeros(out.shape[0], dtype=torch.int8, device=out.device)
    numel = row_id_map.numel()
    if numel:
        mark_covered_kernel[(triton.cdiv(numel, 4096),)](row_id_map, covered, numel, BLOCK=4096)
    _zero_uncovered_rows(out, covered, probs)


@moe_unpermute_bwd_probs.register_fake
def _(grad_out, y, row_id_map, probs):
    return torch.empty_like(y), y.new_empty(row_id_map.shape, dtype=torch.float32)


@eager_direct
@torch.library.custom_op("primus_turbo::moe_permute_fp8_rowwise", mutates_args=())
def moe_permute_fp8_rowwise(
    x: torch.Tensor, row_id_map: torch.Tensor, num_rows: int, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    fp8_max = torch.finfo(fp8_dtype).max
    out = torch.zeros((num_rows, x.shape[1]), dtype=fp8_dtype, device=x.device)
    scales = torch.ones((num_rows,), dtype=torch.float32, device=x.device)
    t, k = row_id_map.shape
    h = x.shape[1]
    if t == 0 or h == 0:
        return out, scales
    if not triton_can_run_on(x):
        amax = x.float().abs().amax(-1).clamp(min=1e-12)
        q = (x.float() * (fp8_max / amax).unsqueeze(-1)).clamp(-fp8_max, fp8_max).to(fp8_dtype)
        sel = row_id_map >= 0
        tok = torch.arange(t, device=x.device).unsqueeze(1).expand_as(row_id_map)[sel]
        out[row_id_map[sel].long()] = q[tok]
        scales[row_id_map[sel].long()] = (amax / fp8_max)[tok]
        return out, scales
    from primus_turbo.triton.moe.permute_kernel import permute_fp8_rowwise_kernel

    permute_fp8_rowwise_kernel[(t,)](
        x, row_id_map, out, scales, h, k, x.stride(0), out.stride(0), FP8_MAX=fp8_max,
        BLOCK_H=min(2048, 1 << (max(h, 16) - 1).bit_length()),
    )  # fmt: skip
    return out, scales


@moe_permute_fp8_rowwise.register_fake
def _(x, row_id_map, num_rows, fp8_dtype):
    return x.new_empty((num_rows, x.shape[1]), dtype=fp8_dtype), x.new_empty((num_rows,), dtype=torch.float32)
