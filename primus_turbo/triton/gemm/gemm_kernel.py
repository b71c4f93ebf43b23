"""Persistent bf16/fp16/fp32 GEMM kernels for Hopper (sm_90): C[M, N] = A[M, K] @ B[K, N].

Three variants of one algorithm, all persistent (grid = min(#SMs, #tiles); each program walks the
tile list with stride #SMs) with a grouped tile order (GROUP_M row-tiles share each B column-tile
while it is hot in L2) and fp32 accumulation, the output dtype cast in the epilogue:

* ``gemm_tma_persistent_kernel``: A, B and C move through TMA (host-side ``TensorDescriptor``s,
  present in Triton 3.6 and 3.7 and run by the 3.7 interpreter). Loads are asynchronous bulk copies
  into swizzled shared memory feeding wgmma; out-of-bounds rows/columns/K are zero-filled by the
  hardware, so M, N and K need no masks. Preconditions (checked by the launcher, which otherwise
  picks the pointer kernel): fp16/bf16 operands, every operand's inner stride 1, the other stride
  and the base 16-byte aligned. Each operand may be K-major or M/N-major (the four NN/NT/TN/TT
  layouts): an M/N-major tile is loaded as [BLOCK_K, BLOCK_M] and transposed in shared memory,
  which wgmma reads directly for 16-bit types (no copy).
* ``gemm_tma_device_persistent_kernel``: the same tile loop (``_tma_tiles``) with its three descriptors
  made in the kernel (``tl.make_tensor_descriptor``, once per program, in Triton's global scratch from
  the allocator ``ensure_scratch_allocator`` sets): the host passes pointers and strides. Building and
  encoding three host descriptors per launch cost ~40 us of Python per call on the H200 hosts (session
  33: ``gemm_triton`` 75 us per call against 35 us for the pointer kernel, at 1024^3), against ~95 us of
  GPU time for a 8192 x 2048 x 2048 GEMM; ``gemm_triton``'s default where the TMA preconditions hold.
* ``gemm_persistent_kernel``: plain pointer loads with masks; any strides, any alignment, fp32
  (``INPUT_PRECISION`` "ieee" or "tf32"). The fallback for odd alignments and fp32.

Tile choices (sm_90: 132 SMs on H100 SXM/H200, 227 KB shared memory per CTA, 64K regs/SM):
128x256x64 with 8 warps is the CUTLASS "cooperative" shape: two warpgroups each own a 64x256 fp32
accumulator (128 regs/thread); its 48 KB/stage ring fits 3-4 stages next to a 32 KB subtiled
epilogue buffer. Shared memory per config as compiled for sm_90 by Triton 3.7 (test_gemm.py checks
every config fits): 180 / 229 / 180 / 164 / 229 KB for TMA_CONFIGS in order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from primus_turbo.triton.autotune_cache import configure as configure_autotune_cache
from primus_turbo.triton.launch import launch_autotuned

SMEM_BYTES_SM90 = 227 * 1024


# --------------------------------------------------------------------------------------------
# TMA persistent kernel
# --------------------------------------------------------------------------------------------
def _tma_config(bm, bn, bk, warps, stages, subtile):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "EPILOGUE_SUBTILE": subtile},
        num_warps=warps,
        num_stages=stages,
        pre_hook=set_tma_block_shapes,
    )


def set_tma_block_shapes(nargs):
    """Autotune pre-hook: the descriptors' box shapes follow the config being launched."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk] if nargs["A_K_MAJOR"] else [bk, bm]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_K_MAJOR"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn // 2] if nargs["EPILOGUE_SUBTILE"] else [bm, bn]


TMA_CONFIGS = [
    # cooperative 2-warpgroup tile; 3x48 KB ring + 32 KB subtiled epilogue buffer: the big-shape pick
    _tma_config(128, 256, 64, 8, 3, True),
    # same tile, 4 stages: deeper prefetch when K is long (4x48 KB + 32 KB = 224 KB, just fits)
    _tma_config(128, 256, 64, 8, 4, True),
    # M-heavy mirror of the above for N <= 2048 (fewer column tiles, better wave fill)
    _tma_config(256, 128, 64, 8, 3, True),
    # one-warpgroup 128x128 tile, 4 stages (4x32 KB + 32 KB epilogue): 2x the tiles of 128x256 for
    # small/medium problems where 128x256 leaves SMs idle in the last wave
    _tma_config(128, 128, 64, 4, 4, False),
    # 128x128 with 8 warps and BLOCK_K 128: halves the K-loop trip count on long K
    _tma_config(128, 128, 128, 8, 3, False),
]
# The same tiles for the kernel that makes its descriptors on the device (no box shapes to set on the host)
TMA_DEVICE_CONFIGS = [
    triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=c.num_stages) for c in TMA_CONFIGS
]


@triton.jit
def _tma_tiles(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    A_K_MAJOR: tl.constexpr,
    B_K_MAJOR: tl.constexpr,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
):
    """The persistent tile loop of both TMA kernels (descriptors made on the host or in the kernel)."""
    out_dtype = c_desc.dtype
    start_pid = tl.program_id(axis=0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    num_tiles = num_pid_m * num_pid_n
    # A separate epilogue tile counter keeps the flattened (tile x K) loop's prologue and
    # epilogue independent, which is what lets the pipeliner overlap them.
    tile_id_c = start_pid - NUM_SMS

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        # grouped order: GROUP_M row-tiles walk the columns together (B tiles reused from L2)
        group_id = tile_id // (GROUP_M * num_pid_n)
        group_size_m = min(num_pid_m - group_id * GROUP_M, GROUP_M)
        pid_m = group_id * GROUP_M + (tile_id % group_size_m)
        pid_n = (tile_id % (GROUP_M * num_pid_n)) // group_size_m
        offs_m = pid_m * BLOCK_M
        offs_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            offs_k = ki * BLOCK_K
            if A_K_MAJOR:
                a = a_desc.load([offs_m, offs_k])
            else:
                a = a_desc.load([offs_k, offs_m]).T
            if B_K_MAJOR:
                b = b_desc.load([offs_n, offs_k]).T
            else:
                b = b_desc.load([offs_k, offs_n])
            acc = tl.dot(a, b, acc)

        tile_id_c += NUM_SMS
        group_id = tile_id_c // (GROUP_M * num_pid_n)
        group_size_m = min(num_pid_m - group_id * GROUP_M, GROUP_M)
        pid_m = group_id * GROUP_M + (tile_id_c % group_size_m)
        pid_n = (tile_id_c % (GROUP_M * num_pid_n)) // group_size_m
        offs_cm = pid_m * BLOCK_M
        offs_cn = pid_n * BLOCK_N
        if EPILOGUE_SUBTILE:
            # Two half-width stores halve the epilogue's shared-memory buffer (frees a stage).
            acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            acc0, acc1 = tl.split(acc)
            c_desc.store([offs_cm, offs_cn], acc0.to(out_dtype))
            c_desc.store([offs_cm, offs_cn + BLOCK_N // 2], acc1.to(out_dtype))
        else:
            c_desc.store([offs_cm, offs_cn], acc.to(out_dtype))


@configure_autotune_cache
@triton.autotune(configs=TMA_CONFIGS, key=["M", "N", "K", "A_K_MAJOR", "B_K_MAJOR"])
@triton.jit
def gemm_tma_persistent_kernel(
    a_desc,
    b_desc,
    c_desc,
    M,
    N,
    K,
    A_K_MAJOR: tl.constexpr,  # A stored [M, K] (True) or [K, M] (False)
    B_K_MAJOR: tl.constexpr,  # B stored [N, K] (True) or [K, N] (False)
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
):
    _tma_tiles(a_desc, b_desc, c_desc, M, N, K, A_K_MAJOR, B_K_MAJOR, NUM_SMS,
               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE_SUBTILE)  # fmt: skip


@configure_autotune_cache
@triton.autotune(configs=TMA_DEVICE_CONFIGS, key=["M", "N", "K", "A_K_MAJOR", "B_K_MAJOR"])
@triton.jit
def gemm_tma_device_persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_a,  # the row stride of each operand's storage (its other stride is 1)
    stride_b,
    stride_c,
    A_K_MAJOR: tl.constexpr,  # A stored [M, K] (True) or [K, M] (False)
    B_K_MAJOR: tl.constexpr,  # B stored [N, K] (True) or [K, N] (False)
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
):
    """The TMA kernel with its descriptors made on the device (once per program, in Triton's global
    scratch): the host passes pointers and strides, as to the pointer kernel, instead of building and
    encoding three host descriptors per launch (~40 us of Python per call on the H200 hosts)."""
    if A_K_MAJOR:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_a, 1], [BLOCK_M, BLOCK_K])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, [K, M], [stride_a, 1], [BLOCK_K, BLOCK_M])
    if B_K_MAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_b, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_b, 1], [BLOCK_K, BLOCK_N])
    if EPILOGUE_SUBTILE:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_c, 1], [BLOCK_M, BLOCK_N // 2])
    else:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_c, 1], [BLOCK_M, BLOCK_N])
    _tma_tiles(a_desc, b_desc, c_desc, M, N, K, A_K_MAJOR, B_K_MAJOR, NUM_SMS,
               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EPILOGUE_SUBTILE)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Pointer persistent kernel (any strides/alignment, fp32)
# --------------------------------------------------------------------------------------------
def _ptr_config(bm, bn, bk, warps, stages):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages
    )


PTR_CONFIGS = [
    # 16-bit big tile: same cooperative shape as the TMA kernel (3 x 48 KB)
    _ptr_config(128, 256, 64, 8, 3),
    # 16-bit medium tile with a deeper ring (4 x 32 KB)
    _ptr_config(128, 128, 64, 4, 4),
    # fp32-friendly: 3 x 32 KB at 4 bytes/element
    _ptr_config(128, 128, 32, 8, 3),
    # small problems / skinny M: more programs in flight
    _ptr_config(64, 128, 32, 4, 4),
]


def prune_ptr_configs(configs, nargs, **kwargs):
    """Drop configs whose operand ring would not fit shared memory at this element size."""
    elem = nargs["a_ptr"].element_size()
    fits = [
        c
        for c in configs
        if c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"] * elem
        <= SMEM_BYTES_SM90 - 32 * 1024
    ]
    return fits or configs[-1:]


@configure_autotune_cache
@triton.autotune(
    configs=PTR_CONFIGS,
    key=["M", "N", "K", "stride_am", "stride_ak", "stride_bk", "stride_bn"],
    prune_configs_by={"early_config_prune": prune_ptr_configs},
)
@triton.jit
def gemm_persistent_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    NUM_SMS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" (exact fp32) or "tf32"; ignored for 16-bit inputs
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    start_pid = tl.program_id(axis=0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    num_tiles = num_pid_m * num_pid_n
    tile_id_c = start_pid - NUM_SMS
    offs_k_base = tl.arange(0, BLOCK_K).to(tl.int64)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=True):
        # grouped order: GROUP_M row-tiles walk the columns together (B tiles reused from L2)
        group_id = tile_id // (GROUP_M * num_pid_n)
        group_size_m = min(num_pid_m - group_id * GROUP_M, GROUP_M)
        pid_m = group_id * GROUP_M + (tile_id % group_size_m)
        pid_n = (tile_id % (GROUP_M * num_pid_n)) // group_size_m
        offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Clamp out-of-range rows/cols to row 0 instead of masking: loads stay unmasked in M/N and
        # the epilogue store mask drops the garbage.
        # int64: offsets times strides pass 2^31 elements for operands that large (e.g. an LM head's logits)
        offs_am = tl.where(offs_am < M, offs_am, 0).to(tl.int64)
        offs_bn = tl.where(offs_bn < N, offs_bn, 0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            offs_k = ki * BLOCK_K + offs_k_base
            a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < K, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        tile_id_c += NUM_SMS
        group_id = tile_id_c // (GROUP_M * num_pid_n)
        group_size_m = min(num_pid_m - group_id * GROUP_M, GROUP_M)
        pid_m = group_id * GROUP_M + (tile_id_c % group_size_m)
        pid_n = (tile_id_c % (GROUP_M * num_pid_n)) // group_size_m
        offs_cm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_cn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        c_ptrs = c_ptr + offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# --------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------
_TMA_DTYPES = (torch.float16, torch.bfloat16)
_NUM_SMS: dict[int, int] = {}


def num_programs_cap(device: torch.device) -> int:
    """#SMs on CUDA; 2 under the CPU interpreter so each program walks several tiles."""
    if device.type != "cuda":
        return 2
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


@functools.cache
def _has_tma(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _aligned16(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _tma_storage(x: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, bool] | None:
    """The 2-D storage view a TMA descriptor can describe for logical operand ``x``, and whether it
    is K-major. ``k_dim`` is the logical K dimension of ``x`` (1 for A[M, K], 0 for B[K, N])."""
    if x.dtype not in _TMA_DTYPES or not _aligned16(x):
        return None
    elem = x.element_size()
    other = 1 - k_dim
    if x.stride(k_dim) == 1 and (x.stride(other) * elem) % 16 == 0:
        return (x if k_dim == 1 else x.T), True
    if x.stride(other) == 1 and (x.stride(k_dim) * elem) % 16 == 0:
        return (x.T if k_dim == 1 else x), False
    return None


def _tma_operands(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype):
    """(A storage, A K-major, B storage, B K-major) when the TMA kernels' alignment/dtype preconditions
    hold for logical A[M, K] @ B[K, N] (and an ``out_dtype`` output of N columns), else None."""
    if a.dtype != b.dtype:
        return None
    if a.device.type == "cuda":
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        if not _has_tma(index):
            return None  # pre-Hopper: no TMA, the pointer kernel serves
    if (b.shape[1] * (torch.finfo(out_dtype).bits // 8)) % 16 != 0:
        return None
    a_storage = _tma_storage(a, 1)
    b_storage = _tma_storage(b, 0) if a_storage is not None else None
    if b_storage is None:
        return None
    return a_storage + b_storage


def tma_supported(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """True when the TMA kernels' alignment/dtype preconditions hold for logical A[M,K] @ B[K,N]."""
    return _tma_operands(a, b, out_dtype) is not None


def persistent_grid(cap: int, M: int, N: int):
    """The launch grid of a persistent GEMM: one program per output tile, at most ``cap`` (the SMs)."""
    return lambda meta: (min(cap, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)


def _launch_tma(a, b, c, operands, config: triton.Config | None) -> None:
    """Host descriptors (``TensorDescriptor``), their boxes set per config by ``set_tma_block_shapes``."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = a.shape
    N = b.shape[1]
    a_view, a_k_major, b_view, b_k_major = operands

    def desc(view):  # box shape is set per config by set_tma_block_shapes
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [16, 16])

    cap = num_programs_cap(a.device)
    args = {"a_desc": desc(a_view), "b_desc": desc(b_view), "c_desc": desc(c), "M": M, "N": N, "K": K,
            "A_K_MAJOR": a_k_major, "B_K_MAJOR": b_k_major, "NUM_SMS": cap}  # fmt: skip
    if config is None:
        launch_autotuned(gemm_tma_persistent_kernel, persistent_grid(cap, M, N), args)
        return
    set_tma_block_shapes({**args, **config.kwargs})
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    gemm_tma_persistent_kernel.fn[persistent_grid(cap, M, N)](**args, **config.kwargs, **options)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Kernels that make TMA descriptors on the device keep them in Triton's global scratch, which Triton
    asks of the allocator set with ``triton.set_allocator``: a context variable, so unset on a new thread
    (autograd runs CUDA backwards on its own). Sets a torch allocator where none is set; keeps the user's."""
    current = _allocation._allocator  # a ContextVar in Triton 3.6 and 3.7
    current = current.get() if hasattr(current, "get") else current
    if isinstance(current, _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _launch_tma_device(a, b, c, operands, config: triton.Config | None) -> None:
    """Descriptors made in the kernel from pointers and strides (no host ``TensorDescriptor``)."""
    M, K = a.shape
    N = b.shape[1]
    a_view, a_k_major, b_view, b_k_major = operands
    cap = num_programs_cap(a.device)
    if a.device.type == "cuda":
        ensure_scratch_allocator()
    args = {"a_ptr": a_view, "b_ptr": b_view, "c_ptr": c, "M": M, "N": N, "K": K,
            "stride_a": a_view.stride(0), "stride_b": b_view.stride(0), "stride_c": c.stride(0),
            "A_K_MAJOR": a_k_major, "B_K_MAJOR": b_k_major, "NUM_SMS": cap}  # fmt: skip
    if config is None:
        launch_autotuned(gemm_tma_device_persistent_kernel, persistent_grid(cap, M, N), args)
        return
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    gemm_tma_device_persistent_kernel.fn[persistent_grid(cap, M, N)](**args, **config.kwargs, **options)


def _launch_pointer(a, b, c, config: triton.Config | None) -> None:
    M, K = a.shape
    N = b.shape[1]
    cap = num_programs_cap(a.device)
    grid = persistent_grid(cap, M, N)
    exact_fp32 = a.device.type != "cuda" or not torch.backends.cuda.matmul.allow_tf32
    precision = "ieee" if (a.dtype == torch.float32 and exact_fp32) else "tf32"
    strides = {"stride_am": a.stride(0), "stride_ak": a.stride(1), "stride_bk": b.stride(0),
               "stride_bn": b.stride(1), "stride_cm": c.stride(0), "stride_cn": c.stride(1)}  # fmt: skip
    args = {"a_ptr": a, "b_ptr": b, "c_ptr": c, "M": M, "N": N, "K": K, **strides,
            "NUM_SMS": cap, "INPUT_PRECISION": precision}  # fmt: skip
    if config is None:
        launch_autotuned(gemm_persistent_kernel, grid, args)
        return
    gemm_persistent_kernel.fn[grid](**args, **config.kwargs, num_warps=config.num_warps,
                                     num_stages=config.num_stages)  # fmt: skip


VARIANTS = ("tma_device", "tma", "pointer")


def gemm_triton(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    variant: str | None = None,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """C[M, N] = a[M, K] @ b[K, N] with any strides (pass transposed views for NT/TN/TT).

    ``variant``: None picks the TMA kernel with device-made descriptors when the TMA preconditions hold,
    else the pointer kernel; "tma_device", "tma" (host descriptors) or "pointer" forces one (tests,
    benchmarks). ``config``: run one ``triton.Config`` instead of autotuning.
    """
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"gemm_triton: variant must be None or one of {VARIANTS}, got {variant!r}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    operands = _tma_operands(a, b, out_dtype)
    if variant in ("tma", "tma_device") and operands is None:
        raise ValueError(
            f"gemm_triton: the TMA kernel needs fp16/bf16 operands with one unit stride and 16-byte aligned "
            f"base and other stride, and N*sizeof(out) % 16 == 0; got a {tuple(a.shape)} stride "
            f"{a.stride()} {a.dtype}, b {tuple(b.shape)} stride {b.stride()}, out {out_dtype}"
        )
    if variant == "pointer" or operands is None:
        _launch_pointer(a, b, c, config)
    elif variant == "tma":
        _launch_tma(a, b, c, operands, config)
    else:
        _launch_tma_device(a, b, c, operands, config)
    return c
