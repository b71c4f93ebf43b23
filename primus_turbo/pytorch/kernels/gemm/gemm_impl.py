"""GEMM backends and dispatcher behind ``torch.ops.primus_turbo.gemm``.

C = op(a) @ op(b), op(x) = x.T when the matching ``trans_*`` flag is set; a is [M, K] (or [K, M]),
b is [K, N] (or [N, K]). Backends:

* ``CUBLAS``: ``torch.mm`` on CUDA (cuBLAS/cuBLASLt); the CUDA default.
* ``TRITON``: the persistent Hopper kernels in ``primus_turbo/triton/gemm/gemm_kernel.py`` (TMA
  when alignment allows, pointer kernel otherwise); fp16/bf16/fp32 in, fp16/bf16/fp32 out.
* ``TORCH``: fp32 (fp64 for fp64 inputs) upcast reference via ``torch.matmul``; the CPU default.

Inputs are validated once in ``primus_turbo.pytorch.ops.gemm``; ``can_handle`` only says which
backend can serve already-valid inputs and never raises.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    precision_of_dtype,
)
from primus_turbo.pytorch.core.utils import triton_can_run_on
from primus_turbo.triton.gemm.gemm_kernel import gemm_triton

__all__ = ["GemmDispatcher", "gemm_impl", "gemm_forward", "gemm_accumulate_", "SUPPORTED_DTYPES"]

# dtypes the op accepts (inputs and out_dtype); TRITON serves the first three.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _logical(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool):
    """Transposed views (no copies) so every backend sees A[M, K] @ B[K, N]."""
    return (a.T if trans_a else a), (b.T if trans_b else b)


def _same_device_and_dtype(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.device == b.device
        and (a.dtype == b.dtype)
    )


class GemmTorchBackend(KernelBackend):
    """Reference: upcast to fp32 (fp64 stays fp64), matmul, cast to ``out_dtype``."""

    @staticmethod
    def can_handle(a, b, trans_a, trans_b, out_dtype, **_) -> bool:
        return _same_device_and_dtype(a, b) and a.dtype in SUPPORTED_DTYPES and out_dtype in SUPPORTED_DTYPES

    @staticmethod
    def execute(a, b, trans_a, trans_b, out_dtype, **_) -> torch.Tensor:
        a, b = _logical(a, b, trans_a, trans_b)
        acc = torch.float64 if a.dtype == torch.float64 else torch.float32
        return torch.matmul(a.to(acc), b.to(acc)).to(out_dtype)


def _mm_has_out_dtype() -> bool:
    return hasattr(torch.ops.aten.mm, "dtype")  # aten::mm.dtype: half in, fp32 out (cuBLASLt)


class GemmCublasBackend(KernelBackend):
    """``torch.mm`` on CUDA tensors. A half-precision GEMM with fp32 output uses ``mm(out_dtype=)``
    (fp32 accumulator written directly) where torch has it, else an fp32 cast of the half result."""

    @staticmethod
    def can_handle(a, b, trans_a, trans_b, out_dtype, **_) -> bool:
        return (
            _same_device_and_dtype(a, b)
            and a.is_cuda
            and a.dtype in SUPPORTED_DTYPES
            and out_dtype in SUPPORTED_DTYPES
        )

    @staticmethod
    def execute(a, b, trans_a, trans_b, out_dtype, **_) -> torch.Tensor:
        a, b = _logical(a, b, trans_a, trans_b)
        if out_dtype == a.dtype:
            return torch.mm(a, b)
        if out_dtype == torch.float32 and a.dtype in _HALF_DTYPES and _mm_has_out_dtype():
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b).to(out_dtype)


class GemmTritonBackend(KernelBackend):
    """Persistent Triton kernels (TMA on sm_90 when aligned; pointer kernel otherwise)."""

    @staticmethod
    def can_handle(a, b, trans_a, trans_b, out_dtype, **_) -> bool:
        return (
            _same_device_and_dtype(a, b)
            and a.dtype in _TRITON_DTYPES
            and out_dtype in _TRITON_DTYPES
            and triton_can_run_on(a, b)
        )

    @staticmethod
    def execute(a, b, trans_a, trans_b, out_dtype, **_) -> torch.Tensor:
        a, b = _logical(a, b, trans_a, trans_b)
        return gemm_triton(a, b, out_dtype)


class GemmDispatcher(AutoKernelDispatcher):
    op_name = "gemm"
    backends = {
        BackendType.CUBLAS: GemmCublasBackend,
        BackendType.TRITON: GemmTritonBackend,
        BackendType.TORCH: GemmTorchBackend,
    }

    @classmethod
    def make_key(cls, a, b, trans_a, trans_b, out_dtype, **_) -> tuple:
        # From a's and b's own shapes and strides (no transposed views: this runs on every autotuned call)
        m, k = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
        n = b.shape[0] if trans_b else b.shape[1]
        return (
            m,
            n,
            k,
            a.dtype,
            out_dtype,
            a.device.type,
            a.stride(0 if trans_a else 1) == 1,  # logical A[M, K] K-major
            b.stride(1 if trans_b else 0) == 1,  # logical B[K, N] K-major
            a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0,  # TMA-eligible bases
        )

    @classmethod
    def candidates(cls, **kwargs) -> list[BackendType]:
        """Autotune candidates. TORCH is the fp32-upcast reference: on CUDA it is never the fastest
        and timing it at training shapes costs seconds, so it only competes when alone."""
        found = super().candidates(**kwargs)
        if kwargs["a"].is_cuda and len(found) > 1:
            found = [b for b in found if b != BackendType.TORCH]
        return found

    # A challenger must beat the default (cuBLAS on CUDA) by this fraction in the autotune timing:
    # 10 timed runs carry ~1% noise, and a coin-flip pick of a kernel that is really 1% slower
    # would break the "never lose to cuBLAS" promise.
    autotune_margin = 0.02

    @classmethod
    def default_backend(cls, a, **_) -> BackendType:
        return BackendType.CUBLAS if a.is_cuda else BackendType.TORCH

    # -- plain calls on cuBLAS ------------------------------------------------------------------------
    # Forward keys whose forward, dgrad and wgrad all ran on CUBLAS under autotune (recorded by ops.gemm's
    # backward). Cleared with the autotune cache.
    _all_cublas: dict[tuple, bool] = {}

    @classmethod
    def clear_cache(cls) -> None:
        super().clear_cache()
        cls._all_cublas.clear()

    @classmethod
    def plain_call_on_cublas(cls, a, b, trans_a: bool, trans_b: bool) -> tuple[bool, tuple | None]:
        """(True, _) when all three GEMMs of this call (forward, dgrad, wgrad; output in a's dtype) resolve
        to CUBLAS: CUBLAS pinned (code or environment), no pin and no autotune (the CUDA default), or
        autotune whose choices for this forward key were all CUBLAS when a call of it went through the
        backward. Under autotune the second item is the forward key for the backward to record (the
        dgrad/wgrad keys assume a contiguous output gradient, as autograd gives it). A pin to another
        backend gives (False, None). Inputs must be valid CUDA operands (ops.gemm checks)."""
        precision = precision_of_dtype(a.dtype)
        pinned, _ = GlobalBackendManager.user_backend(cls.op_name, precision)
        if pinned is not None:
            return pinned is BackendType.CUBLAS, None
        if not (cls.autotune and GlobalBackendManager.auto_tune_enabled()):
            return True, None
        key = (precision,) + cls.make_key(a=a, b=b, trans_a=trans_a, trans_b=trans_b, out_dtype=a.dtype)
        return cls._all_cublas.get(key, False), key

    @classmethod
    def record_all_cublas(cls, key: tuple, *backends: BackendType | None) -> None:
        if len(cls._all_cublas) >= cls.cache_size:
            cls._all_cublas.clear()
        cls._all_cublas[key] = all(b is BackendType.CUBLAS for b in backends)


@torch.library.custom_op("primus_turbo::gemm", mutates_args=())
def gemm_impl(
    a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """op(a) @ op(b) through the dispatcher. Inputs must already be valid (see ops.gemm)."""
    return GemmDispatcher.dispatch(a=a, b=b, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype)


@gemm_impl.register_fake
def _gemm_fake(a, b, trans_a, trans_b, out_dtype):
    m = a.shape[1] if trans_a else a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    return a.new_empty((m, n), dtype=out_dtype)


def gemm_forward(a, b, trans_a: bool, trans_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """What ops.gemm calls. Eager calls go straight to the dispatcher: the custom-op layer costs
    ~10 us of Python per call, as much as a small training GEMM takes on an H200. Traced calls
    (torch.compile) go through ``primus_turbo::gemm`` so the graph holds one opaque node."""
    if torch.compiler.is_compiling():
        return gemm_impl(a, b, trans_a, trans_b, out_dtype)
    return GemmDispatcher.dispatch(a=a, b=b, trans_a=trans_a, trans_b=trans_b, out_dtype=out_dtype)


def gemm_accumulate_(c: torch.Tensor, a, b, trans_a: bool, trans_b: bool) -> None:
    """c += op(a) @ op(b) in c's dtype: the Megatron ``main_grad`` accumulation.

    When the dispatcher picks CUBLAS this is one cuBLASLt GEMM with beta=1 writing into ``c``
    (``addmm(out=c)``, half inputs with fp32 ``c`` through ``out_dtype``): no temporary and no extra
    pass over the fp32 gradient. Other backends (and traced calls) compute the product in
    ``c.dtype`` and ``add_`` it.
    """
    kwargs = {"a": a, "b": b, "trans_a": trans_a, "trans_b": trans_b, "out_dtype": c.dtype}
    if not torch.compiler.is_compiling() and c.is_cuda:
        backend = GemmDispatcher.resolve(**kwargs)
        if backend == BackendType.CUBLAS:
            GemmDispatcher.last_backend = backend
            al, bl = _logical(a, b, trans_a, trans_b)
            if c.dtype == a.dtype:
                c.addmm_(al, bl)
                return
            if (
                c.dtype == torch.float32
                and a.dtype in _HALF_DTYPES
                and hasattr(torch.ops.aten.addmm, "dtype_out")
            ):
                torch.addmm(c, al, bl, out_dtype=torch.float32, out=c)
                return
    c.add_(gemm_forward(a, b, trans_a, trans_b, c.dtype))
