"""Persistent FP8 GEMM for Hopper: C[M, N] = dequant(A[M, K]) @ dequant(B[N, K])^T, fp32 accumulate.

Both operands are K-major (row-major [M, K] and [N, K]): sm_90 FP8 wgmma only reads K-major
operands, so the ops layer hands us the right quantized copy for forward, dgrad and wgrad instead
of transposing here. Scale modes (``SCALE_MODE``):

* 0 TENSORWISE: ``a_s``, ``b_s`` scalars; applied once in the epilogue.
* 1 ROWWISE: ``a_s[M]``, ``b_s[N]``; outer product applied in the epilogue.
* 2 BLOCKWISE 1 x bs (A) by bs x bs (B): per K block, ``a_s[m, kb]`` and ``b_s[n // bs, kb]``.
* 3 BLOCKWISE 1 x bs (A) by 1 x bs (B) (wgrad): per K block, ``a_s[m, kb]`` and ``b_s[n, kb]``.

Blockwise modes need ``BLOCK_K == bs``: each K step's wgmma result is scaled and added to the
fp32 accumulator in registers (the DeepGEMM "promotion"), which is also what keeps FP8's 14-bit
internal accumulation from drifting on long K.

Two load paths in one kernel: TMA descriptors (``USE_TMA``: K * 1 byte 16-byte aligned, bases
aligned; OOB rows/cols/K are zero-filled by hardware) and masked pointer loads (any K). The
persistent loop (grid = #SMs, grouped tile order, GROUP_M row tiles share a B column tile while it
is in L2) follows primus_turbo/triton/gemm/gemm_kernel.py.

Tile choice: 128x128x128 with 8 warps (2 consumer warpgroups of 64x128) and 4 stages = 4 x 32 KB
of operand ring, the shape DeepGEMM uses for 1x128 blockwise on H800; 128x256x128 (3 x 48 KB
stages) for large tensorwise/rowwise problems where epilogue-only scaling lets the bigger tile win.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from primus_turbo.env import triton_interpret_env
from primus_turbo.triton.autotune_cache import configure as configure_autotune_cache
from primus_turbo.triton.gemm.gemm_kernel import ensure_scratch_allocator, num_programs_cap, persistent_grid
from primus_turbo.triton.launch import launch_autotuned

# The CPU interpreter's fp8 tl.dot multiplies raw bits: upcast there (compiled kernels use fp8 wgmma).
_INTERPRET: tl.constexpr = tl.constexpr(triton_interpret_env())

SCALE_TENSORWISE, SCALE_ROWWISE, SCALE_BLOCK_1x128_128x128, SCALE_BLOCK_1x128_1x128 = 0, 1, 2, 3


def _config(bm, bn, bk, warps, stages):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
        num_warps=warps,
        num_stages=stages,
        pre_hook=_set_tma_blocks,
    )


def _set_tma_blocks(nargs):
    """Autotune pre-hook: TMA descriptor boxes follow the config being launched."""
    if nargs["USE_TMA"]:
        nargs["a_ptr"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
        nargs["b_ptr"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


# BLOCK_K is forced to the scale block for blockwise modes by prune_configs.
CONFIGS = [
    _config(128, 128, 128, 8, 4),
    _config(128, 256, 128, 8, 3),
    _config(64, 128, 128, 4, 4),
    _config(128, 128, 64, 4, 5),
]


# The device-descriptor kernel's configs: the same tiles without the pre-hook (its descriptors are made in the
# kernel from BLOCK_*), which also lets Triton keep its autotune choice on disk (see autotune_cache).
DEVICE_CONFIGS = [
    triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages) for c in CONFIGS
]


def _prune(configs, nargs, fallback, **kwargs):
    args = {**kwargs, **nargs}  # constexprs arrive in nargs or kwargs depending on the Triton version
    block = args["SCALE_BLOCK"]
    blockwise = args["SCALE_MODE"] >= SCALE_BLOCK_1x128_128x128
    kept = [c for c in configs if not blockwise or c.kwargs["BLOCK_K"] == block]
    if not kept:
        kept = [fallback(128, 128, block, 8, 3)]
    return kept


def prune_configs(configs, nargs, **kwargs):
    return _prune(configs, nargs, _config, **kwargs)


def _device_config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                         num_stages=stages)  # fmt: skip


def prune_device_configs(configs, nargs, **kwargs):
    return _prune(configs, nargs, _device_config, **kwargs)


@triton.jit
def _dot(a, b, acc):
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group_id = tile_id // (GROUP_M * num_pid_n)
    group_size_m = min(num_pid_m - group_id * GROUP_M, GROUP_M)
    pid_m = group_id * GROUP_M + (tile_id % group_size_m)
    pid_n = (tile_id % (GROUP_M * num_pid_n)) // group_size_m
    return pid_m, pid_n


@triton.jit
def _fp8_tiles(
    a_src,
    b_src,
    c_ptr,
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    SCALE_MODE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The persistent tile loop of both kernels: ``a_src`` / ``b_src`` are TMA descriptors (host- or
    device-made) when ``USE_TMA``, else pointers."""
    start_pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    offs_k0 = tl.arange(0, BLOCK_K)
    if SCALE_MODE == 0:
        tensor_scale = tl.load(a_s_ptr) * tl.load(b_s_ptr)

    # flatten=True software-pipelines across tiles (next tile's loads overlap this epilogue); a
    # separate epilogue tile counter keeps prologue and epilogue independent, as in gemm_kernel.py.
    tile_id_c = start_pid - NUM_SMS
    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # clamp out-of-range rows to row 0: loads stay unmasked in M/N, the store mask drops them
        rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            if USE_TMA:
                a = a_src.load([pid_m * BLOCK_M, k0])
                b = b_src.load([pid_n * BLOCK_N, k0])
            else:
                offs_k = k0 + offs_k0
                k_mask = offs_k[None, :] < K
                a = tl.load(a_src + rows_a[:, None] * stride_am + offs_k[None, :], mask=k_mask, other=0.0)
                b = tl.load(b_src + rows_b[:, None] * stride_bn + offs_k[None, :], mask=k_mask, other=0.0)
            if SCALE_MODE >= 2:
                a_s = tl.load(a_s_ptr + rows_a * stride_asm + ki * stride_ask)
                if SCALE_MODE == 2:
                    b_s = tl.load(b_s_ptr + (rows_b // SCALE_BLOCK) * stride_bsn + ki * stride_bsk)
                else:
                    b_s = tl.load(b_s_ptr + rows_b * stride_bsn + ki * stride_bsk)
                part = _dot(a, tl.trans(b), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
                acc += part * (a_s[:, None] * b_s[None, :])
            else:
                acc = _dot(a, tl.trans(b), acc)
        tile_id_c += NUM_SMS
        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows_a = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
        rows_b = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
        if SCALE_MODE == 0:
            acc = acc * tensor_scale
        elif SCALE_MODE == 1:
            a_s = tl.load(a_s_ptr + rows_a * stride_asm)
            b_s = tl.load(b_s_ptr + rows_b * stride_bsn)
            acc = acc * a_s[:, None] * b_s[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@configure_autotune_cache  # off: the host TMA configs carry a pre_hook (see autotune_cache)
@triton.autotune(
    configs=CONFIGS,
    key=["M", "N", "K", "SCALE_MODE", "SCALE_BLOCK", "USE_TMA"],
    prune_configs_by={"early_config_prune": prune_configs},
)
@triton.jit
def gemm_fp8_persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_s_ptr,
    b_s_ptr,  # a_ptr/b_ptr are host TMA descriptors when USE_TMA
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    SCALE_MODE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    _fp8_tiles(a_ptr, b_ptr, c_ptr, a_s_ptr, b_s_ptr, M, N, K, stride_am, stride_bn, stride_cm, stride_asm,
               stride_ask, stride_bsn, stride_bsk, SCALE_MODE, SCALE_BLOCK, USE_TMA, NUM_SMS, BLOCK_M,
               BLOCK_N, BLOCK_K, GROUP_M)  # fmt: skip


@configure_autotune_cache
@triton.autotune(
    configs=DEVICE_CONFIGS,
    key=["M", "N", "K", "SCALE_MODE", "SCALE_BLOCK"],
    prune_configs_by={"early_config_prune": prune_device_configs},
)
@triton.jit
def gemm_fp8_tma_device_persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    a_s_ptr,
    b_s_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_ask,
    stride_bsn,
    stride_bsk,
    SCALE_MODE: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The TMA path with its two descriptors made on the device (once per program, in Triton's global
    scratch) instead of by the host per launch: no pre-hook, so its autotune choice can be kept on disk."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
    _fp8_tiles(a_desc, b_desc, c_ptr, a_s_ptr, b_s_ptr, M, N, K, stride_am, stride_bn, stride_cm, stride_asm,
               stride_ask, stride_bsn, stride_bsk, SCALE_MODE, SCALE_BLOCK, True, NUM_SMS, BLOCK_M, BLOCK_N,
               BLOCK_K, GROUP_M)  # fmt: skip


def _tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_cuda
        and a.shape[1] % 16 == 0
        and a.stride(0) % 16 == 0
        and b.stride(0) % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
        and a.stride(1) == 1
        and b.stride(1) == 1
    )


VARIANTS = ("tma_device", "tma", "pointer")
ENV_TMA = "PRIMUS_TURBO_FP8_TRITON_TMA"


def _default_tma_variant() -> str:
    """``PRIMUS_TURBO_FP8_TRITON_TMA``: ``host`` (default: descriptors built per launch, the kernel timed in
    sessions 26-34) or ``device`` (made in the kernel; its autotune choice is kept on disk). Read at
    import."""
    raw = os.environ.get(ENV_TMA, "host").strip().lower() or "host"
    if raw not in ("host", "device"):
        raise ValueError(f"{ENV_TMA}: expected 'host' or 'device', got {raw!r}")
    return "tma" if raw == "host" else "tma_device"


DEFAULT_TMA_VARIANT = _default_tma_variant()


def gemm_fp8_triton(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    scale_mode: int,
    scale_block: int,
    out_dtype: torch.dtype,
    variant: str | None = None,
) -> torch.Tensor:
    """a [M, K], b [N, K] FP8 row-major (K-major); scales as in the module docstring (2-D scale
    tensors may have any strides: 1 x bs scales are column-major as cuBLAS wants them).

    ``variant``: None takes the TMA path (``DEFAULT_TMA_VARIANT``) where its preconditions hold (CUDA,
    K % 16 == 0, 16-byte aligned bases and row strides), else the pointer loads; ``"tma"`` (host
    descriptors), ``"tma_device"`` (descriptors made in the kernel) or ``"pointer"`` forces one."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"gemm_fp8_triton: variant must be None or one of {VARIANTS}, got {variant!r}")
    M, K = a.shape
    N = b.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    a = a if a.stride(1) == 1 else a.contiguous()
    b = b if b.stride(1) == 1 else b.contiguous()
    if variant is None:
        variant = DEFAULT_TMA_VARIANT if _tma_ok(a, b) else "pointer"
    as2 = a_s.reshape(-1, 1) if a_s.dim() < 2 else a_s
    bs2 = b_s.reshape(-1, 1) if b_s.dim() < 2 else b_s
    cap = num_programs_cap(a.device)
    grid = persistent_grid(cap, M, N)
    args = {"a_ptr": a, "b_ptr": b, "c_ptr": c, "a_s_ptr": a_s, "b_s_ptr": b_s, "M": M, "N": N,
            "K": K, "stride_am": a.stride(0), "stride_bn": b.stride(0), "stride_cm": c.stride(0),
            "stride_asm": as2.stride(0), "stride_ask": as2.stride(1), "stride_bsn": bs2.stride(0),
            "stride_bsk": bs2.stride(1), "SCALE_MODE": scale_mode, "SCALE_BLOCK": scale_block}  # fmt: skip
    if variant == "tma_device":
        if a.is_cuda:
            ensure_scratch_allocator()
        launch_autotuned(gemm_fp8_tma_device_persistent_kernel, grid, {**args, "NUM_SMS": cap})
        return c
    if variant == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        args["a_ptr"] = TensorDescriptor(a, list(a.shape), list(a.stride()), [16, 16])
        args["b_ptr"] = TensorDescriptor(b, list(b.shape), list(b.stride()), [16, 16])
    launch_autotuned(gemm_fp8_persistent_kernel, grid, {**args, "USE_TMA": variant == "tma", "NUM_SMS": cap})
    return c
