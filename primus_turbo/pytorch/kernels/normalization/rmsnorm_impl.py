"""RMSNorm backends and dispatcher behind ``torch.ops.primus_turbo.rmsnorm_fwd`` / ``rmsnorm_bwd``.

    y = x * rsqrt(mean(x^2, -1) + eps) * (weight [+ 1 when zero_centered_gamma])

Residual variant: x is replaced by s = x + residual (rounded to x.dtype, as the unfused ops do),
and s is returned too. rstd (fp32 [rows]) is saved for the backward, which every backend can read
whichever backend produced it. Backends (on CUDA the backward defaults to TURBO, the forward to
TURBO up to 128M elements and TRITON above, see ``RMSNormDispatcher.default_backend``; else TURBO >
TRITON > TORCH):

* ``TURBO``: CUDA C++ kernels in csrc/kernels/normalization/rmsnorm.cu (needs the ``_C`` extension;
  rows up to 16384 bf16/fp16 or 8192 fp32 elements when 16-byte vectorizable, else 4096).
* ``TRITON``: primus_turbo/triton/normalization/rmsnorm_kernel.py (hidden <= 65536).
* ``TORCH``: fp32 eager math; any size and device; the CPU default (the interpreter is slow).

A ``backend=`` argument pins one backend for a call; one that cannot serve the inputs raises
``ValueError``. Inputs are validated once in ``primus_turbo.pytorch.ops.normalization``; here
tensors are already contiguous [rows, hidden] with one dtype, and ``can_handle`` never raises.
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION, cpp_ops
from primus_turbo.pytorch.core.utils import triton_can_run_on

__all__ = [
    "RMSNormDispatcher",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "rmsnorm_fwd_impl",
    "rmsnorm_residual_fwd_impl",
    "rmsnorm_bwd_impl",
    "rmsnorm_fwd_traced",
    "SUPPORTED_DTYPES",
    "turbo_max_hidden",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TRITON_MAX_HIDDEN = 65536
_TURBO_FWD_MAX_NUMEL = 1 << 27  # default forward: TURBO up to here, TRITON above (default_backend)


def turbo_max_hidden(hidden: int, dtype: torch.dtype, tensors: list[torch.Tensor | None]) -> int:
    """Mirror of rmsnorm_max_hidden() in csrc/kernels/normalization/rmsnorm.cu: <= 512 threads per
    row, 4 16-byte vectors per thread when hidden % vec == 0 and all pointers are 16-byte aligned,
    else 8 scalars per thread."""
    vec = 16 // dtype.itemsize
    aligned = all(t is None or t.data_ptr() % 16 == 0 for t in tensors)
    return 512 * 4 * vec if aligned and hidden % vec == 0 else 512 * 8


def _row_tensors(x, residual, dy, dsum) -> list[torch.Tensor | None]:
    return [x, residual, dy, dsum]


# -- backends (kwargs: stage, x, weight, residual, dy, rstd, dsum, eps, zero_centered_gamma) ---------
class RMSNormTorchBackend(KernelBackend):
    """fp32 eager reference; runs anywhere."""

    @staticmethod
    def can_handle(x, **_) -> bool:
        return x.dtype in SUPPORTED_DTYPES

    @staticmethod
    def execute(stage, x, weight, residual, dy, rstd, dsum, eps, zero_centered_gamma, **_):
        w = weight.float() + 1.0 if zero_centered_gamma else weight.float()
        if stage == "fwd":
            s = (x + residual) if residual is not None else x
            xf = s.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
            y = (xf * rstd[:, None] * w).to(x.dtype)
            return y, (s if residual is not None else x.new_empty(0)), rstd
        x_hat = x.float() * rstd[:, None]
        w_dy = dy.float() * w
        mean_dot = (x_hat * w_dy).mean(-1, keepdim=True)
        dx = rstd[:, None] * (w_dy - x_hat * mean_dot)
        if dsum is not None:
            dx = dx + dsum.float()
        dweight = (dy.float() * x_hat).sum(0)
        return dx.to(x.dtype), dweight.to(weight.dtype)


class RMSNormTritonBackend(KernelBackend):
    @staticmethod
    def can_handle(x, weight, **_) -> bool:
        return (
            x.dtype in SUPPORTED_DTYPES and x.shape[-1] <= _TRITON_MAX_HIDDEN and triton_can_run_on(x, weight)
        )

    @staticmethod
    def execute(stage, x, weight, residual, dy, rstd, dsum, eps, zero_centered_gamma, **_):
        from primus_turbo.triton.normalization.rmsnorm_kernel import rmsnorm_bwd_triton, rmsnorm_fwd_triton

        if stage == "fwd":
            return rmsnorm_fwd_triton(x, residual, weight, eps, zero_centered_gamma)
        return rmsnorm_bwd_triton(dy, x, weight, rstd, dsum, zero_centered_gamma)


class RMSNormTurboBackend(KernelBackend):
    """CUDA C++ (csrc): one row per warp or per CTA, 16-byte accesses, deterministic dweight."""

    @staticmethod
    def can_handle(x, weight, residual=None, dy=None, dsum=None, **_) -> bool:
        if not (HAS_CPP_EXTENSION and x.is_cuda and weight.is_cuda and x.dtype in SUPPORTED_DTYPES):
            return False
        hidden = x.shape[-1]
        return hidden <= turbo_max_hidden(hidden, x.dtype, [*_row_tensors(x, residual, dy, dsum), weight])

    @staticmethod
    def execute(stage, x, weight, residual, dy, rstd, dsum, eps, zero_centered_gamma, **_):
        ops = cpp_ops()
        if stage == "fwd":
            if residual is None:
                y, rstd = ops.rmsnorm_fwd(x, weight, eps, zero_centered_gamma)
                return y, x.new_empty(0), rstd
            return ops.rmsnorm_residual_fwd(x, residual, weight, eps, zero_centered_gamma)
        return ops.rmsnorm_bwd(dy, x, weight, rstd, dsum, zero_centered_gamma)


class RMSNormDispatcher(AutoKernelDispatcher):
    op_name = "rmsnorm"
    backends = {
        BackendType.TURBO: RMSNormTurboBackend,
        BackendType.TRITON: RMSNormTritonBackend,
        BackendType.TORCH: RMSNormTorchBackend,
    }

    @classmethod
    def make_key(cls, stage, x, weight=None, residual=None, dy=None, dsum=None, **_) -> tuple:
        # every pointer's alignment: TURBO's widest hidden size depends on all of them (an autotuned choice
        # made for aligned tensors must not be reused for a misaligned residual / dy / dsum / weight)
        aligned = all(t.data_ptr() % 16 == 0 for t in (x, weight, residual, dy, dsum) if t is not None)
        extra = residual is not None or dsum is not None
        return (stage, x.shape[0], x.shape[-1], x.dtype, x.device.type, extra, aligned)

    @classmethod
    def default_backend(cls, stage, x, **_) -> BackendType | None:
        """Measured rule (bench_rmsnorm and benchmark/ops/sweep_rmsnorm.py, bf16, H100 2026-11-25 and
        H200 2026-11-26): the TURBO backward beats the TRITON one at every shape (H200: 80-92% of copy
        bandwidth vs 44-73% at 16384+ rows). In GPU time the two forwards now tie where TURBO runs its
        one-row-per-CTA kernel (bf16 1536-8192 columns in multiples of 512; two passes above 4096 columns;
        bench_rmsnorm, H200 session 22: 32768 x 7168 221.2 vs 221.0 us, 32768 x 8192 252.8 vs 253.0); until
        session 21 TRITON was 2-8% ahead there. On the host a Triton launch costs 30-140 us more than the
        C++ op on the H200 machines' hosts (bench_rmsnorm "host fwd us": 78 vs 42-47 on one machine, 145-195
        vs 50-100 on another), up to the whole GPU time of a 64-128M-element forward (on the slower host,
        16384 x 4096: TURBO 3539 GB/s, TRITON 2154 GB/s end to end). So the TURBO forward is the default up
        to 128M elements (256 MB of bf16 input, ~120 us of GPU time) and TRITON above it, where the launch
        cost is hidden and TRITON is ahead for the widths TURBO serves with its persistent or scalar
        kernels. rstd is shared, so a TRITON forward feeds a TURBO backward. A backend that cannot serve the
        inputs falls through to the order TURBO > TRITON > TORCH. CPU: TORCH (the Triton interpreter is
        orders of magnitude slower than eager torch)."""
        if not x.is_cuda:
            return BackendType.TORCH
        if stage == "fwd" and x.numel() > _TURBO_FWD_MAX_NUMEL:
            return BackendType.TRITON
        return BackendType.TURBO

    @classmethod
    def run(cls, backend: str, **kwargs):
        """Dispatch, or run the backend named by ``backend`` ('' = automatic) when it can serve."""
        if not backend:
            return cls.dispatch(**kwargs)
        pinned = BackendType.parse(backend, source="rmsnorm(backend=...)")
        impl = cls.backends.get(pinned)
        if impl is None:
            raise ValueError(
                f"rmsnorm: backend {pinned.name} is not implemented; available: "
                f"{', '.join(b.name for b in cls.backends)}"
            )
        if not impl.can_handle(**kwargs):
            raise ValueError(
                f"rmsnorm: backend {pinned.name} cannot handle these inputs ({cls.describe(**kwargs)}); "
                f"backends that can: {', '.join(b.name for b in cls.candidates(**kwargs)) or 'none'}"
            )
        cls.last_backend = pinned
        return impl.execute(**kwargs)


# -- entry points -------------------------------------------------------------------------------------
# rmsnorm_fwd / rmsnorm_bwd are plain functions; the custom ops below wrap them so torch.compile
# traces through (register_fake gives shapes). Eager callers (ops/normalization.py, outside
# compilation) call the plain functions directly: the custom-op layer costs ~10 us of host time
# per call, a noticeable share of a 20-70 us memory-bound kernel.
def rmsnorm_fwd(x, residual, weight, eps: float, zero_centered_gamma: bool, backend: str):
    """x, residual: contiguous [rows, hidden]. Returns (y, x + residual or a 0-element tensor, rstd)."""
    if x.numel() == 0:
        y, rstd = torch.empty_like(x), x.new_zeros(x.shape[0], dtype=torch.float32)
        return y, (x + residual) if residual is not None else x.new_empty(0), rstd
    return RMSNormDispatcher.run(
        backend,
        stage="fwd",
        x=x,
        weight=weight,
        residual=residual,
        dy=None,
        rstd=None,
        dsum=None,
        eps=eps,
        zero_centered_gamma=zero_centered_gamma,
    )


def rmsnorm_bwd(dy, x, weight, rstd, dsum, zero_centered_gamma: bool, backend: str):
    """dy, x (the normalised input), dsum: contiguous [rows, hidden]. Returns (dx [+ dsum], dweight)."""
    if x.numel() == 0:
        dx = dsum.clone() if dsum is not None else torch.zeros_like(x)
        return dx, torch.zeros_like(weight)
    return RMSNormDispatcher.run(
        backend,
        stage="bwd",
        x=x,
        weight=weight,
        residual=None,
        dy=dy,
        rstd=rstd,
        dsum=dsum,
        eps=0.0,
        zero_centered_gamma=zero_centered_gamma,
    )


# Custom ops: no placeholder outputs (plain and residual forward are separate ops), every output a
# fresh tensor (nothing aliases an input or another output), fakes that match the real outputs'
# shapes, dtypes and (contiguous) strides, and the impls make their inputs contiguous themselves, so
# whatever layout Inductor hands in is served.
def _c(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


@torch.library.custom_op("primus_turbo::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd_impl(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom-op twin of ``rmsnorm_fwd`` without residual: (y, rstd)."""
    y, _, rstd = rmsnorm_fwd(_c(x), None, _c(weight), eps, zero_centered_gamma, backend)
    return y, rstd


@rmsnorm_fwd_impl.register_fake
def _rmsnorm_fwd_fake(x, weight, eps, zero_centered_gamma, backend):
    rows = x.shape[0]
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("primus_turbo::rmsnorm_residual_fwd", mutates_args=())
def rmsnorm_residual_fwd_impl(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered_gamma: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Custom-op twin of ``rmsnorm_fwd`` with residual: (y, x + residual, rstd)."""
    y, s, rstd = rmsnorm_fwd(_c(x), _c(residual), _c(weight), eps, zero_centered_gamma, backend)
    return y, s, rstd


@rmsnorm_residual_fwd_impl.register_fake
def _rmsnorm_residual_fwd_fake(x, residual, weight, eps, zero_centered_gamma, backend):
    rows = x.shape[0]
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("primus_turbo::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd_impl(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dsum: torch.Tensor | None,
    zero_centered_gamma: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom-op twin of ``rmsnorm_bwd``: (dx [+ dsum], dweight)."""
    return rmsnorm_bwd(_c(dy), _c(x), _c(weight), _c(rstd), _c(dsum), zero_centered_gamma, backend)


@rmsnorm_bwd_impl.register_fake
def _rmsnorm_bwd_fake(dy, x, weight, rstd, dsum, zero_centered_gamma, backend):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def rmsnorm_fwd_traced(x, residual, weight, eps: float, zero_centered_gamma: bool, backend: str):
    """What ``rmsnorm_fwd`` is under torch.compile: one opaque custom-op node. Returns
    (y, x + residual or None, rstd)."""
    if residual is None:
        y, rstd = rmsnorm_fwd_impl(x, weight, eps, zero_centered_gamma, backend)
        return y, None, rstd
    return rmsnorm_residual_fwd_impl(x, residual, weight, eps, zero_centered_gamma, backend)
