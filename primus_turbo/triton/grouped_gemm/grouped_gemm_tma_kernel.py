"""FP8 grouped GEMM kernels whose operand tiles move through TMA (host ``TensorDescriptor``s), sm_90.

Same math, schedule and output contract as ``grouped_gemm_kernel`` / ``grouped_gemm_variable_k_kernel``
(device-side tile schedule over group_lens, no host sync; rows past ``sum(group_lens)`` are zeros). They
serve the FP8 operands whose reduction axis is contiguous, the layout Hopper FP8 MMAs read. Measured on
H200 in GPU time (``benchmark/ops/sweep_grouped_gemm_fp8.py``, five MoE shapes,
results/h200/sweep_grouped_gemm_fp8_adb78e3.txt): the forward at 128x256x128 runs 1.00-1.28x
torch._scaled_grouped_mm (CUTLASS; 0.97x at DeepSeek-V3 fc2) and 1.06-1.11x the pointer kernel at the
same tile; the variable-K at 128x256x64 runs
1.28-1.43x the pointer kernel's former 128x128x128 tile and 0.63-0.98x CUTLASS (which needs E4M3 and
groups of a multiple of 16 tokens).

Forward / dgrad (``grouped_gemm_tma_kernel``): A [M, K] row-major through a [BLOCK_M, BLOCK_K] box
(rows past a group's end feed only output rows that are never stored); B as a 2-D K-contiguous matrix
(``b_view[g][k, n]`` at row ``g * B_GROUP_ROWS + n``, column ``g * B_GROUP_COLS + k``) through a
[BLOCK_N, BLOCK_K] box: the forward's [G*N, K] weight copy shifts groups by rows (columns past N feed
only masked output columns), the dgrad's K-major [K, G*N] copy shifts them by columns (needs
K % BLOCK_K == 0 so a K step never reads the next expert). K's tail is the descriptor's zero fill.

Variable-K (``grouped_gemm_variable_k_tma_kernel``): X_t [P, M] and Y_t [Q, M] token-contiguous
through [BLOCK_P | BLOCK_Q, BLOCK_K] boxes for the group's BLOCK_K-aligned interior token tiles; the
(at most two) partial tiles at the group's edges are masked pointer loads, as in the pointer kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
    SCALE_NONE,
    SCALE_ROWWISE,
    SCALE_TENSORWISE,
    _block_g,
    _group_schedule,
    _num_programs,
    _scale_epilogue,
    _tile_coords,
    _vk_c_tile,
    _vk_scale_epilogue,
    _vk_step,
    _vk_tile_coords,
    vk_out_base,
)
from primus_turbo.triton.launch import launch_jit

__all__ = [
    "tma_forward_supported",
    "tma_variable_k_supported",
    "launch_grouped_gemm_tma",
    "launch_grouped_gemm_variable_k_tma",
]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_SMEM_BYTES = 227 * 1024  # sm_90's shared memory per block
_HALF = (torch.bfloat16, torch.float16)
# H200 sweep (eb7a9e8, results/h200/sweep_grouped_gemm_fp8_eb7a9e8.txt), six tiles at five MoE shapes:
# the forward's best tile at every shape; for the
# variable-K, 256x128x128 is 3-7% faster at four shapes but 36% slower where 31 of 32 experts hold ~400
# tokens (DeepSeek-V3 fc1, skewed): BLOCK_K 64 halves the partial token tiles at the group edges
# TMA_STORE (row tiles inside their group through a descriptor): +1-4% forward, +1-3% dgrad at all five
# shapes in the 884b8cd sweep (results/h200/sweep_grouped_gemm_fp8_884b8cd.txt)
FWD_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, TMA_STORE=True)
# TMA_STORE: the output tile leaves through a descriptor (where the output rows are 16-byte aligned);
# H200 sweep at 88617d7 (results/h200/sweep_grouped_gemm_fp8_88617d7.txt): +3-10% over pointer stores
# at every shape, both tiles.
VK_TILE = dict(BLOCK_P=128, BLOCK_Q=256, BLOCK_K=64, num_warps=8, num_stages=4, TMA_STORE=True)
# Small per-expert outputs (P x Q <= VK_SMALL_OUTPUT): short token loops per tile, so two CTAs per SM of a
# 128x128 / 4-warp tile overlap one tile's epilogue with the other's loads. H200 sweep at 48acb0c
# (results/h200/sweep_grouped_gemm_fp8_48acb0c.txt): +10% DSv2-Lite fc1 (2816 x 2048), +14% fc2 (2048 x
# 1408); -6% DeepSeek-V3 fc1 (4096 x 7168), -1% Mixtral / DeepSeek-V3 fc2, where VK_TILE stays.
VK_TILE_SMALL = dict(
    BLOCK_P=128, BLOCK_Q=128, BLOCK_K=64, num_warps=4, num_stages=4, PROGS_PER_SM=2, TMA_STORE=True
)
VK_SMALL_OUTPUT = 8 << 20
# bf16 / fp16 operands (K-contiguous or N-contiguous B; row-major X / Y in the variable-K): the pointer
# kernels' 16-bit tiles (the Triton matmul tutorial's best bf16 config on sm_90), operands through TMA
HALF_FWD_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, TMA_STORE=True)
HALF_VK_TILE = dict(BLOCK_P=128, BLOCK_Q=256, BLOCK_K=64, num_warps=8, num_stages=3, TMA_STORE=True)
# fp32 outputs (the weight gradient added into main_grad) of small experts (P x Q <= VK_SMALL_OUTPUT): two
# CTAs per SM overlap one tile's fp32 read-modify-write with the other's loads. H200 sweep (session 25,
# results/h200/sweep_grouped_gemm_bf16_*.txt), accumulate=2: 1326 vs 1403 us DeepSeek-V2-Lite fc1, 669 vs
# 746 fc2; bf16 outputs gain nothing from it (638 vs 634, 341 vs 338)
HALF_VK_TILE_SMALL = dict(
    BLOCK_P=128, BLOCK_Q=128, BLOCK_K=64, num_warps=4, num_stages=3, PROGS_PER_SM=2, TMA_STORE=False
)


@triton.jit
def grouped_gemm_tma_kernel(
    a_desc, b_desc, c_ptr, c_desc, group_lens_ptr, a_scale_ptr, b_scale_ptr,
    G, M, N, K, B_GROUP_ROWS, B_GROUP_COLS, stride_cm, stride_cn,
    stride_asm, stride_bsg, stride_bsn,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCALE_MODE: tl.constexpr, UPCAST: tl.constexpr, TMA_STORE: tl.constexpr = False,
    B_KMAJOR: tl.constexpr = True,
):  # fmt: skip
    """C[rows_g] = A[rows_g] @ b_view[g] with TENSORWISE / ROWWISE scales as in grouped_gemm_kernel.
    TMA_STORE: a tile whose rows all belong to its group leaves through c_desc ([M, N], box [BLOCK_M,
    BLOCK_N]); a group's last, partial tile keeps the masked pointer store (a box would cross into the
    next group's rows). B_KMAJOR: b_desc is K-contiguous (box [BLOCK_N, BLOCK_K]); else (16-bit operands)
    N-contiguous, groups shifted by B_GROUP_ROWS rows of a [G*K, N] matrix (box [BLOCK_K, BLOCK_N])."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    gidx, starts, lens, tiles, cum_tiles = _group_schedule(group_lens_ptr, G, M, BLOCK_G, BLOCK_M, num_n)
    total_tiles = tl.sum(tiles, axis=0)
    offs_bm = tl.arange(0, BLOCK_M)
    offs_bn = tl.arange(0, BLOCK_N)
    for tile in range(pid, total_tiles, NUM_PROGS):
        g, row_start, row_end, tile_m, tile_n = _tile_coords(
            tile, gidx, starts, lens, tiles, cum_tiles, num_n, GROUP_M
        )
        m0 = (row_start + tile_m * BLOCK_M).to(tl.int32)  # TMA offsets are 32-bit
        rows = m0 + offs_bm
        cols = tile_n * BLOCK_N + offs_bn
        row_mask = rows < row_end
        col_mask = cols < N
        rows64 = rows.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < G:
            if B_KMAJOR:
                b_row = (g * B_GROUP_ROWS + tile_n * BLOCK_N).to(tl.int32)
                b_col = (g * B_GROUP_COLS).to(tl.int32)
            else:
                b_row = (g * B_GROUP_ROWS).to(tl.int32)
                b_col = (tile_n * BLOCK_N).to(tl.int32)
            for k0 in range(0, K, BLOCK_K):
                a = a_desc.load([m0, k0])
                if B_KMAJOR:
                    b = b_desc.load([b_row, b_col + k0]).T
                else:
                    b = b_desc.load([b_row + k0, b_col])
                if UPCAST:  # CPU interpreter: no native fp8 / bf16 dot
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc)
            acc = _scale_epilogue(
                acc, g, rows64, cols, row_mask, col_mask, a_scale_ptr, b_scale_ptr,
                stride_asm, stride_bsg, stride_bsn, SCALE_MODE,
            )  # fmt: skip
        if TMA_STORE and (m0 + BLOCK_M <= row_end):
            c_desc.store([m0, (tile_n * BLOCK_N).to(tl.int32)], acc.to(c_ptr.dtype.element_ty))
        else:
            c_ptrs = c_ptr + rows64[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _tma_store_desc(out, box, config, cfg, who):
    """A TMA descriptor over out for cfg's TMA_STORE, or None: where out's rows are not 16-byte aligned
    the default tile's TMA_STORE falls back to pointer stores; asked for in ``config`` it raises."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    es = out.element_size()
    aligned = out.stride(-1) == 1 and out.data_ptr() % 16 == 0
    aligned = aligned and not any((v * es) % 16 for v in out.stride()[:-1])
    if cfg.get("TMA_STORE") and not aligned:
        if (config or {}).get("TMA_STORE"):  # asked for by the caller: an error, not a silent switch
            raise ValueError(f"{who}: TMA_STORE needs 16-byte aligned output rows")
        cfg["TMA_STORE"] = False
    if not cfg.get("TMA_STORE"):
        return None
    return TensorDescriptor(out, list(out.shape), list(out.stride()), box)


def _group_order(out, reverse_groups, config, cfg, who):
    """``vk_out_base``; reversed stores go through pointers (the store descriptor needs positive strides)."""
    if reverse_groups:
        if (config or {}).get("TMA_STORE"):
            raise ValueError(f"{who}: reverse_groups stores through pointers; TMA_STORE cannot be asked for")
        cfg["TMA_STORE"] = False
    return vk_out_base(out, reverse_groups)


@triton.jit
def grouped_gemm_variable_k_tma_kernel(
    x_desc, y_desc, x_ptr, y_ptr, c_ptr, c_desc, group_lens_ptr, x_scale_ptr, y_scale_ptr,
    G, M, P, Q, stride_xm, stride_xp, stride_ym, stride_yq, stride_cg, stride_cp, stride_cq,
    NUM_PROGS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_MODE: tl.constexpr, UPCAST: tl.constexpr, TMA_STORE: tl.constexpr = False,
    TOKENS_CONTIGUOUS: tl.constexpr = True, ACCUMULATE: tl.constexpr = 0,
):  # fmt: skip
    """C[g] = X[rows_g]^T @ Y[rows_g], scaled per group (1) or per column (2); empty groups: zeros.
    TOKENS_CONTIGUOUS: the descriptors cover X_t [P, M] / Y_t [Q, M] (FP8 copies; boxes [BLOCK_P|Q,
    BLOCK_K]); else X [M, P] / Y [M, Q] row-major (16-bit operands; boxes [BLOCK_K, BLOCK_P|Q]). x_ptr /
    y_ptr and the strides address the same storage for the edge tiles. ACCUMULATE 2: C[g] += (C read as
    the accumulator's start, unscaled operands only; an empty group's C[g] is left as it was).
    TMA_STORE: the tile leaves through c_desc ([G, P, Q], box [1, BLOCK_P, BLOCK_Q], clipped per group)
    instead of masked pointer stores."""
    pid = tl.program_id(0)
    gidx, starts, lens, _, _ = _group_schedule(group_lens_ptr, G, M, BLOCK_G, 1, 1)
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    per_group = num_p * num_q
    offs_bp = tl.arange(0, BLOCK_P)
    offs_bq = tl.arange(0, BLOCK_Q)
    offs_bk = tl.arange(0, BLOCK_K)
    for tile in range(pid, G * per_group, NUM_PROGS):
        g, row_start, row_end, p0, q0 = _vk_tile_coords(
            tile, per_group, num_q, gidx, starts, lens, BLOCK_P, BLOCK_Q
        )
        ps = p0 + offs_bp
        qs = q0 + offs_bq
        p_mask = ps < P
        q_mask = qs < Q
        c_ptrs, c_mask, acc = _vk_c_tile(
            c_ptr, g, ps, qs, p_mask, q_mask, stride_cg, stride_cp, stride_cq, BLOCK_P, BLOCK_Q, ACCUMULATE
        )
        first_full = (tl.cdiv(row_start, BLOCK_K) * BLOCK_K).to(tl.int32)
        last_full = ((row_end // BLOCK_K) * BLOCK_K).to(tl.int32)
        # the (at most two) partial token tiles at the group's edges: masked pointer loads (64-bit offsets)
        ps64, qs64 = ps.to(tl.int64), qs.to(tl.int64)
        if (row_start < first_full) & (row_start < row_end):  # head: a partial token tile
            acc = _vk_step(
                x_ptr, y_ptr, acc, first_full - BLOCK_K, row_start, row_end, ps64, qs64, p_mask, q_mask,
                offs_bk, stride_xm, stride_xp, stride_ym, stride_yq, True, UPCAST, False,
            )  # fmt: skip
        for k0 in range(first_full, last_full, BLOCK_K):
            if TOKENS_CONTIGUOUS:
                x = x_desc.load([p0, k0])
                y = y_desc.load([q0, k0]).T
            else:
                x = x_desc.load([k0, p0]).T
                y = y_desc.load([k0, q0])
            if UPCAST:
                x = x.to(tl.float32)
                y = y.to(tl.float32)
            acc = tl.dot(x, y, acc)
        if (last_full < row_end) & (last_full >= first_full):  # tail: a partial token tile
            acc = _vk_step(
                x_ptr, y_ptr, acc, last_full, row_start, row_end, ps64, qs64, p_mask, q_mask,
                offs_bk, stride_xm, stride_xp, stride_ym, stride_yq, True, UPCAST, False,
            )  # fmt: skip
        acc = _vk_scale_epilogue(acc, g, ps, qs, p_mask, q_mask, x_scale_ptr, y_scale_ptr, SCALE_MODE)
        if TMA_STORE:
            c_desc.store([g, p0, q0], acc.to(c_ptr.dtype.element_ty).reshape(1, BLOCK_P, BLOCK_Q))
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# -- eligibility and launchers ---------------------------------------------------------------------


def _tma_device(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


def _b_layout(b_view: torch.Tensor, block_k: int):
    """b_view [G, K, N] (K contiguous) as (rows, cols, row stride, group row shift, group col shift) of
    the 2-D K-contiguous matrix it lives in, or None."""
    g, k, n = b_view.shape
    sg, sk, sn = b_view.stride()
    if sk != 1 or (sn * b_view.element_size()) % 16 or b_view.data_ptr() % 16 or n == 0 or k == 0:
        return None
    if g == 1 or (sg % sn == 0 and k <= sn):  # groups shifted by rows (the forward's [G*N, K] copy)
        shift = 0 if g == 1 else sg // sn
        return (g - 1) * shift + n, k, sn, shift, 0
    if sg >= k and (g - 1) * sg + k <= sn and (k % block_k == 0):  # by columns (the dgrad's [K, G*N] copy)
        return n, (g - 1) * sg + k, sn, 0, sg
    return None


def _b_layout_nmajor(b_view: torch.Tensor, block_k: int):
    """b_view [G, K, N] with N contiguous (16-bit operands: the dgrad's view of a [G, N, K] weight, or a
    [G, K, N] one) as (rows, cols, row stride, group row shift, 0) of the [G*K, N] matrix it lives in, or
    None. More than one group needs K % block_k == 0: a K step past a group's end would read the next
    group's rows (the descriptor zero-fills only past the matrix)."""
    g, k, n = b_view.shape
    sg, sk, sn = b_view.stride()
    if sn != 1 or (sk * b_view.element_size()) % 16 or b_view.data_ptr() % 16 or n == 0 or k == 0 or n > sk:
        return None
    if g == 1:
        return k, n, sk, 0, 0
    if sg % sk == 0 and sg // sk >= k and k % block_k == 0:
        return (g - 1) * (sg // sk) + k, n, sk, sg // sk, 0
    return None


def _rows_aligned(t: torch.Tensor) -> bool:
    """A 2-D operand a TMA descriptor can cover: unit inner stride, 16-byte aligned rows and base."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_forward_supported(a: torch.Tensor, b_view: torch.Tensor, scale_mode: int, interpret: bool = False):
    """On sm_90+ (or the CPU interpreter when ``interpret``), a [M, K] row-major and b_view [G, K, N],
    16-byte aligned: fp8 with K contiguous in b_view and TENSORWISE / ROWWISE scales, or bf16 / fp16
    unscaled with K or N contiguous. BLOCKWISE stays on the pointer kernel: with its per-K-step scales the
    TMA variant measured 0.33-0.82x of it (H200, adb78e3)."""
    if not (interpret or _tma_device(a)):
        return False
    m, k = a.shape
    if m == 0 or k == 0 or not _rows_aligned(a):
        return False
    if a.dtype in _FP8 and b_view.dtype in _FP8:
        if scale_mode not in (SCALE_TENSORWISE, SCALE_ROWWISE) or k % 16:
            return False
        return _b_layout(b_view, FWD_TILE["BLOCK_K"]) is not None
    if a.dtype in _HALF and b_view.dtype == a.dtype and scale_mode == SCALE_NONE:
        bk = HALF_FWD_TILE["BLOCK_K"]
        return _b_layout(b_view, bk) is not None or _b_layout_nmajor(b_view, bk) is not None
    return False


def tma_variable_k_supported(x: torch.Tensor, y: torch.Tensor, interpret: bool = False) -> bool:
    """x [M, P], y [M, Q], 16-byte aligned: fp8 views of contiguous [P, M] / [Q, M] copies with M % 16 == 0,
    or bf16 / fp16 row-major (P, Q multiples of 8)."""
    if not (interpret or _tma_device(x)) or x.shape[0] == 0:
        return False
    m = x.shape[0]
    if x.dtype in _FP8 and y.dtype in _FP8:
        return (
            m % 16 == 0 and x.stride() == (1, m) and y.stride() == (1, m)
            and x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0
        )  # fmt: skip
    if x.dtype in _HALF and y.dtype == x.dtype:
        return _rows_aligned(x) and _rows_aligned(y)
    return False


def launch_grouped_gemm_tma(
    a, b_view, out, group_lens, a_scale=None, b_scale=None, scale_mode=SCALE_NONE, config=None
):  # fmt: skip
    """As ``launch_grouped_gemm`` for operands ``tma_forward_supported`` accepts; out is fully written."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    g, _, n = b_view.shape
    if out.numel() == 0:
        return out
    if not tma_forward_supported(a, b_view, scale_mode, interpret=True):
        raise ValueError("launch_grouped_gemm_tma: operands or scale mode the TMA kernel does not take")
    half = a.dtype in _HALF
    cfg = {**(HALF_FWD_TILE if half else FWD_TILE), "GROUP_M": 8, **(config or {})}
    on_gpu = a.is_cuda
    if not on_gpu:  # CPU interpreter (tests): small tiles
        cfg.update(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_stages=1, num_warps=4)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    layout, kmajor = _b_layout(b_view, bk), True
    if layout is None and half:
        layout, kmajor = _b_layout_nmajor(b_view, bk), False
    if layout is None:
        raise ValueError(f"launch_grouped_gemm_tma: b_view's layout does not take BLOCK_K={bk}")
    rows, cols, row_stride, group_rows, group_cols = layout
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [bm, bk])
    b_desc = TensorDescriptor(b_view, [rows, cols], [row_stride, 1], [bn, bk] if kmajor else [bk, bn])
    a_stride = a_scale.stride(0) if scale_mode == SCALE_ROWWISE else 0
    b_strides = (
        b_scale.stride(0) if scale_mode != SCALE_NONE else 0,
        b_scale.stride(1) if scale_mode == SCALE_ROWWISE else 0,
    )
    progs = _num_programs(a.device) * cfg.pop("PROGS_PER_SM", 1)
    c_desc = _tma_store_desc(out, [bm, bn], config, cfg, "launch_grouped_gemm_tma")
    launch_jit(grouped_gemm_tma_kernel, (progs,),
        a_desc, b_desc, out, c_desc, group_lens, out if a_scale is None else a_scale,
        out if b_scale is None else b_scale,
        g, m, n, k, group_rows, group_cols, out.stride(0), out.stride(1),
        a_stride, *b_strides,
        NUM_PROGS=progs, BLOCK_G=_block_g(g), SCALE_MODE=scale_mode, UPCAST=not on_gpu,
        B_KMAJOR=kmajor, **cfg,
    )  # fmt: skip
    return out


def _vk_store_fits(cfg: dict, in_bytes: int, out_bytes: int) -> bool:
    """Whether the variable-K tile's TMA store staging fits beside its operand stages. Triton gives the
    staging tile its own shared memory: an fp32 128x256 tile (128 KB) next to three 16-bit operand stages
    (144 KB) exceeds sm_90's 227 KB."""
    operands = (cfg["BLOCK_P"] + cfg["BLOCK_Q"]) * cfg["BLOCK_K"] * in_bytes * cfg["num_stages"]
    return operands + cfg["BLOCK_P"] * cfg["BLOCK_Q"] * out_bytes <= _SMEM_BYTES


def launch_grouped_gemm_variable_k_tma(
    x, y, out, group_lens, x_scale=None, y_scale=None, scale_mode=SCALE_NONE, config=None, accumulate=0,
    reverse_groups=False,
):  # fmt: skip
    """As ``launch_grouped_gemm_variable_k`` for operands ``tma_variable_k_supported`` accepts: out[g] =
    x[rows_g]^T @ y[rows_g] scaled, empty groups zeros. ``accumulate`` 2: out[g] += (out read as the
    accumulator's start, unscaled operands only; empty groups unchanged). ``reverse_groups``: group g goes
    to out[G-1-g] (pointer stores)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, p = x.shape
    q, g = y.shape[1], out.shape[0]
    if out.numel() == 0:
        return out
    if not tma_variable_k_supported(x, y, interpret=True):
        raise ValueError("launch_grouped_gemm_variable_k_tma: operands the TMA kernel does not take")
    if accumulate not in (0, 2) or (accumulate and scale_mode != SCALE_NONE):
        raise ValueError("launch_grouped_gemm_variable_k_tma: accumulate is 0 or 2 (2: unscaled operands)")
    tokens_contiguous = x.dtype in _FP8
    if tokens_contiguous:
        tile = VK_TILE_SMALL if p * q <= VK_SMALL_OUTPUT else VK_TILE
    elif out.element_size() == 4 and p * q <= VK_SMALL_OUTPUT:
        tile = HALF_VK_TILE_SMALL
    else:
        tile = HALF_VK_TILE
    cfg = {**tile, **(config or {})}
    on_gpu = x.is_cuda
    if not on_gpu:
        cfg.update(BLOCK_P=32, BLOCK_Q=64, BLOCK_K=32, num_stages=1, num_warps=4)
    bp, bq, bk = cfg["BLOCK_P"], cfg["BLOCK_Q"], cfg["BLOCK_K"]
    if tokens_contiguous:  # descriptors over the [P, M] / [Q, M] copies x and y are views of
        x_desc = TensorDescriptor(x.t(), [p, m], [m, 1], [bp, bk])
        y_desc = TensorDescriptor(y.t(), [q, m], [m, 1], [bq, bk])
    else:
        x_desc = TensorDescriptor(x, [m, p], [x.stride(0), 1], [bk, bp])
        y_desc = TensorDescriptor(y, [m, q], [y.stride(0), 1], [bk, bq])
    progs = _num_programs(x.device) * cfg.pop("PROGS_PER_SM", 1)
    # asked for in ``config``, a TMA store that does not fit stands (and fails to compile)
    if not _vk_store_fits(cfg, x.element_size(), out.element_size()) and not (config or {}).get("TMA_STORE"):
        cfg["TMA_STORE"] = False
    c_base, stride_cg = _group_order(out, reverse_groups, config, cfg, "launch_grouped_gemm_variable_k_tma")
    c_desc = _tma_store_desc(out, [1, bp, bq], config, cfg, "launch_grouped_gemm_variable_k_tma")
    launch_jit(grouped_gemm_variable_k_tma_kernel, (progs,),
        x_desc, y_desc, x, y, c_base, c_desc, group_lens,
        out if x_scale is None else x_scale, out if y_scale is None else y_scale,
        g, m, p, q, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        stride_cg, out.stride(1), out.stride(2),
        NUM_PROGS=progs, BLOCK_G=_block_g(g), SCALE_MODE=scale_mode, UPCAST=not on_gpu,
        TOKENS_CONTIGUOUS=tokens_contiguous, ACCUMULATE=accumulate, **cfg,
    )  # fmt: skip
    return out


__all__ += ["SCALE_TENSORWISE", "FWD_TILE", "VK_TILE", "VK_TILE_SMALL", "VK_SMALL_OUTPUT"]
__all__ += ["HALF_FWD_TILE", "HALF_VK_TILE", "HALF_VK_TILE_SMALL"]
