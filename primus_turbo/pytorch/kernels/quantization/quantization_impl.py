"""FP8 quantization backends: Triton kernels (CUDA, or CPU under the interpreter) and a torch reference.

Everything here takes already-validated arguments (ops/quantization.py validates). A scaling
*group* is described by ``(group_r, group_c)`` over the last two dims of ``x`` viewed as
``(B, R, C)``; ``0`` means "the whole dim":

    TENSORWISE            (0, 0) over the whole tensor (B folded into R)
    ROWWISE axis=-1       (1, 0)        ROWWISE axis=0 (2-D)   (0, 1)
    BLOCKWISE 1 x bs      (1, bs)       BLOCKWISE bs x 1 (2-D) (bs, 1)
    BLOCKWISE (br, bc)    (br, bc)

Backend choice: Triton on CUDA tensors, the torch reference on CPU (the interpreter is correct but
slow, and its fp32->fp8 conversion does not produce NaN; tests call the Triton path explicitly).
ROWWISE along the last axis and TENSORWISE (current scaling), with or without the transposed copy, on
CUDA take the CUDA C++ kernels (``backend="turbo"``, csrc/kernels/quantization) when the extension is
built: same numbers bit for bit, one C++ op call instead of the Python launch path (~0.1-0.2 ms of host
time per call on the H100 hosts, more than the kernel itself for a 64 MB activation; TENSORWISE
Float8Linear at M=8192 N=K=4096 on H200: 0.64-0.89x -> 1.16-1.36x bf16, session 26). ``backend`` values:
auto | turbo | triton | torch.
"""

from __future__ import annotations

import math

import torch

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION, cpp_ops, require_cpp_extension
from primus_turbo.pytorch.core.low_precision import fp8_max
from primus_turbo.pytorch.core.utils import ceil_div, triton_can_run_on

_FLT_MAX = torch.finfo(torch.float32).max


def use_triton(x: torch.Tensor, backend: str) -> bool:
    if backend in ("triton", "turbo"):  # turbo: the kernels csrc lacks stay on Triton
        return True
    if backend == "torch":
        return False
    return x.is_cuda and triton_can_run_on(x)


def use_cpp_rowwise(x: torch.Tensor, backend: str, what: str = "ROWWISE") -> bool:
    """The CUDA C++ kernels (ROWWISE, TENSORWISE): pinned (``turbo``, an error when they cannot run) or auto
    on CUDA."""
    if backend == "turbo":
        require_cpp_extension(f"quantize_fp8 ({what})")
        if not x.is_cuda:
            raise ValueError(f"quantize_fp8: backend 'turbo' runs on CUDA tensors, x is on {x.device}")
        return True
    return backend == "auto" and HAS_CPP_EXTENSION and x.is_cuda


# ------------------------------------------------------------------------------------------------
# torch reference (fp32 math, same rules as the kernels)
# ------------------------------------------------------------------------------------------------
def finite_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    ax = x.float().abs()
    ax = torch.where(ax < float("inf"), ax, 0.0)
    if dim is None:
        return ax.amax() if ax.numel() else torch.zeros((), device=x.device)
    return ax.amax(dim=dim, keepdim=keepdim)


def scale_from_amax(amax: torch.Tensor, out_dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    amax = amax.float()
    # tensor / tensor is IEEE division; `float / tensor` is reciprocal() * float (two roundings),
    # which the Triton kernels (div_rn) would not match bit for bit
    scale = torch.full_like(amax, fp8_max(out_dtype)) / amax
    scale = torch.where(amax > 0, scale, torch.ones_like(amax)).clamp(max=_FLT_MAX)
    if pow2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def cast_fp8(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(out_dtype)
    x = x.float()
    y = (x * scale).clamp(-m, m)
    return torch.where(torch.isnan(x), x, y).to(out_dtype)


def _torch_groups(x3: torch.Tensor, gr: int, gc: int, out_dtype, pow2):
    """x3 (B, R, C); group (gr, gc) with 0 = whole dim. Returns q (B, R, C), scale_inv (B, nR, nC)."""
    b, r, c = x3.shape
    nr = ceil_div(r, gr) if gr else 1  # a whole-dim group exists (scale 1) even when the dim is empty
    nc = ceil_div(c, gc) if gc else 1
    gr = gr or max(r, 1)
    gc = gc or max(c, 1)
    xp = torch.nn.functional.pad(x3.float(), (0, nc * gc - c, 0, nr * gr - r))
    amax = finite_amax(xp.view(b, nr, gr, nc, gc), dim=(2, 4))  # (B, nR, nC)
    scale = scale_from_amax(amax, out_dtype, pow2)
    full = scale.repeat_interleave(gr, dim=1).repeat_interleave(gc, dim=2)[:, :r, :c]
    return cast_fp8(x3, full, out_dtype), 1.0 / scale


# ------------------------------------------------------------------------------------------------
# Triton launchers
# ------------------------------------------------------------------------------------------------
def _tl():
    from primus_turbo.triton.quantization import quantization_kernel as qk

    return qk


def _tensorwise_triton(x, out_dtype, pow2, with_t, static_scale=None):
    """x contiguous; with_t needs 2-D. Returns q, scale_inv (), qt|None, amax|None."""
    qk = _tl()
    n = x.numel()
    dev = x.device
    q = torch.empty_like(x, dtype=out_dtype)
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    qt = torch.empty((x.shape[1], x.shape[0]), dtype=out_dtype, device=dev) if with_t else None
    static = static_scale is not None
    common = dict(FP8_MAX=fp8_max(out_dtype), POW2=pow2, OUT_DTYPE=qk.fp8_tl_dtype(out_dtype))
    if static:
        partials, num_partials = scale_inv, 1  # unused
        scale_arg = static_scale.float().reshape(())
    else:
        block = 4096
        num_partials = max(1, min(qk.MAX_PARTIALS, ceil_div(n, block)))
        partials = torch.empty(num_partials, dtype=torch.float32, device=dev)
        qk.amax_partial_kernel[(num_partials,)](x, partials, n, BLOCK=block, num_warps=8)
        scale_arg = scale_inv  # unused
    p2 = qk.next_pow2(num_partials)
    if with_t:
        rows, cols = x.shape
        br, bc = 64, 64
        grid = (ceil_div(rows, br), ceil_div(cols, bc))
        n_amax = grid[0] * grid[1] * br  # per-row amaxes of every tile (static scale only)
        amax_out = torch.empty(n_amax, dtype=torch.float32, device=dev) if static else scale_inv
        qk.tensorwise_cast_transpose_kernel[grid](
            x,
            q,
            qt,
            partials,
            num_partials,
            scale_arg,
            scale_inv,
            amax_out,
            rows,
            cols,
            STATIC_SCALE=static,
            PARTIALS_P2=p2,
            BLOCK_R=br,
            BLOCK_C=bc,
            num_warps=8,
            **common,
        )
    else:
        block = 4096
        grid = (max(1, ceil_div(n, block)),)
        amax_out = torch.empty(grid[0], dtype=torch.float32, device=dev) if static else scale_inv
        qk.tensorwise_cast_kernel[grid](
            x,
            q,
            partials,
            num_partials,
            scale_arg,
            scale_inv,
            amax_out,
            n,
            STATIC_SCALE=static,
            PARTIALS_P2=p2,
            BLOCK=block,
            num_warps=8,
            **common,
        )
    amax = amax_out.amax() if static else None
    return q, scale_inv, qt, amax


def _rowwise_triton(x2, out_dtype, pow2, max_row_tile: int = 8192):
    """Per-row scales of a contiguous (R, C): q (R, C), scale_inv (R, 1).

    Rows up to ``max_row_tile`` elements are read once and kept in registers (8192 bf16 = 16 KB
    per program, 32 fp32/thread at 8 warps); longer rows take two passes (the second from L2)."""
    qk = _tl()
    rows, cols = x2.shape
    q = torch.empty_like(x2, dtype=out_dtype)
    scale_inv = torch.empty((rows, 1), dtype=torch.float32, device=x2.device)
    single = qk.next_pow2(cols) <= max_row_tile
    bc = qk.next_pow2(cols) if single else 2048
    br = max(1, min(4096 // bc, qk.next_pow2(rows)))
    qk.rowwise_quant_kernel[(ceil_div(rows, br),)](
        x2,
        q,
        scale_inv,
        rows,
        cols,
        FP8_MAX=fp8_max(out_dtype),
        POW2=pow2,
        OUT_DTYPE=qk.fp8_tl_dtype(out_dtype),
        BLOCK_R=br,
        BLOCK_C=bc,
        SINGLE_PASS=single,
        num_warps=8 if br * bc >= 4096 else 4,
    )
    return q, scale_inv


def _colwise_triton(x2, out_dtype, pow2, transpose):
    """Per-column scales of a contiguous (R, C): q (R, C) or, transposed, (C, R); scale_inv (1, C)."""
    qk = _tl()
    rows, cols = x2.shape
    dev = x2.device
    bc, chunk_r = 128, 256
    num_chunks = max(1, ceil_div(rows, chunk_r))
    if num_chunks > 32:  # the cast pass reduces [chunks, 128] partials in registers: keep it <= 32 rows
        chunk_r = ceil_div(rows, 32 * 32) * 32
        num_chunks = ceil_div(rows, chunk_r)
    partials = torch.empty((num_chunks, cols), dtype=torch.float32, device=dev)
    grid_c = ceil_div(cols, bc)
    qk.col_amax_partial_kernel[(num_chunks, grid_c)](
        x2, partials, rows, cols, CHUNK_R=chunk_r, BLOCK_R=32, BLOCK_C=bc, num_warps=4
    )
    out = torch.empty((cols, rows) if transpose else (rows, cols), dtype=out_dtype, device=dev)
    scale_inv = torch.empty((1, cols), dtype=torch.float32, device=dev)
    br = 64
    qk.col_cast_kernel[(ceil_div(rows, br), grid_c)](
        x2,
        partials,
        num_chunks,
        out,
        scale_inv,
        rows,
        cols,
        TRANSPOSE=transpose,
        FP8_MAX=fp8_max(out_dtype),
        POW2=pow2,
        OUT_DTYPE=qk.fp8_tl_dtype(out_dtype),
        CHUNKS_P2=qk.next_pow2(num_chunks),
        BLOCK_R=br,
        BLOCK_C=bc,
        num_warps=4,
    )
    return out, scale_inv


def _rowwise_with_transpose_triton(x2, out_dtype, pow2):
    """q (R, C) with row scales and qt (C, R) with column scales in two reads of x."""
    qk = _tl()
    rows, cols = x2.shape
    dev = x2.device
    br, bc = 64, 128
    nrb, ncb = ceil_div(rows, br), ceil_div(cols, bc)
    row_part = torch.empty((ncb, rows), dtype=torch.float32, device=dev)
    col_part = torch.empty((nrb, cols), dtype=torch.float32, device=dev)
    qk.rowcol_amax_partial_kernel[(nrb, ncb)](x2, row_part, col_part, rows, cols, BLOCK_R=br, BLOCK_C=bc)
    scales = {}
    common = dict(FP8_MAX=fp8_max(out_dtype), POW2=pow2, BLOCK=256)
    for name, part, n in (("row", row_part, rows), ("col", col_part, cols)):
        scale = torch.empty(n, dtype=torch.float32, device=dev)
        scale_inv = torch.empty(n, 1, dtype=torch.float32, device=dev)
        qk.partial_to_scale_kernel[(ceil_div(n, 256),)](
            part, scale, scale_inv, n, part.shape[0], PARTS_P2=min(qk.next_pow2(part.shape[0]), 32), **common
        )
        scales[name] = (scale, scale_inv)
    q = torch.empty_like(x2, dtype=out_dtype)
    qt = torch.empty((cols, rows), dtype=out_dtype, device=dev)
    qk.rowcol_cast_kernel[(nrb, ncb)](
        x2,
        q,
        qt,
        scales["row"][0],
        scales["col"][0],
        rows,
        cols,
        FP8_MAX=fp8_max(out_dtype),
        OUT_DTYPE=qk.fp8_tl_dtype(out_dtype),
        BLOCK_R=br,
        BLOCK_C=bc,
        num_warps=8,
    )
    return q, scales["row"][1], qt, scales["col"][1]


def _blockwise_triton(x3, gr, gc, out_dtype, pow2, with_t, colmajor_scale=True):
    """x3 contiguous (B, R, C), group (gr, gc) in {(1, bs), (bs, 1), (br, bc)}.

    Scales: (1, bs) -> s (B, R, nC), column-major per batch when ``colmajor_scale`` (2-D inputs: the
    layout cuBLAS reads) else contiguous, as the fake kernel declares for other ranks (a mismatch
    fails torch.compile's stride check); (bs, 1) -> (B, nR, C); (br, bc) -> (B, nR, nC) row-major.
    with_t (B == 1): qt (C, R) with the transposed groups.
    """
    qk = _tl()
    b, rows, cols = x3.shape
    dev = x3.device
    mode = 0 if gr == 1 else (1 if gc == 1 else 2)
    block_r = gr if mode != 0 else (gc if with_t else 32)
    block_c = gc if mode != 1 else 64
    nr, nc = ceil_div(rows, block_r), ceil_div(cols, block_c)
    q = torch.empty_like(x3, dtype=out_dtype)
    if mode == 0 and colmajor_scale:
        s = torch.empty((b, nc, rows), dtype=torch.float32, device=dev).transpose(1, 2)
    elif mode == 0:
        s = torch.empty((b, rows, nc), dtype=torch.float32, device=dev)
    elif mode == 1:
        s = torch.empty((b, nr, cols), dtype=torch.float32, device=dev)
    else:
        s = torch.empty((b, nr, nc), dtype=torch.float32, device=dev)
    qt = st = None
    if with_t:
        qt = torch.empty((b, cols, rows), dtype=out_dtype, device=dev)
        if mode == 0:
            st = torch.empty((b, nr, cols), dtype=torch.float32, device=dev).transpose(1, 2)
        else:
            st = torch.empty((b, nc, nr), dtype=torch.float32, device=dev)
    st_strides = st.stride() if with_t else (0, 0, 0)
    qk.blockwise_quant_kernel[(nr, nc, b)](
        x3,
        q,
        s,
        qt if with_t else q,
        st if with_t else s,
        rows,
        cols,
        rows * cols,
        rows * cols,
        s.stride(0),
        s.stride(1),
        s.stride(2),
        *st_strides,
        MODE=mode,
        WITH_T=with_t,
        FP8_MAX=fp8_max(out_dtype),
        POW2=pow2,
        OUT_DTYPE=qk.fp8_tl_dtype(out_dtype),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        num_warps=8 if block_r * block_c >= 8192 else 4,
    )
    return q, s, qt, st


# ------------------------------------------------------------------------------------------------
# Entry points (validated arguments)
# ------------------------------------------------------------------------------------------------
def _as_3d(x: torch.Tensor, granularity: str, axis: int, block_r: int) -> torch.Tensor:
    if x.dim() == 0:
        return x.reshape(1, 1, 1)
    if x.dim() == 1:
        return x.reshape(1, 1, -1)
    if granularity == "blockwise" and block_r > 1 and axis is None:  # 2-D tiles, leading dims batched
        return x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
    if axis == 0:  # column groups of a 2-D tensor
        return x.reshape(1, x.shape[0], x.shape[1])
    return x.reshape(1, math.prod(x.shape[:-1]), x.shape[-1])


def quantize_fp8_impl(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: str,
    axis: int | None,
    block_r: int,
    block_c: int,
    pow2: bool,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q with x's shape, scale_inv in the public shape documented in ops/quantization.py)."""
    # not differentiable: the torch path must not build a graph either (detach only when needed: hot path)
    x = (x.detach() if x.requires_grad else x).contiguous()
    if granularity == "rowwise" and axis == -1 and x.dim() == 2 and x.numel() and use_cpp_rowwise(x, backend):
        # the FP8 linears' hot path: the C++ op takes and returns exactly these shapes (H100, three calls of
        # profile_host --glue: the generic path below added 11-22 us of Python to the op's 11-15 us)
        return cpp_ops().quantize_fp8_rowwise(x, out_dtype, pow2)
    shape = x.shape
    if granularity == "tensorwise":
        if x.numel() and use_cpp_rowwise(x, backend, "TENSORWISE"):  # one C++ op: ~2 Triton launches of host
            q, s, _ = cpp_ops().quantize_fp8_tensorwise(x, out_dtype, pow2, False)
            return q, s
        if use_triton(x, backend) and x.numel():
            q, s, _, _ = _tensorwise_triton(x, out_dtype, pow2, with_t=False)
            return q, s
        scale = scale_from_amax(finite_amax(x), out_dtype, pow2)
        return cast_fp8(x, scale, out_dtype), (1.0 / scale).reshape(())
    x3 = _as_3d(x, granularity, axis, block_r)
    if granularity == "rowwise":
        if axis == 0:
            if use_triton(x, backend) and x.numel():
                return _colwise_triton(x3[0], out_dtype, pow2, transpose=False)
            q, s = _torch_groups(x3, 0, 1, out_dtype, pow2)
            return q.reshape(shape), s.reshape(1, shape[1])
        if x.numel() and use_cpp_rowwise(x, backend):
            q, s = cpp_ops().quantize_fp8_rowwise(x3[0], out_dtype, pow2)
        elif use_triton(x, backend) and x.numel():
            q, s = _rowwise_triton(x3[0], out_dtype, pow2)
        else:
            q, s = _torch_groups(x3, 1, 0, out_dtype, pow2)
        return q.reshape(shape), s.reshape(*shape[:-1], 1)
    # blockwise
    gr, gc = (block_r, 1) if axis == 0 else (block_r, block_c)
    if use_triton(x, backend) and x.numel():
        q, s, _, _ = _blockwise_triton(x3, gr, gc, out_dtype, pow2, False, colmajor_scale=x.dim() == 2)
    else:
        q, s = _torch_groups(x3, gr, gc, out_dtype, pow2)
    if axis is None:
        return q.reshape(shape), s.reshape(*shape[:-2], *s.shape[-2:])
    if axis == 0:
        return q.reshape(shape), s[0]
    if x.dim() != 2:
        return q.reshape(shape), s.reshape(*shape[:-1], s.shape[-1])
    return q.reshape(shape), s[0].t().contiguous().t()  # (R, C/bs) column-major on every backend


def quantize_fp8_with_transpose_impl(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: str,
    block_r: int,
    block_c: int,
    pow2: bool,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x 2-D (R, C). q (R, C) scaled along C; qt (C, R) = transposed copy scaled along R."""
    x = (x.detach() if x.requires_grad else x).contiguous()
    rows, cols = x.shape
    triton_ok = use_triton(x, backend) and x.numel() > 0
    if granularity == "tensorwise":
        if x.numel() and use_cpp_rowwise(x, backend, "TENSORWISE"):
            q, s, qt = cpp_ops().quantize_fp8_tensorwise(x, out_dtype, pow2, True)
            return q, s, qt, s
        if triton_ok:
            q, s, qt, _ = _tensorwise_triton(x, out_dtype, pow2, with_t=True)
            return q, s, qt, s
        q, s = quantize_fp8_impl(x, out_dtype, "tensorwise", None, 0, 0, pow2, "torch")
        return q, s, q.t().contiguous(), s
    if granularity == "rowwise":
        if x.numel() and use_cpp_rowwise(x, backend):
            return cpp_ops().quantize_fp8_rowwise_transpose(x, out_dtype, pow2)
        if triton_ok:
            return _rowwise_with_transpose_triton(x, out_dtype, pow2)
        q, s = quantize_fp8_impl(x, out_dtype, "rowwise", -1, 0, 0, pow2, "torch")
        qt, st = quantize_fp8_impl(x.t(), out_dtype, "rowwise", -1, 0, 0, pow2, "torch")
        return q, s, qt, st
    two_d = block_r > 1
    if triton_ok:
        gr, gc = (block_r, block_c) if two_d else (1, block_c)
        q, s, qt, st = _blockwise_triton(x.reshape(1, rows, cols), gr, gc, out_dtype, pow2, with_t=True)
        return q[0], s[0], qt[0], st[0]
    if two_d:
        q, s = quantize_fp8_impl(x, out_dtype, "blockwise", None, block_r, block_c, pow2, "torch")
        return q, s, q.t().contiguous(), s.t().contiguous()
    q, s = quantize_fp8_impl(x, out_dtype, "blockwise", -1, 1, block_c, pow2, "torch")
    qt, st = quantize_fp8_impl(x.t(), out_dtype, "blockwise", -1, 1, block_c, pow2, "torch")
    return q, s, qt, st


def quantize_fp8_tensorwise_static_impl(
    x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, with_t: bool, backend: str = "auto"
):
    """Delayed scaling: cast with a given scale and report this tensor's amax in the same pass.

    Returns (q, scale_inv, qt|None, amax); amax is the finite-abs max of x (for the history)."""
    x = (x.detach() if x.requires_grad else x).contiguous()
    if use_triton(x, backend) and x.numel():
        return _tensorwise_triton(x, out_dtype, False, with_t, static_scale=scale)
    scale = scale.float().reshape(())
    q = cast_fp8(x, scale, out_dtype)
    return q, 1.0 / scale, (q.t().contiguous() if with_t else None), finite_amax(x)


def dequantize_fp8_impl(q, scale_inv, granularity, axis, block_r, block_c, out_dtype):
    """Broadcast the scales back over their groups and multiply (torch; not performance critical)."""
    x = q.float()
    s = scale_inv.float()
    if granularity == "tensorwise" or granularity == "rowwise":
        return (x * s).to(out_dtype)
    if axis is None:
        s = s.repeat_interleave(block_r, dim=-2).repeat_interleave(block_c, dim=-1)
    elif axis == 0:
        s = s.repeat_interleave(block_r, dim=0)
    else:
        s = s.repeat_interleave(block_c, dim=-1)
    s = s[..., : x.shape[-2], : x.shape[-1]] if x.dim() >= 2 else s[..., : x.shape[-1]]
    return (x * s).to(out_dtype)


# ------------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile (the Triton launches are not traced)
# ------------------------------------------------------------------------------------------------
def _fake_scale(shape, g, axis, br, bc, device, colmajor_ok=True):
    cdiv = lambda a, b: -(-a // b)
    if g == "tensorwise":
        return torch.empty((), dtype=torch.float32, device=device)
    if g == "rowwise":
        out = (1, shape[1]) if axis == 0 else (*shape[:-1], 1)
    elif axis is None:
        out = (*shape[:-2], cdiv(shape[-2], br), cdiv(shape[-1], bc))
    elif axis == 0:
        out = (cdiv(shape[0], br), shape[1])
    else:
        out = (*shape[:-1], cdiv(shape[-1], bc))
        if len(shape) == 2 and colmajor_ok:
            return torch.empty_strided(out, (1, out[0]), dtype=torch.float32, device=device)
    return torch.empty(out, dtype=torch.float32, device=device)


def _no_alias(outputs, x):
    """Custom-op outputs may not share storage with the input or each other (a tensorwise scale is
    returned twice; a (1, n) scale's transpose is a view): clone those."""
    seen = {x.untyped_storage().data_ptr()} if x.numel() else set()
    result = []
    for t in outputs:
        if t.numel() == 0:  # empty views share storage too; a fresh empty tensor never does
            result.append(torch.empty_like(t))
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        result.append(t)
    return tuple(result)


def quantize_fp8_op(x, out_dtype, granularity, axis, block_r, block_c, pow2):
    """The public quantize entry (validated, normalized arguments): the custom op under
    torch.compile, a direct call in eager (the custom-op layer costs ~50-100 us of host time per
    call, as much as quantizing a 64 MB activation on an H200)."""
    if torch.compiler.is_compiling():
        return _quantize_fp8_custom_op(x, out_dtype, granularity, axis, block_r, block_c, pow2)
    return _no_alias(quantize_fp8_impl(x, out_dtype, granularity, axis, block_r, block_c, pow2), x)


def quantize_fp8_with_transpose_op(x, out_dtype, granularity, block_r, block_c, pow2):
    """As ``quantize_fp8_op`` for ``quantize_fp8_with_transpose_impl``."""
    if torch.compiler.is_compiling():
        return _quantize_fp8_with_transpose_custom_op(x, out_dtype, granularity, block_r, block_c, pow2)
    return _no_alias(quantize_fp8_with_transpose_impl(x, out_dtype, granularity, block_r, block_c, pow2), x)


@torch.library.custom_op("primus_turbo::quantize_fp8", mutates_args=())
def _quantize_fp8_custom_op(
    x: torch.Tensor,
    out_dtype: torch.dtype,
    granularity: str,
    axis: int | None,
    block_r: int,
    block_c: int,
    pow2: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _no_alias(quantize_fp8_impl(x, out_dtype, granularity, axis, block_r, block_c, pow2), x)


@_quantize_fp8_custom_op.register_fake
def _quantize_fp8_fake(x, out_dtype, granularity, axis, block_r, block_c, pow2):
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return q, _fake_scale(tuple(x.shape), granularity, axis, block_r, block_c, x.device)


@torch.library.custom_op("primus_turbo::quantize_fp8_with_transpose", mutates_args=())
def _quantize_fp8_with_transpose_custom_op(
    x: torch.Tensor, out_dtype: torch.dtype, granularity: str, block_r: int, block_c: int, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _no_alias(quantize_fp8_with_transpose_impl(x, out_dtype, granularity, block_r, block_c, pow2), x)


@_quantize_fp8_with_transpose_custom_op.register_fake
def _quantize_fp8_with_transpose_fake(x, out_dtype, granularity, block_r, block_c, pow2):
    rows, cols = x.shape
    axis = None if block_r > 1 else -1
    q = torch.empty((rows, cols), dtype=out_dtype, device=x.device)
    qt = torch.empty((cols, rows), dtype=out_dtype, device=x.device)
    s = _fake_scale((rows, cols), granularity, axis, block_r, block_c, x.device)
    br_t, bc_t = (block_c, block_r) if axis is None else (block_r, block_c)  # 1 x bs stays 1 x bs
    st = _fake_scale((cols, rows), granularity, axis, br_t, bc_t, x.device)
    return q, s, qt, st
