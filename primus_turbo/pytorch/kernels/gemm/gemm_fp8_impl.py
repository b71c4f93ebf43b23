"""FP8 GEMM backends and dispatcher behind ``torch.ops.primus_turbo.gemm_fp8``.

Canonical problem (the ops layer prepares the operands): ``C[M, N] = A[M, K] @ B[N, K]^T`` with
A and B FP8, row-major (K-major), and dequantization scales ``a_s``/``b_s`` (``scale_inv`` from the
quantizer) in one of four modes (see primus_turbo/triton/gemm/gemm_fp8_kernel.py):

    0 TENSORWISE   a_s ()           b_s ()
    1 ROWWISE      a_s (M, 1)       b_s (N, 1)
    2 BLOCKWISE    a_s (M, K/bs)    b_s (N/bs, K/bs)    activations 1 x bs, weights bs x bs
    3 BLOCKWISE    a_s (M, K/bs)    b_s (N, K/bs)       1 x bs both (wgrad)

Backends: ``CUBLAS`` (cuBLASLt; CUDA only), ``TRITON`` (persistent Hopper kernel; every
mode, any M/N/K, E4M3/E5M2 mixes), ``TORCH`` (dequantize + fp32 matmul; the CPU default).
Dispatcher op name "gemm" with precision "fp8", so ``PRIMUS_TURBO_GEMM_BACKEND=fp8:TRITON`` or
``GlobalBackendManager.set_gemm_backend("TRITON", precision="fp8")`` pin it.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION, cpp_ops
from primus_turbo.pytorch.core.utils import triton_can_run_on

__all__ = ["GemmFP8Dispatcher", "gemm_fp8_impl", "dequantize_operand", "HAS_CUBLASLT_PLANS"]

E4M3 = torch.float8_e4m3fn
# The csrc cached-plan cuBLASLt op (csrc/kernels/gemm/gemm_fp8_cublaslt.cu); absent when the extension
# was built without cublasLt.h.
HAS_CUBLASLT_PLANS = HAS_CPP_EXTENSION and hasattr(cpp_ops(), "gemm_fp8_cublaslt")


def dequantize_operand(x: torch.Tensor, s: torch.Tensor, mode: int, block: int, is_b: bool) -> torch.Tensor:
    """fp32 values of a canonical operand ([rows, K] with its scale in ``mode``)."""
    x = x.float()
    if mode in (0, 1):
        return x * s.float()
    rows, k = x.shape
    s = s.float().repeat_interleave(block, dim=1)[:, :k]
    if is_b and mode == 2:
        s = s.repeat_interleave(block, dim=0)[:rows]
    return x * s


class GemmFP8TorchBackend(KernelBackend):
    """Reference: dequantize both operands to fp32 and matmul."""

    @staticmethod
    def can_handle(**_) -> bool:
        return True

    @staticmethod
    def execute(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, **_) -> torch.Tensor:
        a32 = dequantize_operand(a, a_s, scale_mode, scale_block, False)
        b32 = dequantize_operand(b, b_s, scale_mode, scale_block, True)
        return (a32 @ b32.t()).to(out_dtype)


class GemmFP8CublasBackend(KernelBackend):
    """cuBLASLt. Needs K, N multiples of 16 (b is passed column-major), E4M3 for rowwise and blockwise,
    bf16 output for rowwise, and for blockwise bs=128, K % 128 == 0 (and K % 512 == 0 with 128x128
    weight scales: torch versions differ on that scale's row stride).

    Tensor-wise and row-wise go through the csrc op ``gemm_fp8_cublaslt``, which caches descriptor,
    layouts and algorithm per problem, where torch._scaled_mm asks cuBLASLt's heuristic on every call
    (same kernels; H100, tight loop at M=1024 N=K=2048: 15-21 us of host per call vs 19-28 us).
    Blockwise, a build without the op, and problems the op declines (asked once, cached) use
    torch._scaled_mm."""

    @staticmethod
    def can_handle(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, **_) -> bool:
        if not (a.is_cuda and b.is_cuda and hasattr(torch, "_scaled_mm")):
            return False
        m, k = a.shape
        n = b.shape[0]
        if m == 0 or n == 0 or k == 0 or k % 16 or n % 16:
            return False
        if scale_mode == 0:
            return not (a.dtype != E4M3 and b.dtype != E4M3)  # e5m2 x e5m2 is not a cuBLAS kernel
        if b.dtype != E4M3:
            return False
        if scale_mode == 1:
            ok = out_dtype == torch.bfloat16
        else:
            ok = scale_block == 128 and k % 128 == 0 and (scale_mode == 3 or (k % 512 == 0 and n % 128 == 0))
        # E5M2 x E4M3 (every HYBRID dgrad/wgrad: the gradient is the first operand): torch's sm90
        # rowwise CUTLASS kernel takes it, blockwise depends on the torch/cuBLAS build: probe once.
        return ok and (a.dtype == E4M3 or _e5m2_a_supported(scale_mode, a.device))

    @staticmethod
    def execute(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum=False, **_) -> torch.Tensor:
        # Fast (FP8-internal) accumulation only for tensorwise forward GEMMs, as Transformer Engine
        # does; gradients and the scaled recipes keep cuBLAS's split fp32 accumulation.
        fast = bool(fast_accum) and scale_mode == 0
        if scale_mode <= 1 and HAS_CUBLASLT_PLANS:
            out, supported = cpp_ops().gemm_fp8_cublaslt(a, a_s, b, b_s, scale_mode, out_dtype, fast)
            if supported:
                return out
        a = a.contiguous()
        b_cm = b.contiguous().t()  # [K, N] column-major
        if scale_mode == 0:
            sa, sb = a_s.reshape(()).float(), b_s.reshape(()).float()
        elif scale_mode == 1:
            sa, sb = a_s.reshape(-1, 1).float().contiguous(), b_s.reshape(1, -1).float().contiguous()
        else:
            sa = a_s.t().contiguous().t()  # (M, K/128) column-major
            sb = b_s.contiguous().t() if scale_mode == 2 else b_s.t().contiguous()
        return torch._scaled_mm(a, b_cm, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast)


_E5M2_A_SUPPORT: dict[tuple[int, int | None], bool] = {}


def _e5m2_a_supported(scale_mode: int, device: torch.device) -> bool:
    """Whether torch._scaled_mm runs an E5M2 x E4M3 GEMM in ``scale_mode`` here, and correctly.

    Probed once per (mode, device) on a 128x128x512 problem against the dequantized reference (one
    host sync per process, not per call). Never probed during CUDA graph capture (answers False)."""
    key = (scale_mode, device.index)
    if key in _E5M2_A_SUPPORT:
        return _E5M2_A_SUPPORT[key]
    if torch.cuda.is_current_stream_capturing():
        return False
    m = n = 128
    k = 512
    a = (torch.randn(m, k, device=device) * 8).to(torch.float8_e5m2)
    b = (torch.randn(n, k, device=device) * 8).to(E4M3)
    scale_cols = 1 if scale_mode == 1 else k // 128
    a_s = torch.rand(m, scale_cols, device=device) + 0.5
    b_s = torch.rand(n // 128 if scale_mode == 2 else n, scale_cols, device=device) + 0.5
    try:
        out = GemmFP8CublasBackend.execute(a, a_s, b, b_s, scale_mode, 128, torch.bfloat16).float()
        ref = GemmFP8TorchBackend.execute(a, a_s, b, b_s, scale_mode, 128, torch.float32)
        ok = bool(((out - ref).norm() <= 1e-2 * ref.norm()).item())
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        ok = False
    _E5M2_A_SUPPORT[key] = ok
    return ok


class GemmFP8TritonBackend(KernelBackend):
    @staticmethod
    def can_handle(a, b, **_) -> bool:
        return triton_can_run_on(a, b)

    @staticmethod
    def execute(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, **_) -> torch.Tensor:
        from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

        return gemm_fp8_triton(a, a_s, b, b_s, scale_mode, scale_block, out_dtype)


class GemmFP8Dispatcher(AutoKernelDispatcher):
    op_name = "gemm"
    cache_default = True  # every can_handle above reads only make_key's fields (device included)
    backends = {
        BackendType.CUBLAS: GemmFP8CublasBackend,
        BackendType.TRITON: GemmFP8TritonBackend,
        BackendType.TORCH: GemmFP8TorchBackend,
    }

    @classmethod
    def precision(cls, **_) -> str:
        return "fp8"

    @classmethod
    def make_key(cls, a, b, scale_mode, scale_block, out_dtype, **_) -> tuple:
        return (*a.shape, b.shape[0], a.dtype, b.dtype, scale_mode, scale_block, out_dtype, a.device)

    @classmethod
    def default_backend(cls, a, scale_mode=None, **kw) -> BackendType:
        # Rowwise: TRITON. H200, session 34 (benchmark/results/h200/tests_s34/): the full bench_gemm_fp8 sweep
        # (6 shapes): fwd with quantization 1.00-1.10x cuBLAS, bwd 1.00-1.08x, GEMM alone 1.04-1.09x;
        # Megatron llama3_8b_fp8 step 701.6 / 704.0 ms vs 727.9 / 726.6 (ABBA, -3.4%); deepseek_moe_fp8 within
        # its run-to-run noise. The first step pays the Triton autotune once (+4-22 s). Tensorwise (~1280
        # TFLOP/s) and 1x128 / 128x128 blockwise (1198; TRITON 0.5-0.7x there): cuBLAS. TRITON also serves
        # whatever cuBLAS cannot (E5M2 x E5M2, odd sizes).
        if not a.is_cuda:
            return BackendType.TORCH
        if scale_mode == 1 and GemmFP8TritonBackend.can_handle(a=a, **kw):
            return BackendType.TRITON
        if GemmFP8CublasBackend.can_handle(a=a, scale_mode=scale_mode, **kw):
            return BackendType.CUBLAS
        return BackendType.TRITON


def gemm_fp8_impl(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    scale_mode: int,
    scale_block: int,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """C[M, N] = A[M, K] @ B[N, K]^T with FP8 operands through the dispatcher (inputs pre-validated).

    ``fast_accum``: allow cuBLAS's faster FP8 accumulation (tensorwise forward only).

    Eager calls go straight to the dispatcher: the ``torch.library`` custom-op layer costs ~50-100 us
    of host time per call (schema checks, autograd/ADInplaceOrView redispatch), more than the
    tensorwise GEMM's 0.11 ms at 8192x4096x4096 on an H200, so a Float8Linear step (3 GEMMs) became
    host bound. Under torch.compile the custom op (opaque, with a fake kernel) is traced instead.
    """
    if torch.compiler.is_compiling():
        return _gemm_fp8_op(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum)
    return _dispatch(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum)


def _dispatch(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum) -> torch.Tensor:
    return GemmFP8Dispatcher.dispatch(
        a=a,
        a_s=a_s,
        b=b,
        b_s=b_s,
        scale_mode=scale_mode,
        scale_block=scale_block,
        out_dtype=out_dtype,
        fast_accum=fast_accum,
    )


@torch.library.custom_op("primus_turbo::gemm_fp8", mutates_args=())
def _gemm_fp8_op(
    a: torch.Tensor,
    a_s: torch.Tensor,
    b: torch.Tensor,
    b_s: torch.Tensor,
    scale_mode: int,
    scale_block: int,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    return _dispatch(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum)


@_gemm_fp8_op.register_fake
def _gemm_fp8_fake(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
