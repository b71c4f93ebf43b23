"""FP8 grouped GEMM backends over already-quantized operands, dispatcher and custom ops.

Operands come in the kernel layout: ``a`` [M, K] fp8, ``b_view`` [G, K, N] fp8 (any strides),
``out[rows_g] = (a * a_scale)[rows_g] @ (b_view[g] * b_scale[g])`` with ``scale_mode``:

  TENSORWISE (1): a_scale [1], b_scale [G] (stride 0 when one scale serves all experts)
  ROWWISE    (2): a_scale [M] (per row, along K), b_scale [G, N] (per output column, along K)
  BLOCKWISE  (3): a_scale [M, ceil(K/128)], b_scale [G, ceil(K/128), ceil(N/128)] (any strides)

Variable-K (wgrad) over fp8 ``x`` [M, P], ``y`` [M, Q] (any strides; token-contiguous, i.e. views
of [P, M] / [Q, M] transposed copies, is what Hopper FP8 MMAs want) with ``scale_mode`` 1:
per-group scalars ``x_scale`` [G], ``y_scale`` [G]; or 2: per-column ``x_scale`` [P], ``y_scale``
[Q]: ``out[g] = (x_g * x_scale)^T @ (y_g * y_scale)``.

Backends: CUTLASS (torch._scaled_grouped_mm: ROWWISE, and TENSORWISE expressed as rowwise with
broadcast scales; E4M3 x E4M3, bf16 out, sm_90; forward/dgrad: column-major per-expert b; wgrad:
the 2d-2d form over token-contiguous x and y, M % 16 == 0), TRITON (every mode; on sm_90 the TMA
kernels of ``grouped_gemm_tma_kernel`` where the operands allow, else the pointer kernels), TORCH
(dequantize + per-group loop in fp32: the reference and CPU default; it syncs).

The CUTLASS wgrad also needs every group to hold a multiple of 16 tokens: torch checks all but the
last with a device-side assert (GroupMMCommon.cuh, ``prepare_grouped_gemm_data``: TMA needs 16-byte
aligned group starts), which kills the CUDA context (M % 16 == 0 then covers the last), and
``can_handle`` cannot see it without a host sync. So the wgrad dispatcher picks CUTLASS unpinned
(default and autotune) only when the caller promises aligned groups:
``GroupedGemmFP8VariableKDispatcher.group_lens_multiple_of_16 = True`` (e.g. a router that pads
each expert's tokens to 16, as TorchTitan does for FP8); otherwise TRITON. Pinned, it is the
caller's risk (PRIMUS_TURBO_DEBUG_CHECKS=1 turns the device assert into a ValueError).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.utils import debug_checks_enabled, eager_direct, triton_can_run_on
from primus_turbo.pytorch.kernels.grouped_gemm.grouped_gemm_impl import (
    VariableKTorchBackend,
    cutlass_offsets,
    zero_tail,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
    SCALE_BLOCKWISE,
    SCALE_ROWWISE,
    SCALE_TENSORWISE,
    launch_grouped_gemm,
    launch_grouped_gemm_variable_k,
)
from primus_turbo.triton.grouped_gemm.grouped_gemm_tma_kernel import (
    launch_grouped_gemm_tma,
    launch_grouped_gemm_variable_k_tma,
    tma_forward_supported,
    tma_variable_k_supported,
)

__all__ = [
    "grouped_gemm_fp8_impl",
    "grouped_gemm_fp8_variable_k_impl",
    "GroupedGemmFP8Dispatcher",
    "GroupedGemmFP8VariableKDispatcher",
]

BLOCK = 128


def dequantize_operands(a, b_view, a_scale, b_scale, scale_mode):
    """fp32 copies of the two operands (reference backend and tests)."""
    af, bf = a.float(), b_view.float()
    m, k = a.shape
    g, _, n = b_view.shape
    if scale_mode == SCALE_TENSORWISE:
        return af * a_scale.reshape(1, 1), bf * b_scale.reshape(g, 1, 1)
    if scale_mode == SCALE_ROWWISE:
        return af * a_scale.reshape(m, 1), bf * b_scale.reshape(g, 1, n)
    sa = a_scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    sb = b_scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)[:, :k, :n]
    return af * sa, bf * sb


class FP8TorchBackend(KernelBackend):
    syncs_host = True  # reads group_lens on the host: never autotuned on CUDA

    @staticmethod
    def can_handle(**kw) -> bool:
        return True

    @staticmethod
    def execute(a, b_view, a_scale, b_scale, group_lens, scale_mode, out_dtype, **kw):
        af, bf = dequantize_operands(a, b_view, a_scale, b_scale, scale_mode)
        out = torch.zeros(a.shape[0], b_view.shape[2], dtype=torch.float32, device=a.device)
        start = 0
        for g, n in enumerate(group_lens.tolist()):  # host sync: reference backend only
            out[start : start + n] = af[start : start + n] @ bf[g]
            start += n
        return out.to(out_dtype)


class FP8CutlassBackend(KernelBackend):
    @staticmethod
    def can_handle(a, b_view, scale_mode, out_dtype, **kw) -> bool:
        if (
            scale_mode not in (SCALE_ROWWISE, SCALE_TENSORWISE)
            or out_dtype != torch.bfloat16
            or not a.is_cuda
        ):
            return False
        if a.dtype != torch.float8_e4m3fn or b_view.dtype != torch.float8_e4m3fn:
            return False
        if torch.cuda.get_device_capability(a.device) < (9, 0):
            return False
        k, n = a.shape[1], b_view.shape[2]
        g = b_view.shape[0]
        # per expert a column-major [K, N] (the transpose of a contiguous [G, N, K] copy)
        col_major_b = (
            b_view.stride(1) == 1 and b_view.stride(2) == k and (g == 1 or b_view.stride(0) == k * n)
        )
        return col_major_b and a.stride(1) == 1 and k % 16 == 0 and n % 16 == 0 and min(a.shape[0], k, n) > 0

    @staticmethod
    def execute(a, b_view, a_scale, b_scale, group_lens, scale_mode, out_dtype, **kw):
        offs = cutlass_offsets(group_lens, a.shape[0])
        m, (g, _, n) = a.shape[0], b_view.shape
        if scale_mode == SCALE_TENSORWISE:  # rowwise with broadcast scales: tiny [M] / [G, N] fills
            a_scale = a_scale.reshape(1).expand(m)
            b_scale = b_scale.reshape(-1, 1).expand(g, n)
        out = torch._scaled_grouped_mm(
            a, b_view, a_scale.reshape(-1).contiguous(), b_scale.contiguous(), offs=offs,
            out_dtype=out_dtype, use_fast_accum=True,
        )  # fmt: skip
        return zero_tail(out, offs)  # rows past the last group: zeros, not computed


class FP8TritonBackend(KernelBackend):
    @staticmethod
    def can_handle(a, b_view, group_lens, **kw) -> bool:
        return triton_can_run_on(a, b_view, group_lens) and group_lens.shape[0] < 4096

    @staticmethod
    def execute(a, b_view, a_scale, b_scale, group_lens, scale_mode, out_dtype, **kw):
        out = torch.empty(a.shape[0], b_view.shape[2], dtype=out_dtype, device=a.device)
        if out.numel() == 0:
            return out
        if tma_forward_supported(a, b_view, scale_mode):  # sm_90, reduction axis contiguous
            return launch_grouped_gemm_tma(a, b_view, out, group_lens, a_scale, b_scale, scale_mode)
        return launch_grouped_gemm(a, b_view, out, group_lens, a_scale, b_scale, scale_mode)


class GroupedGemmFP8Dispatcher(AutoKernelDispatcher):
    op_name = "grouped_gemm"
    backends = {
        BackendType.CUTLASS: FP8CutlassBackend,
        BackendType.TRITON: FP8TritonBackend,
        BackendType.TORCH: FP8TorchBackend,
    }

    @classmethod
    def make_key(cls, a, b_view, scale_mode, out_dtype, **kw) -> tuple:
        strides = tuple(b_view.stride())
        return ("fp8", tuple(a.shape), tuple(b_view.shape), strides, a.dtype, scale_mode, out_dtype)

    @classmethod
    def default_backend(cls, a, **kw):
        if a.device.type == "cpu":
            return BackendType.TORCH
        # The TMA Triton kernel where it applies: 1.00-1.28x CUTLASS at four of five MoE shapes on H200
        # (0.97x at DeepSeek-V3 fc2; results/h200/sweep_grouped_gemm_fp8_adb78e3.txt); else CUTLASS for
        # ROWWISE / TENSORWISE E4M3 -> bf16, Triton's pointer kernel for the rest
        if tma_forward_supported(a, kw["b_view"], kw["scale_mode"]):
            return BackendType.TRITON
        return BackendType.CUTLASS if FP8CutlassBackend.can_handle(a=a, **kw) else BackendType.TRITON


class FP8VariableKTritonBackend(KernelBackend):
    @staticmethod
    def can_handle(x, y, group_lens, **kw) -> bool:
        return triton_can_run_on(x, y, group_lens) and group_lens.shape[0] < 4096

    @staticmethod
    def execute(x, y, x_scale, y_scale, group_lens, scale_mode, out_dtype, **kw):
        out = torch.empty(group_lens.shape[0], x.shape[1], y.shape[1], dtype=out_dtype, device=x.device)
        if out.numel() == 0:
            return out
        if tma_variable_k_supported(x, y):  # sm_90, token-contiguous copies
            return launch_grouped_gemm_variable_k_tma(x, y, out, group_lens, x_scale, y_scale, scale_mode)
        return launch_grouped_gemm_variable_k(x, y, out, group_lens, x_scale, y_scale, scale_mode)


class FP8VariableKTorchBackend(KernelBackend):
    syncs_host = True  # reads group_lens on the host: never autotuned on CUDA

    @staticmethod
    def can_handle(**kw) -> bool:
        return True

    @staticmethod
    def execute(x, y, x_scale, y_scale, group_lens, scale_mode, out_dtype, **kw):
        out = VariableKTorchBackend.execute(x=x.float(), y=y.float(), group_lens=group_lens)
        if scale_mode == SCALE_TENSORWISE:
            return (out * (x_scale * y_scale).view(-1, 1, 1)).to(out_dtype)
        return (out * x_scale.view(1, -1, 1) * y_scale.view(1, 1, -1)).to(out_dtype)


class FP8VariableKCutlassBackend(KernelBackend):
    """torch._scaled_grouped_mm in its 2d-2d form: A = x.t() [P, M] row-major, B = y [M, Q]
    column-major, per-group K = the group's tokens.

    Measured on H200 (torch 2.11): 64 groups, P=2816, Q=2048, M=24576 balanced: 0.502 ms
    (565 TFLOP/s) vs ~0.72 ms for our Triton variable-K kernel.

    Precondition the inputs cannot show without a host sync: every group holds a multiple of 16
    tokens (else a device-side assert in torch; see the module docstring).
    Empty groups: exact zeros expected from the sm_90 kernel as for bf16 (pytorch#172439); the
    GPU tests check both.
    """

    @staticmethod
    def can_handle(x, y, group_lens, out_dtype, **kw) -> bool:
        if not (x.is_cuda and y.is_cuda and group_lens.is_cuda) or out_dtype != torch.bfloat16:
            return False
        if x.dtype != torch.float8_e4m3fn or y.dtype != torch.float8_e4m3fn:  # torch rejects E5M2
            return False
        if torch.cuda.get_device_capability(x.device) != (9, 0):
            return False
        (m, p), q = x.shape, y.shape[1]
        # token-contiguous views of [P, M] / [Q, M] copies; torch wants 16-byte strides: M % 16 == 0
        token_contiguous = x.stride() == (1, m) and y.stride() == (1, m)
        return (
            token_contiguous and m > 0 and m % 16 == 0 and p % 16 == 0 and q % 16 == 0
            and group_lens.shape[0] >= 1
        )  # fmt: skip

    @staticmethod
    def execute(x, y, x_scale, y_scale, group_lens, scale_mode, out_dtype, **kw):
        (m, p), q, g = x.shape, y.shape[1], group_lens.shape[0]
        if p == 0 or q == 0 or g == 0:
            return torch.zeros(g, p, q, dtype=out_dtype, device=x.device)
        if debug_checks_enabled() and any(n % 16 for n in group_lens.tolist()):
            raise ValueError(
                "grouped_gemm_fp8 wgrad (CUTLASS): every group needs a multiple of 16 tokens, "
                f"got group_lens={group_lens.tolist()}"
            )
        # scale index g*P + i scales row i of group g's [P, Q] output (g*Q + j: column j)
        if scale_mode == SCALE_TENSORWISE:  # x_scale [G], y_scale [G]: one scalar per group
            scale_a = x_scale.float().reshape(g, 1).expand(g, p)
            scale_b = y_scale.float().reshape(g, 1).expand(g, q)
        else:  # ROWWISE: x_scale [P], y_scale [Q], shared by every group
            scale_a = x_scale.float().reshape(1, p).expand(g, p)
            scale_b = y_scale.float().reshape(1, q).expand(g, q)
        return torch._scaled_grouped_mm(
            x.t(), y, scale_a.reshape(-1).contiguous(), scale_b.reshape(-1).contiguous(),
            offs=cutlass_offsets(group_lens, m), out_dtype=out_dtype, use_fast_accum=True,
        )  # fmt: skip


class GroupedGemmFP8VariableKDispatcher(AutoKernelDispatcher):
    op_name = "grouped_gemm"
    # CUTLASS last: the fallback order never reaches it (TORCH always can)
    backends = {
        BackendType.TRITON: FP8VariableKTritonBackend,
        BackendType.TORCH: FP8VariableKTorchBackend,
        BackendType.CUTLASS: FP8VariableKCutlassBackend,
    }
    # The caller's promise that every group holds a multiple of 16 tokens: only then
    # may CUTLASS be chosen without being pinned (default and autotune). Unaligned groups make
    # torch._scaled_grouped_mm device-assert, which no try/except (autotune's included) survives.
    group_lens_multiple_of_16: ClassVar[bool] = False

    @classmethod
    def make_key(cls, x, y, group_lens, scale_mode, out_dtype, **kw) -> tuple:
        shapes = (tuple(x.shape), tuple(y.shape), tuple(x.stride()), tuple(y.stride()))
        return ("fp8_wgrad", *shapes, int(group_lens.shape[0]), x.dtype, scale_mode, out_dtype)

    @classmethod
    def candidates(cls, **kw) -> list[BackendType]:
        found = super().candidates(**kw)
        if cls.group_lens_multiple_of_16:
            return found
        return [b for b in found if b is not BackendType.CUTLASS]

    @classmethod
    def default_backend(cls, x, **kw):
        if x.device.type == "cpu":
            return BackendType.TORCH
        # E4M3 -> bf16 on sm_90 with aligned groups: CUTLASS 565 TFLOP/s vs ~395 for Triton (H200)
        if cls.group_lens_multiple_of_16 and FP8VariableKCutlassBackend.can_handle(x=x, **kw):
            return BackendType.CUTLASS
        return BackendType.TRITON


@eager_direct
@torch.library.custom_op("primus_turbo::grouped_gemm_fp8", mutates_args=())
def grouped_gemm_fp8_impl(
    a: torch.Tensor,
    b_view: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    group_lens: torch.Tensor,
    scale_mode: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return GroupedGemmFP8Dispatcher.dispatch(
        a=a,
        b_view=b_view,
        a_scale=a_scale,
        b_scale=b_scale,
        group_lens=group_lens,
        scale_mode=scale_mode,
        out_dtype=out_dtype,
    )


@grouped_gemm_fp8_impl.register_fake
def _(a, b_view, a_scale, b_scale, group_lens, scale_mode, out_dtype):
    return a.new_empty(a.shape[0], b_view.shape[2], dtype=out_dtype)


@eager_direct
@torch.library.custom_op("primus_turbo::grouped_gemm_fp8_variable_k", mutates_args=())
def grouped_gemm_fp8_variable_k_impl(
    x: torch.Tensor,
    y: torch.Tensor,
    x_scale: torch.Tensor,
    y_scale: torch.Tensor,
    group_lens: torch.Tensor,
    scale_mode: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return GroupedGemmFP8VariableKDispatcher.dispatch(
        x=x,
        y=y,
        x_scale=x_scale,
        y_scale=y_scale,
        group_lens=group_lens,
        scale_mode=scale_mode,
        out_dtype=out_dtype,
    )


@grouped_gemm_fp8_variable_k_impl.register_fake
def _(x, y, x_scale, y_scale, group_lens, scale_mode, out_dtype):
    return x.new_empty(group_lens.shape[0], x.shape[1], y.shape[1], dtype=out_dtype)


__all__ += ["SCALE_TENSORWISE", "SCALE_ROWWISE", "SCALE_BLOCKWISE", "dequantize_operands"]
