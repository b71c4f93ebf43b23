"""Persistent grouped GEMM kernels for MoE experts (bf16/fp16/fp32 and FP8), sync-free.

Two kernels cover forward, dgrad and wgrad:

* ``grouped_gemm_kernel``: ``C[rows_g, :] = A[rows_g, :] @ B[g]`` for every group g, where the
  rows of group g are ``[offs_g, offs_g + len_g)`` of A and C. Forward (B = weight) and dgrad
  (B = weight viewed transposed through its strides) are the same kernel.
* ``grouped_gemm_variable_k_kernel``: ``C[g] = X[rows_g, :]^T @ Y[rows_g, :]`` (wgrad: the
  reduction axis is the variable per-group token count).

Tile scheduling happens on the device, so nothing ever reads group_lens on the host (CUDA-graph
capturable): every program loads the (<= BLOCK_G) group lengths, computes per-group tile counts
and their prefix sum with ``tl.cumsum``, and walks tile ids ``pid, pid + NUM_PROGS, ...`` up to
the real tile count. A tile id maps to its group by counting prefix sums <= tile id (a vector
compare over BLOCK_G lanes, cheaper than a host-built schedule and no prologue launch).

Rows of C past ``sum(group_lens)`` (only possible with inconsistent inputs) belong to an implicit
"tail" group that is written with zeros, and all row indices are clamped to M, so a bad
group_lens can give wrong numbers but never out-of-bounds accesses or uninitialised output.

FP8 scaling (``SCALE_MODE``), for the forward kernel:
  0 none; 1 TENSORWISE: a_scale[0] * b_scale[g];
  2 ROWWISE: a_scale[row] * b_scale[g, n] (scales along the reduction axis);
  3 BLOCKWISE: a_scale[row, k // 128] * b_scale[g, k // 128, n // 128], applied per K step
    (requires BLOCK_K == BLOCK_N == 128).
For the variable-K kernel: 0 none, 1 per-group scalars x_scale[g] * y_scale[g], 2 per-column
x_scale[p] * y_scale[q] (one scale per column of X / Y over all tokens).
"""

from __future__ import annotations

import triton
import triton.language as tl

from primus_turbo.triton.launch import launch_jit

SCALE_NONE = 0
SCALE_TENSORWISE = 1
SCALE_ROWWISE = 2
SCALE_BLOCKWISE = 3


@triton.jit
def _group_schedule(group_lens_ptr, G, M, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, num_n_tiles):
    """Per-lane (group) lengths, row offsets and inclusive tile prefix sums; lane G is the tail."""
    gidx = tl.arange(0, BLOCK_G)
    lens = tl.load(group_lens_ptr + gidx, mask=gidx < G, other=0)
    lens = tl.maximum(lens, 0)
    inclusive = tl.cumsum(lens, axis=0)
    ends = tl.minimum(inclusive, M)  # clamp: never touch rows >= M
    starts = tl.minimum(inclusive - lens, M)  # (with sum(lens) > M a group past M is empty, not moved back)
    starts = tl.where(gidx < G, starts, 0)
    covered = tl.max(tl.where(gidx < G, ends, 0), axis=0)
    # the tail lane G zero-fills rows [covered, M)
    starts = tl.where(gidx == G, covered, starts)
    lens = tl.where(gidx < G, ends - starts, tl.where(gidx == G, M - covered, 0))
    tiles = tl.cdiv(lens, BLOCK_M) * num_n_tiles
    cum_tiles = tl.cumsum(tiles, axis=0)
    return gidx, starts, lens, tiles, cum_tiles


@triton.jit
def _pick(gidx, values, g):
    return tl.sum(tl.where(gidx == g, values, 0), axis=0)


@triton.jit
def _tile_coords(tile, gidx, starts, lens, tiles, cum_tiles, num_n, GROUP_M: tl.constexpr):
    """(group, its row range, the tile's row / column block) of a forward tile id."""
    g = tl.sum((cum_tiles <= tile).to(tl.int32), axis=0)
    local = tile - (_pick(gidx, cum_tiles, g) - _pick(gidx, tiles, g))
    row_start = _pick(gidx, starts, g)
    row_end = row_start + _pick(gidx, lens, g)
    # GROUP_M-swizzled order inside the expert: a wave of NUM_PROGS tiles touches GROUP_M
    # row blocks of A and ~NUM_PROGS / GROUP_M column blocks of B[g], so both stay in L2
    # (row-major order re-reads B[g] from HBM once per row block: memory-bound at N >= 8K).
    num_m = _pick(gidx, tiles, g) // num_n
    tiles_per_band = GROUP_M * num_n
    first_m = (local // tiles_per_band) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    tile_m = first_m + (local % tiles_per_band) % band_m
    tile_n = (local % tiles_per_band) // band_m
    return g, row_start, row_end, tile_m, tile_n


@triton.jit
def _scale_epilogue(
    acc, g, rows64, cols, row_mask, col_mask, a_scale_ptr, b_scale_ptr,
    stride_asm, stride_bsg, stride_bsn, SCALE_MODE: tl.constexpr,
):  # fmt: skip
    """TENSORWISE (1) / ROWWISE (2) scales of a real group's forward tile (BLOCKWISE scales per K step)."""
    if SCALE_MODE == 1:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(b_scale_ptr + g * stride_bsg))
    if SCALE_MODE == 2:
        sa = tl.load(a_scale_ptr + rows64 * stride_asm, mask=row_mask, other=0.0)
        sb = tl.load(b_scale_ptr + g * stride_bsg + cols * stride_bsn, mask=col_mask, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    return acc


@triton.jit
def grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, group_lens_ptr, a_scale_ptr, b_scale_ptr,
    G, M, N, K,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsg, stride_bsk, stride_bsn,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_MODE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    gidx, starts, lens, tiles, cum_tiles = _group_schedule(group_lens_ptr, G, M, BLOCK_G, BLOCK_M, num_n)
    total_tiles = tl.sum(tiles, axis=0)
    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)
    offs_bk = tl.arange(0, BLOCK_K)
    for tile in range(pid, total_tiles, NUM_PROGS):
        g, row_start, row_end, tile_m, tile_n = _tile_coords(
            tile, gidx, starts, lens, tiles, cum_tiles, num_n, GROUP_M
        )
        rows = row_start + tile_m * BLOCK_M + offs_bm
        cols = tile_n * BLOCK_N + offs_bn
        row_mask = rows < row_end
        col_mask = cols < N
        rows64 = rows.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < G:
            a_ptrs = a_ptr + rows64[:, None] * stride_am + offs_bk[None, :] * stride_ak
            b_ptrs = (
                b_ptr + g.to(tl.int64) * stride_bg + offs_bk[:, None] * stride_bk + cols[None, :] * stride_bn
            )
            for k0 in range(0, K, BLOCK_K):
                k_mask = (k0 + offs_bk) < K
                a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if UPCAST:  # CPU interpreter: no native fp8/bf16 dot
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                if SCALE_MODE == 3:
                    kb = k0 // BLOCK_K
                    sa = tl.load(
                        a_scale_ptr + rows64 * stride_asm + kb * stride_ask, mask=row_mask, other=0.0
                    )
                    sb = tl.load(b_scale_ptr + g * stride_bsg + kb * stride_bsk + tile_n * stride_bsn)
                    acc += tl.dot(a, b) * (sa[:, None] * sb)
                elif IEEE:  # fp32 operands: exact fp32 products (the default would be tf32)
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            acc = _scale_epilogue(
                acc, g, rows64, cols, row_mask, col_mask, a_scale_ptr, b_scale_ptr,
                stride_asm, stride_bsg, stride_bsn, SCALE_MODE,
            )  # fmt: skip
        c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _vk_step(
    x_ptr, y_ptr, acc, k0, row_start, row_end, ps, qs, p_mask, q_mask, offs_bk,
    stride_xm, stride_xp, stride_ym, stride_yq,
    MASK_ROWS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """acc += X[k0:k0+BLOCK_K, ps]^T @ Y[k0:k0+BLOCK_K, qs], rows outside [row_start, row_end) masked."""
    rows64 = (k0 + offs_bk).to(tl.int64)
    x_ptrs = x_ptr + rows64[None, :] * stride_xm + ps[:, None] * stride_xp
    y_ptrs = y_ptr + rows64[:, None] * stride_ym + qs[None, :] * stride_yq
    if MASK_ROWS:
        rows = k0 + offs_bk
        r_mask = (rows >= row_start) & (rows < row_end)
        x = tl.load(x_ptrs, mask=p_mask[:, None] & r_mask[None, :], other=0.0)
        y = tl.load(y_ptrs, mask=r_mask[:, None] & q_mask[None, :], other=0.0)
    else:
        x = tl.load(x_ptrs, mask=p_mask[:, None], other=0.0)
        y = tl.load(y_ptrs, mask=q_mask[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
        y = y.to(tl.float32)
    if IEEE:
        acc = tl.dot(x, y, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, y, acc)
    return acc


@triton.jit
def _vk_scale_epilogue(acc, g, ps, qs, p_mask, q_mask, x_scale_ptr, y_scale_ptr, SCALE_MODE: tl.constexpr):
    """Variable-K scales: per group (1), or per column of X and of Y (2: along the token axis, they
    factor out of every group's sum)."""
    if SCALE_MODE == 1:
        acc = acc * (tl.load(x_scale_ptr + g) * tl.load(y_scale_ptr + g))
    if SCALE_MODE == 2:
        sx = tl.load(x_scale_ptr + ps, mask=p_mask, other=0.0)
        sy = tl.load(y_scale_ptr + qs, mask=q_mask, other=0.0)
        acc = acc * sx[:, None] * sy[None, :]
    return acc


@triton.jit
def _vk_c_tile(
    c_ptr, g, ps, qs, p_mask, q_mask, stride_cg, stride_cp, stride_cq,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, ACCUMULATE: tl.constexpr,
):  # fmt: skip
    """C[g]'s tile: its pointers, its mask and the accumulator's start (ACCUMULATE 2: C itself, loaded
    before the K loop; unscaled sums only), else zeros."""
    c_ptrs = c_ptr + g.to(tl.int64) * stride_cg + ps[:, None] * stride_cp + qs[None, :] * stride_cq
    c_mask = p_mask[:, None] & q_mask[None, :]
    if ACCUMULATE == 2:
        acc = tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    return c_ptrs, c_mask, acc


@triton.jit
def _vk_tile_coords(tile, per_group, num_q, gidx, starts, lens, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(group, its token range, the tile's first P / Q index) of a variable-K tile id (groups in order)."""
    g = tile // per_group
    local = tile % per_group
    row_start = _pick(gidx, starts, g)
    row_end = row_start + _pick(gidx, lens, g)
    return g, row_start, row_end, (local // num_q) * BLOCK_P, (local % num_q) * BLOCK_Q


@triton.jit
def grouped_gemm_variable_k_kernel(
    x_ptr, y_ptr, c_ptr, group_lens_ptr, x_scale_ptr, y_scale_ptr,
    G, M, P, Q,
    stride_xm, stride_xp, stride_ym, stride_yq, stride_cg, stride_cp, stride_cq,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_MODE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr = False,
    ACCUMULATE: tl.constexpr = 0,
):  # fmt: skip
    """C[g] = X[rows_g]^T @ Y[rows_g]; an empty group's C[g] is written as exact zeros. ACCUMULATE:
    C[g] += X[rows_g]^T @ Y[rows_g] (summed in fp32, one rounding to C's dtype; an empty group's C[g] is
    left as it was): a weight gradient added into an fp32 gradient buffer, read in the epilogue (1) or as
    the accumulator's start before the K loop (2, SCALE_MODE 0 only)."""
    pid = tl.program_id(0)
    gidx, starts, lens, _, _ = _group_schedule(group_lens_ptr, G, M, BLOCK_G, 1, 1)
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    tiles_per_group = num_p * num_q
    offs_bp = tl.arange(0, BLOCK_P)
    offs_bq = tl.arange(0, BLOCK_Q)
    offs_bk = tl.arange(0, BLOCK_K)
    for tile in range(pid, G * tiles_per_group, NUM_PROGS):
        g, row_start, row_end, p0, q0 = _vk_tile_coords(
            tile, tiles_per_group, num_q, gidx, starts, lens, BLOCK_P, BLOCK_Q
        )
        ps = p0 + offs_bp
        qs = q0 + offs_bq
        p_mask = ps < P
        q_mask = qs < Q
        c_ptrs, c_mask, acc = _vk_c_tile(
            c_ptr, g, ps, qs, p_mask, q_mask, stride_cg, stride_cp, stride_cq, BLOCK_P, BLOCK_Q, ACCUMULATE
        )
        # Token tiles aligned to BLOCK_K: the interior ones are unmasked along the token axis, so
        # token-contiguous operands (the FP8 transposed copies) get aligned vector loads; only the
        # (at most two) partial tiles at the group's edges are masked. A mask on an arbitrary
        # row_start / row_end along the contiguous axis would force 1-element loads everywhere.
        first_full = tl.cdiv(row_start, BLOCK_K) * BLOCK_K
        last_full = (row_end // BLOCK_K) * BLOCK_K
        if (row_start < first_full) & (row_start < row_end):  # head: a partial tile
            acc = _vk_step(
                x_ptr, y_ptr, acc, first_full - BLOCK_K, row_start, row_end, ps, qs, p_mask, q_mask,
                offs_bk, stride_xm, stride_xp, stride_ym, stride_yq, True, UPCAST, IEEE,
            )  # fmt: skip
        for k0 in range(first_full, last_full, BLOCK_K):
            acc = _vk_step(
                x_ptr, y_ptr, acc, k0, row_start, row_end, ps, qs, p_mask, q_mask,
                offs_bk, stride_xm, stride_xp, stride_ym, stride_yq, False, UPCAST, IEEE,
            )  # fmt: skip
        if (last_full < row_end) & (last_full >= first_full):  # tail: a partial tile
            acc = _vk_step(
                x_ptr, y_ptr, acc, last_full, row_start, row_end, ps, qs, p_mask, q_mask,
                offs_bk, stride_xm, stride_xp, stride_ym, stride_yq, True, UPCAST, IEEE,
            )  # fmt: skip
        acc = _vk_scale_epilogue(acc, g, ps, qs, p_mask, q_mask, x_scale_ptr, y_scale_ptr, SCALE_MODE)
        if ACCUMULATE == 1:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# -- launchers ------------------------------------------------------------------------------------
# Tile choices (H100/H200, masked-pointer loads, one CTA per SM): 128x256x64 / 8 warps / 3 stages
# is the Triton matmul tutorial's best bf16 config on sm_90 (147 KB smem); FP8 as measured below
# (BLOCKWISE needs BLOCK_N == BLOCK_K == 128 so one weight scale covers a tile's K step). FP8 operands
# whose reduction axis is contiguous take the TMA kernels of grouped_gemm_tma_kernel instead. fp32
# operands run an exact ("ieee") FMA dot with 64x64x32 tiles: a 16-bit tile config would need
# twice the shared memory (128x128x64 x 4 stages = 256 KB > the 227 KB of sm_90) and tf32 would
# miss fp32 accuracy. Every config is then pruned by its operand bytes (``fit_smem``).
# The CPU interpreter gets small tiles (speed of the numpy emulation, not of a GPU).

SMEM_BUDGET = 200 * 1024  # of sm_90's 227 KB: headroom for the epilogue/layout-conversion scratch


def _num_programs(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _block_g(num_groups: int) -> int:
    return max(16, triton.next_power_of_2(num_groups + 1))  # +1: the zero-filled tail lane


def fit_smem(cfg: dict, elem_bytes: int, keys=("BLOCK_M", "BLOCK_N", "BLOCK_K")) -> dict:
    """Drop pipeline stages (then halve the N tile) until the operand buffers fit SMEM_BUDGET.

    Triton on sm_90 allocates one A and one B buffer per stage (128x128x64 fp32 x 4 stages is the
    262144 bytes an H200 rejected).
    """
    cfg = dict(cfg)
    bm, bn, bk = keys

    def smem(c):
        return (c[bm] * c[bk] + c[bk] * c[bn]) * elem_bytes * c["num_stages"]

    while smem(cfg) > SMEM_BUDGET and cfg["num_stages"] > 2:
        cfg["num_stages"] -= 1
    while smem(cfg) > SMEM_BUDGET and cfg[bn] > 32:
        cfg[bn] //= 2
    return cfg


def _fwd_config(is_fp8: bool, scale_mode: int, n: int, on_gpu: bool, elem_bytes: int | None = None) -> dict:
    elem_bytes = elem_bytes or (1 if is_fp8 else 2)
    if scale_mode == SCALE_BLOCKWISE:
        return dict(BLOCK_M=128 if on_gpu else 32, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=4)
    if not on_gpu:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=1)
    if is_fp8:  # H200 sweep (eb7a9e8): 128x256x128 / 3 stages 1.08-1.19x 128x128x128 / 4 at 5 MoE shapes
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3)
    elif elem_bytes >= 4:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
    elif n >= 256:
        cfg = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
    return fit_smem(cfg, elem_bytes)


def _wgrad_config(is_fp8: bool, on_gpu: bool, elem_bytes: int | None = None) -> dict:
    elem_bytes = elem_bytes or (1 if is_fp8 else 2)
    if not on_gpu:
        return dict(BLOCK_P=32, BLOCK_Q=64, BLOCK_K=32, num_warps=4, num_stages=1)
    if is_fp8:  # H200 sweep (eb7a9e8): 128x256x64 / 4 stages 1.05-1.27x 128x128x128 / 4 at 5 MoE shapes
        cfg = dict(BLOCK_P=128, BLOCK_Q=256, BLOCK_K=64, num_warps=8, num_stages=4)
    elif elem_bytes >= 4:
        cfg = dict(BLOCK_P=64, BLOCK_Q=64, BLOCK_K=32, num_warps=4, num_stages=3)
    else:
        cfg = dict(BLOCK_P=128, BLOCK_Q=256, BLOCK_K=64, num_warps=8, num_stages=3)
    return fit_smem(cfg, elem_bytes, keys=("BLOCK_P", "BLOCK_Q", "BLOCK_K"))


def launch_grouped_gemm(
    a, b_view, out, group_lens, a_scale=None, b_scale=None, scale_mode=SCALE_NONE, config=None
):  # fmt: skip
    """out[rows_g] = a[rows_g] @ b_view[g] (b_view: [G, K, N], any strides); out is fully written.

    a_scale/b_scale strides follow the layouts in the module docstring (b_scale may be a strided
    view, e.g. the transpose used by dgrad). Empty problems launch nothing (M*N == 0: nothing to
    write; K == 0: out is zero-filled here). ``config``: tile overrides (BLOCK_M/N/K, GROUP_M,
    num_warps, num_stages) for benchmarks.
    """
    m, k = a.shape
    g, _, n = b_view.shape
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    on_gpu = a.is_cuda
    elem_bytes = max(a.element_size(), b_view.element_size())
    cfg = {"GROUP_M": 8 if on_gpu else 2, **_fwd_config(elem_bytes == 1, scale_mode, n, on_gpu, elem_bytes)}
    cfg.update(config or {})
    ieee = a.dtype == b_view.dtype and a.element_size() == 4 and scale_mode == SCALE_NONE
    a_scale = a_scale if a_scale is not None else out
    b_scale = b_scale if b_scale is not None else out
    a_s = list(a_scale.stride()) + [0, 0] if scale_mode >= SCALE_ROWWISE else [0, 0]
    if scale_mode == SCALE_BLOCKWISE:
        b_s = list(b_scale.stride())
    elif scale_mode == SCALE_ROWWISE:
        b_s = [b_scale.stride(0), 0, b_scale.stride(1)]
    elif scale_mode == SCALE_TENSORWISE:
        b_s = [b_scale.stride(0), 0, 0]
    else:
        b_s = [0, 0, 0]
    launch_jit(grouped_gemm_kernel, (_num_programs(a.device),),
        a, b_view, out, group_lens, a_scale, b_scale,
        g, m, n, k,
        a.stride(0), a.stride(1), b_view.stride(0), b_view.stride(1), b_view.stride(2),
        out.stride(0), out.stride(1),
        a_s[0], a_s[1], b_s[0], b_s[1], b_s[2],
        NUM_PROGS=_num_programs(a.device), BLOCK_G=_block_g(g),
        SCALE_MODE=scale_mode, UPCAST=not on_gpu, IEEE=ieee, **cfg,
    )  # fmt: skip
    return out


def vk_out_base(out, reverse_groups: bool):
    """(the tensor whose pointer group 0 is stored at, the group stride) of a variable-K output [G, P, Q]:
    out and out.stride(0), or with ``reverse_groups`` out[G-1] and -out.stride(0), so that group g lands in
    out[G-1-g] (buffers in reverse group order, e.g. Megatron's expert main_grads)."""
    if reverse_groups:
        return out[out.shape[0] - 1], -out.stride(0)
    return out, out.stride(0)


def launch_grouped_gemm_variable_k(
    x, y, out, group_lens, x_scale=None, y_scale=None, scale_mode=None, accumulate=False, config=None,
    reverse_groups=False,
):  # fmt: skip
    """out[g] = x[rows_g]^T @ y[rows_g] for g < G (out: [G, P, Q], any strides); empty groups get zeros.
    ``accumulate``: out[g] += ... instead (empty groups unchanged), the sum taken in fp32; True / 1 reads out
    in the epilogue, 2 before the K loop (unscaled operands only).

    Scales: [G] each (scale_mode 1, the default when given) or [P] / [Q] contiguous (mode 2).
    No tokens (M == 0) zero-fills out (leaves it, when accumulating) without a launch.
    ``config``: tile overrides (BLOCK_P/Q/K, num_warps, num_stages) for benchmarks.
    ``reverse_groups``: group g goes to out[G-1-g].
    """
    m, p = x.shape
    q = y.shape[1]
    g = out.shape[0]
    if out.numel() == 0:
        return out
    if m == 0:
        return out if accumulate else out.zero_()
    on_gpu = x.is_cuda
    elem_bytes = max(x.element_size(), y.element_size())
    cfg = {**_wgrad_config(elem_bytes == 1, on_gpu, elem_bytes), **(config or {})}
    if scale_mode is None:
        scale_mode = SCALE_TENSORWISE if x_scale is not None else SCALE_NONE
    accumulate = int(accumulate)
    if accumulate == 2 and scale_mode != SCALE_NONE:
        raise ValueError("launch_grouped_gemm_variable_k: accumulate=2 (C first) needs unscaled operands")
    ieee = x.dtype == y.dtype and x.element_size() == 4 and scale_mode == SCALE_NONE
    c_base, stride_cg = vk_out_base(out, reverse_groups)
    launch_jit(grouped_gemm_variable_k_kernel, (_num_programs(x.device),),
        x, y, c_base, group_lens,
        x_scale if x_scale is not None else out, y_scale if y_scale is not None else out,
        g, m, p, q,
        x.stride(0), x.stride(1), y.stride(0), y.stride(1), stride_cg, out.stride(1), out.stride(2),
        NUM_PROGS=_num_programs(x.device), BLOCK_G=_block_g(g),
        SCALE_MODE=scale_mode, UPCAST=not on_gpu, IEEE=ieee, ACCUMULATE=accumulate, **cfg,
    )  # fmt: skip
    return out
