"""RMSNorm forward / backward Triton kernels (the TRITON backend) and their launchers.

Layout: x, residual, y, dy, dx, dsum are contiguous [rows, hidden]; weight [hidden]; rstd fp32 [rows].
A program owns BLOCK_M full rows (BLOCK_N = next_pow2(hidden) columns, so one HBM read per pass),
math in fp32; forward rows of 2049-8192 columns (a 4096- or 8192-wide chunk) run
``rmsnorm_fwd_rows_kernel`` instead (one row per program, two passes, the second served by L2:
torch.compile's scheme). The backward runs a persistent grid (<= SMs x 4 programs) that strides over
row blocks and keeps the dweight partial sums in registers; partials [programs, hidden] are summed by
torch (fixed order, deterministic).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from primus_turbo.pytorch.core.utils import triton_interpret_enabled

MAX_HIDDEN = 65536  # one row per program must fit in registers (BLOCK_N <= 64K)


@triton.jit
def rmsnorm_fwd_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    sum_ptr,
    rstd_ptr,
    n_rows,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(sum_ptr.dtype.element_ty)  # normalise the rounded sum, as the unfused ops do
        tl.store(sum_ptr + offs, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def rmsnorm_fwd_rows_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    sum_ptr,
    rstd_ptr,
    eps,
    N_COLS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The forward for rows of 2049-8192 columns (CHUNK 4096 or 8192; measured at 4096, 7168 and 8192),
    torch.compile's scheme: one row per program, the row length a compile-time constant (with CHUNK =
    next_pow2(N_COLS) each pass is straight-line code), two passes: the sum of squares from loads that
    keep the row in L2 (evict_last), then the normalised row from a second read that L2 serves
    (evict_first; HBM reads x once). Few registers per row, so many rows are in flight per SM: 1.00x
    torch.compile's forward in GPU time at 7168 / 8192 columns where the one-pass kernel reaches 0.97-0.98x
    (benchmark/ops/sweep_rmsnorm.py, H200)."""
    row = tl.program_id(0).to(tl.int64)
    base = row * N_COLS
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in tl.range(0, N_COLS, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < N_COLS
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + base + cols, mask=mask, other=0.0, eviction_policy="evict_last")
            s = (x + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # the rounded sum, as the unfused ops
            tl.store(sum_ptr + base + cols, s, mask=mask)
            x = s.to(tl.float32)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N_COLS + eps)
    for start in tl.range(0, N_COLS, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < N_COLS
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + base + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            x = (x + r.to(tl.float32)).to(sum_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        tl.store(y_ptr + base + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rmsnorm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dsum_ptr,
    dx_ptr,
    dw_partial_ptr,
    n_rows,
    n_cols,
    HAS_DSUM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    for block in range(pid, n_blocks, n_programs):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        w_dy = dy * w[None, :]
        mean_dot = tl.sum(x_hat * w_dy, axis=1) / n_cols
        dx = rstd[:, None] * (w_dy - x_hat * mean_dot[:, None])
        if HAS_DSUM:
            dx += tl.load(dsum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * x_hat, axis=0)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=col_mask)


def tile_config(hidden: int, rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): >= 4096 elements per program (enough bytes in flight for
    short rows), ~16 elements per thread (512 per warp) up to 32 warps."""
    block_n = triton.next_power_of_2(hidden)
    tile = max(block_n, 4096)
    block_m = min(tile // block_n, triton.next_power_of_2(max(rows, 1)))
    num_warps = min(32, max(4, (block_m * block_n) // 512))
    return block_m, block_n, num_warps


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _bwd_programs(x: torch.Tensor, n_blocks: int) -> int:
    if x.is_cuda and not triton_interpret_enabled():
        return max(1, min(n_blocks, _sm_count(x.device.index or 0) * 4))
    return max(1, min(n_blocks, 4))  # interpreter: few programs, still exercises the row-block loop


def rmsnorm_fwd_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: contiguous [rows, hidden]. Returns (y, sum or a 0-element tensor, rstd fp32)."""
    rows, hidden = x.shape
    y = torch.empty_like(x)
    sum_out = torch.empty_like(x) if residual is not None else x.new_empty(0)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    block_m, block_n, num_warps = tile_config(hidden, rows)
    if 4096 <= block_n <= 8192:
        # 2049-8192 columns (chunk 4096 / 8192): the row-per-program two-pass kernel (sweep_rmsnorm.py, H200
        # GPU time vs the one-pass kernel: 4096 columns 65.4 vs 67.2 us, 7168 57.3 vs 58.8 us, 8192 127.2
        # vs 131.3 us; 2049-4095 columns unmeasured)
        res = residual if residual is not None else x
        rmsnorm_fwd_rows_kernel[(rows,)](
            x, res, weight, y, sum_out if residual is not None else y, rstd, eps, N_COLS=hidden,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered_gamma, CHUNK=block_n,
            num_warps=16 if block_n == 8192 else 8, num_stages=1,
        )  # fmt: skip
        return y, sum_out, rstd
    rmsnorm_fwd_kernel[(triton.cdiv(rows, block_m),)](
        x,
        residual if residual is not None else x,
        weight,
        y,
        sum_out if residual is not None else y,
        rstd,
        rows,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        ZERO_CENTERED=zero_centered_gamma,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, sum_out, rstd


def rmsnorm_bwd_triton(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dsum: torch.Tensor | None,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x, dsum: contiguous [rows, hidden]. Returns (dx, dweight)."""
    rows, hidden = x.shape
    dx = torch.empty_like(x)
    block_m, block_n, num_warps = tile_config(hidden, rows)
    programs = _bwd_programs(x, triton.cdiv(rows, block_m))
    dw_partial = torch.empty(programs, hidden, device=x.device, dtype=torch.float32)
    rmsnorm_bwd_kernel[(programs,)](
        dy,
        x,
        weight,
        rstd,
        dsum if dsum is not None else dy,
        dx,
        dw_partial,
        rows,
        hidden,
        HAS_DSUM=dsum is not None,
        ZERO_CENTERED=zero_centered_gamma,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return dx, dw_partial.sum(0).to(weight.dtype)
