"""FP8 GEMM backends and dispatcher behind ``torch.ops.primus_turbo.gemm_fp8``.

Canonical problem (the ops layer prepares the operands): ``C[M, N] = A[M, K] @ B[N, K]^T`` with
A and B FP8, row-major (K-major), and dequantization scales ``a_s``/``b_s`` (``scale_inv`` from the
quantizer) in one of four modes (see primus_turbo/triton/gemm/gemm_fp8_kernel.py):

    0 TENSORWISE   a_s ()           b_s ()
    1 ROWWISE      a_s (M, 1)       b_s (N, 1)
    2 BLOCKWISE    a_s (M, K/bs)    b_s (N/bs, K/bs)    activations 1 x bs, weights bs x bs
    3 BLOCKWISE    a_s (M, K/bs)    b_s (N, K/bs)       1 x bs both (wgrad)

Backends: ``CUBLAS`` (torch._scaled_mm; CUDA only), ``TRITON`` (persistent Hopper kernel; every
mode, any M/N/K, E4M3/E5M2 mixes), ``TORCH`` (dequantize + fp32 matmul; the CPU default).
Dispatcher op name "gemm" with precision "fp8", so ``PRIMUS_TURBO_GEMM_BACKEND=fp8:TRITON`` or
``GlobalBackendManager.set_gemm_backend("TRITON", precision="fp8")`` pin it.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.utils import triton_can_run_on

__all__ = ["GemmFP8Dispatcher", "gemm_fp8_impl", "dequantize_operand"]

E4M3 = torch.float8_e4m3fn


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
    """torch._scaled_mm (cuBLASLt). Needs K, N multiples of 16 (b is passed column-major), E4M3 for
    rowwise and blockwise, bf16 output for rowwise, and for blockwise bs=128, K % 128 == 0 (and
    K % 512 == 0 with 128x128 weight scales: torch versions differ on that scale's row stride)."""

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
        if a.dtype != E4M3 or b.dtype != E4M3:
            return False
        if scale_mode == 1:
            return out_dtype == torch.bfloat16
        if scale_block != 128 or k % 128:
            return False
        return scale_mode == 3 or (k % 512 == 0 and n % 128 == 0)

    @staticmethod
    def execute(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum=False, **_) -> torch.Tensor:
        a = a.contiguous()
        b_cm = b.contiguous().t()  # [K, N] column-major
        if scale_mode == 0:
            sa, sb = a_s.reshape(()).float(), b_s.reshape(()).float()
        elif scale_mode == 1:
            sa, sb = a_s.reshape(-1, 1).float().contiguous(), b_s.reshape(1, -1).float().contiguous()
        else:
            sa = a_s.t().contiguous().t()  # (M, K/128) column-major
            sb = b_s.contiguous().t() if scale_mode == 2 else b_s.t().contiguous()
        # Fast (FP8-internal) accumulation only for tensorwise forward GEMMs, as Transformer Engine
        # does; gradients and the scaled recipes keep cuBLAS's split fp32 accumulation.
        fast = bool(fast_accum) and scale_mode == 0
        return torch._scaled_mm(a, b_cm, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast)


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
        return (*a.shape, b.shape[0], a.dtype, b.dtype, scale_mode, scale_block, out_dtype, a.device.type)

    @classmethod
    def default_backend(cls, a, **kw) -> BackendType:
        # cuBLAS is at the FP8 roofline for tensorwise/rowwise (~1280 TFLOP/s on H200) and 1198 for
        # 1x128/128x128 blockwise; TRITON serves whatever cuBLAS cannot (E5M2xE5M2, odd sizes).
        if not a.is_cuda:
            return BackendType.TORCH
        if GemmFP8CublasBackend.can_handle(a=a, **kw):
            return BackendType.CUBLAS
        return BackendType.TRITON


@torch.library.custom_op("primus_turbo::gemm_fp8", mutates_args=())
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

    ``fast_accum``: allow cuBLAS's faster FP8 accumulation (tensorwise forward only)."""
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


@gemm_fp8_impl.register_fake
def _gemm_fp8_fake(a, a_s, b, b_s, scale_mode, scale_block, out_dtype, fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)
