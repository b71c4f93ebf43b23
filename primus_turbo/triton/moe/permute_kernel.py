"""Token permute / unpermute kernels driven by a row-id map.

``row_id_map[t, k]`` is the destination row of token t's k-th route in the permuted buffer, or -1
(not routed / dropped / not local). Columns are the top-k slots (indices form) or all experts
(routing-map form); ``probs`` is laid out like ``row_id_map``.

Grid (T, cdiv(H, BLOCK_H)): a token chunk is read once and written to each of its K rows
(permute), or its K rows are gathered and summed in fp32 (unpermute), so every byte moves once.
No atomics: unpermute is a gather, hence deterministic. No @triton.jit helpers (see
activation_kernel.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def permute_kernel(
    x_ptr,
    map_ptr,
    probs_ptr,
    out_ptr,
    out_probs_ptr,
    H,
    K,
    stride_x,
    stride_out,
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    x = tl.load(x_ptr + t * stride_x + offs, mask=hmask)
    for k in range(K):
        dest = tl.load(map_ptr + t * K + k).to(tl.int64)
        tl.store(out_ptr + dest * stride_out + offs, x.to(out_ptr.dtype.element_ty), mask=hmask & (dest >= 0))
        if HAS_PROBS:
            if pid_h == 0:
                p = tl.load(probs_ptr + t * K + k)
                tl.store(out_probs_ptr + dest, p.to(out_probs_ptr.dtype.element_ty), mask=dest >= 0)


@triton.jit
def unpermute_kernel(
    y_ptr,
    map_ptr,
    probs_ptr,
    out_ptr,
    H,
    K,
    stride_y,
    stride_out,
    HAS_PROBS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in range(K):
        src = tl.load(map_ptr + t * K + k).to(tl.int64)
        valid = src >= 0
        v = tl.load(y_ptr + src * stride_y + offs, mask=hmask & valid, other=0.0).to(tl.float32)
        if HAS_PROBS:
            w = tl.load(probs_ptr + t * K + k).to(tl.float32)
            v = v * w
        acc += v
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def unpermute_bwd_probs_kernel(
    grad_out_ptr,
    y_ptr,
    map_ptr,
    probs_ptr,
    grad_y_ptr,
    grad_probs_ptr,
    covered_ptr,
    H,
    K,
    stride_g,
    stride_y,
    routes_per_program,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Backward of unpermute with merging probs: grad_y[d] = g[t] * p[t,k];
    grad_probs[t,k] = <g[t], y[d]>; covered[d] = 1 for every row written (the rows left uncovered
    are zeroed by ``zero_uncovered_rows_kernel``). Program (t, j) owns routes [j * routes_per_program,
    (j + 1) * routes_per_program) of token t, as [BLOCK_K, BLOCK_H] tiles, so the g chunk is loaded
    once for BLOCK_K routes and their row streams are in flight together (one route at a time left the
    loads latency-bound)."""
    t = tl.program_id(0).to(tl.int64)
    k_begin = tl.program_id(1) * routes_per_program
    for k0 in range(k_begin, tl.minimum(k_begin + routes_per_program, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        d = tl.load(map_ptr + t * K + offs_k, mask=kmask, other=-1).to(tl.int64)
        valid = d >= 0
        w = tl.load(probs_ptr + t * K + offs_k, mask=valid, other=0.0).to(tl.float32)
        dot = tl.zeros([BLOCK_K, BLOCK_H], dtype=tl.float32)
        for start in range(0, H, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            hmask = offs < H
            g = tl.load(grad_out_ptr + t * stride_g + offs, mask=hmask, other=0.0).to(tl.float32)
            m2 = valid[:, None] & hmask[None, :]
            rows = d[:, None] * stride_y + offs[None, :]
            y = tl.load(y_ptr + rows, mask=m2, other=0.0).to(tl.float32)
            dot += g[None, :] * y
            tl.store(grad_y_ptr + rows, (g[None, :] * w[:, None]).to(grad_y_ptr.dtype.element_ty), mask=m2)
        tl.store(grad_probs_ptr + t * K + offs_k, tl.sum(dot, axis=1).to(grad_probs_ptr.dtype.element_ty),
                 mask=kmask)  # fmt: skip
        tl.store(covered_ptr + d, tl.full([BLOCK_K], 1, dtype=tl.int8), mask=valid)


@triton.jit
def mark_covered_kernel(map_ptr, covered_ptr, numel, BLOCK: tl.constexpr):
    """covered[d] = 1 for every destination row d >= 0 in the row-id map (flattened)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.load(map_ptr + offs, mask=offs < numel, other=-1).to(tl.int64)
    tl.store(covered_ptr + d, tl.full([BLOCK], 1, dtype=tl.int8), mask=d >= 0)


@triton.jit
def zero_uncovered_rows_kernel(
    out_ptr,
    probs_ptr,
    covered_ptr,
    N,
    H,
    stride,
    HAS_PROBS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[r] = 0 (and probs[r] = 0) for the rows r with covered[r] == 0 (padding, dropped and tail
    rows); covered rows are only read as flags, so this costs N bytes plus the zero rows."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = offs_r < N
    empty = (tl.load(covered_ptr + offs_r, mask=rmask, other=1) == 0) & rmask
    if tl.sum(empty.to(tl.int32), axis=0) > 0:
        rows = offs_r.to(tl.int64)[:, None] * stride
        zeros = tl.zeros([BLOCK_R, BLOCK_H], dtype=out_ptr.dtype.element_ty)
        for start in range(0, H, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            tl.store(out_ptr + rows + offs[None, :], zeros, mask=empty[:, None] & (offs[None, :] < H))
        if HAS_PROBS:
            tl.store(probs_ptr + offs_r, tl.zeros([BLOCK_R], dtype=probs_ptr.dtype.element_ty), mask=empty)


@triton.jit
def permute_fp8_rowwise_kernel(
    x_ptr,
    map_ptr,
    out_ptr,
    scale_ptr,
    H,
    K,
    stride_x,
    stride_out,
    FP8_MAX: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Permute + row-wise FP8 quantization: out[d] = fp8(x[t] / s), scale[d] = s = amax / FP8_MAX.
    Two passes over the row (amax, then quantize+scatter); the second read hits L2."""
    t = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + t * stride_x + offs, mask=offs < H, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.maximum(tl.max(amax, axis=0), 1e-12)
    scale = row_amax / FP8_MAX
    inv = FP8_MAX / row_amax
    for start in range(0, H, BLOCK_H):
        offs = start + tl.arange(0, BLOCK_H)
        hmask = offs < H
        x = tl.load(x_ptr + t * stride_x + offs, mask=hmask, other=0.0).to(tl.float32)
        q = tl.clamp(x * inv, -FP8_MAX, FP8_MAX).to(out_ptr.dtype.element_ty)
        for k in range(K):
            dest = tl.load(map_ptr + t * K + k).to(tl.int64)
            tl.store(out_ptr + dest * stride_out + offs, q, mask=hmask & (dest >= 0))
    for k in range(K):
        dest = tl.load(map_ptr + t * K + k).to(tl.int64)
        tl.store(scale_ptr + dest, scale, mask=dest >= 0)


def permute_block_h(hidden: int) -> int:
    # 2048 columns/program at 4 warps = 16 bf16 (two 16 B vectors) per thread in flight: enough
    # bytes in flight per SM for HBM without a grid of tiny programs (to confirm in bench_moe_ops).
    return min(2048, triton.next_power_of_2(max(hidden, 16)))
