"""Grouped GEMM (bf16/fp16/fp32) backends, dispatchers and torch.library custom ops.

Two problems, one dispatcher each (both answer to PRIMUS_TURBO_GROUPED_GEMM_BACKEND):

* grouped GEMM (forward and dgrad): ``out[rows_g] = a[rows_g] @ B_g`` with B_g = b[g] ([K, N]) or
  b[g]^T when ``trans_b`` (b is then [G, N, K]);
* variable-K grouped GEMM (wgrad): ``out[g] = x[rows_g]^T @ y[rows_g]`` -> [G, P, Q];
* the same into a given buffer, in place (``out[g] (+)= ...``, e.g. fp32 gradients of bf16 GEMMs): its own
  dispatcher, PRIMUS_TURBO_GROUPED_WGRAD_ACCUMULATE_BACKEND (TRITON adds in the GEMM's epilogue; CUTLASS and
  TORCH compute the gradient, then add it in one more pass).

Backends:
  CUTLASS  torch._grouped_mm (bf16, 16-byte aligned strides: K and N multiples of 8). Offsets are
           cumsum(group_lens) clamped to M; output rows past the last group are zeroed (not
           computed), as in the TRITON kernels; the ops layer computes the offsets once per forward
           (``offs``) and reuses them in dgrad and wgrad.
           Wgrad outputs of empty groups: exact zeros from the sm_90 kernel itself (pytorch#172439,
           #192497: Hopper writes zeros, Blackwell did not), masked to zeros on other devices.
  TRITON   persistent sync-free kernels (primus_turbo/triton/grouped_gemm); bf16 / fp16 operands a TMA
           descriptor can cover (sm_90, 16-byte aligned rows) take the TMA kernels, the rest the pointer ones.
  TORCH    a per-group loop of matmuls; the reference and the CPU default. It is the ONLY backend
           that synchronises with the host (it reads group_lens with .tolist()): the autotuner never
           times it on CUDA inputs (``syncs_host``).
"""

from __future__ import annotations

import torch

from primus_turbo.pytorch.core.backend import AutoKernelDispatcher, BackendType, KernelBackend
from primus_turbo.pytorch.core.main_grad import add_into_
from primus_turbo.pytorch.core.utils import eager_direct, triton_can_run_on, zero_rows_from
from primus_turbo.triton.grouped_gemm.grouped_gemm_kernel import (
    SCALE_NONE,
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
    "GroupedGemmDispatcher",
    "GroupedGemmVariableKDispatcher",
    "grouped_gemm_impl",
    "grouped_gemm_variable_k_impl",
    "GroupedWgradIntoDispatcher",
    "grouped_gemm_variable_k_into_",
    "cutlass_offsets",
    "zero_tail",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _b_view(b: torch.Tensor, trans_b: bool) -> torch.Tensor:
    """b as [G, K, N] (a strided view, no copy)."""
    return b.transpose(1, 2) if trans_b else b


def cutlass_offsets(group_lens: torch.Tensor, total: int) -> torch.Tensor:
    """int32 end offsets for torch._grouped_mm: cumsum(group_lens) clamped to ``total``. Device-side only.

    Rows past the last offset (sum(group_lens) < M: a sync-free upper-bound buffer such as the TURBO EP
    dispatcher's, or inconsistent inputs) belong to no group: torch._grouped_mm skips them, so they cost
    no GEMM time, take no part in a weight gradient, and ``zero_tail`` zeroes them in an [M, N] output
    (the TRITON kernels do the same), so nothing is left uninitialised.
    """
    return torch.cumsum(group_lens, 0, dtype=torch.int32).clamp_(0, total)


def zero_tail(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero the rows of a grouped GEMM output [M, N] past the last group end ``offs[-1]`` (no host sync)."""
    if out.shape[0] and offs.numel():
        zero_rows_from(out, None, offs[-1])
    return out


def _offsets(group_lens, total, offs):
    return cutlass_offsets(group_lens, total) if offs is None else offs


def _is_sm90_plus(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.get_device_capability(t.device) >= (9, 0)


# -- forward / dgrad ------------------------------------------------------------------------------
class GroupedGemmTorchBackend(KernelBackend):
    syncs_host = True  # reads group_lens on the host: never autotuned on CUDA

    @staticmethod
    def can_handle(a, b, **kw) -> bool:
        return a.dtype in _FLOAT_DTYPES

    @staticmethod
    def execute(a, b, group_lens, trans_b, **kw):
        bv = _b_view(b, trans_b)
        out = torch.zeros(a.shape[0], bv.shape[2], dtype=a.dtype, device=a.device)
        start = 0
        for g, n in enumerate(group_lens.tolist()):  # host sync: reference backend only
            if n > 0:
                torch.mm(a[start : start + n], bv[g], out=out[start : start + n])
            start += n
        return out


class GroupedGemmCutlassBackend(KernelBackend):
    @staticmethod
    def can_handle(a, b, trans_b, **kw) -> bool:
        if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            return False
        if not (_is_sm90_plus(a) or a.device.type == "cpu"):
            return False
        n = b.shape[1] if trans_b else b.shape[2]
        return a.shape[1] % 8 == 0 and n % 8 == 0  # (0 included: an empty problem is answered directly)

    @staticmethod
    def execute(a, b, group_lens, trans_b, offs=None, **kw):
        n = b.shape[1] if trans_b else b.shape[2]
        if min(a.shape[0], a.shape[1], n) == 0:  # e.g. an EP rank that received no token
            return a.new_zeros(a.shape[0], n)
        offs = _offsets(group_lens, a.shape[0], offs)
        return zero_tail(torch._grouped_mm(a, _b_view(b, trans_b), offs=offs), offs)


class GroupedGemmTritonBackend(KernelBackend):
    @staticmethod
    def can_handle(a, b, group_lens, **kw) -> bool:
        return a.dtype in _FLOAT_DTYPES and triton_can_run_on(a, b, group_lens) and b.shape[0] < 4096

    @staticmethod
    def execute(a, b, group_lens, trans_b, **kw):
        bv = _b_view(b, trans_b)
        out = torch.empty(a.shape[0], bv.shape[2], dtype=a.dtype, device=a.device)
        if out.numel() == 0:
            return out
        if tma_forward_supported(a, bv, SCALE_NONE):
            return launch_grouped_gemm_tma(a, bv, out, group_lens)
        return launch_grouped_gemm(a, bv, out, group_lens)


class GroupedGemmDispatcher(AutoKernelDispatcher):
    op_name = "grouped_gemm"
    # CUTLASS and the TMA kernel are within a few percent at many shapes, where autotune's 10 timed runs
    # picked differently from call to call (session 25 bench rows): keep the measured default there
    autotune_margin = 0.03
    backends = {
        BackendType.CUTLASS: GroupedGemmCutlassBackend,
        BackendType.TRITON: GroupedGemmTritonBackend,
        BackendType.TORCH: GroupedGemmTorchBackend,
    }

    @classmethod
    def make_key(cls, a, b, trans_b, **kw) -> tuple:
        return ("fwd", tuple(a.shape), tuple(b.shape), a.dtype, bool(trans_b), a.device.type)

    @classmethod
    def default_backend(cls, a, b, trans_b, **kw):
        """bf16: the TMA Triton kernel unless the output is wide against the reduction (N >= 3.5 K).
        H200 GPU time against CUTLASS (sweep_grouped_gemm_bf16, session 25): forward / dgrad 1.08-1.25x
        at DeepSeek-V2-Lite fc1 / fc2 and DeepSeek-V3 fc1 (skewed), 1.02x for the dgrad of Mixtral and
        DeepSeek-V3 fc2; 0.95x / 0.97x for those two forwards (N / K = 7 and 3.5), which stay on CUTLASS."""
        if a.device.type == "cpu":
            return BackendType.TORCH
        if a.dtype != torch.bfloat16:
            return BackendType.TRITON
        bv = _b_view(b, trans_b)
        if 2 * bv.shape[2] < 7 * bv.shape[1] and tma_forward_supported(a, bv, SCALE_NONE):
            return BackendType.TRITON
        return BackendType.CUTLASS


# -- variable-K (wgrad) ---------------------------------------------------------------------------
class VariableKTorchBackend(KernelBackend):
    syncs_host = True  # reads group_lens on the host: never autotuned on CUDA

    @staticmethod
    def can_handle(x, **kw) -> bool:
        return x.dtype in _FLOAT_DTYPES

    @staticmethod
    def execute(x, y, group_lens, **kw):
        out = torch.zeros(group_lens.shape[0], x.shape[1], y.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for g, n in enumerate(group_lens.tolist()):  # host sync: reference backend only
            if n > 0:
                torch.mm(x[start : start + n].t(), y[start : start + n], out=out[g])
            start += n
        return out


class VariableKCutlassBackend(KernelBackend):
    @staticmethod
    def can_handle(x, y, **kw) -> bool:
        if x.dtype != torch.bfloat16 or y.dtype != torch.bfloat16:
            return False
        if not (_is_sm90_plus(x) or x.device.type == "cpu"):
            return False
        return x.shape[1] % 8 == 0 and y.shape[1] % 8 == 0  # (0 included: answered directly)

    @staticmethod
    def execute(x, y, group_lens, offs=None, **kw):
        if min(x.shape[0], x.shape[1], y.shape[1]) == 0:  # no row (or an empty operand): dW = 0
            return x.new_zeros(group_lens.numel(), x.shape[1], y.shape[1])
        out = torch._grouped_mm(x.t(), y, offs=_offsets(group_lens, x.shape[0], offs))
        if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9:
            return out  # sm_90 CUTLASS writes exact zeros for empty groups: no extra pass over dW
        # elsewhere: guarantee exact zeros whatever the library leaves there
        return torch.where((group_lens > 0).view(-1, 1, 1), out, out.new_zeros(()))


class VariableKTritonBackend(KernelBackend):
    @staticmethod
    def can_handle(x, y, group_lens, **kw) -> bool:
        return x.dtype in _FLOAT_DTYPES and triton_can_run_on(x, y, group_lens) and group_lens.shape[0] < 4096

    @staticmethod
    def execute(x, y, group_lens, **kw):
        out = torch.empty(group_lens.shape[0], x.shape[1], y.shape[1], dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        if tma_variable_k_supported(x, y):
            return launch_grouped_gemm_variable_k_tma(x, y, out, group_lens)
        return launch_grouped_gemm_variable_k(x, y, out, group_lens)


class GroupedGemmVariableKDispatcher(AutoKernelDispatcher):
    op_name = "grouped_gemm"
    autotune_margin = 0.03  # as GroupedGemmDispatcher
    backends = {
        BackendType.CUTLASS: VariableKCutlassBackend,
        BackendType.TRITON: VariableKTritonBackend,
        BackendType.TORCH: VariableKTorchBackend,
    }

    @classmethod
    def make_key(cls, x, y, group_lens, **kw) -> tuple:
        return ("wgrad", tuple(x.shape), tuple(y.shape), int(group_lens.shape[0]), x.dtype, x.device.type)

    @classmethod
    def default_backend(cls, x, **kw):
        if x.device.type == "cpu":
            return BackendType.TORCH
        return BackendType.CUTLASS if x.dtype == torch.bfloat16 else BackendType.TRITON


# -- custom ops (torch.compile traces through these) ----------------------------------------------
@eager_direct
@torch.library.custom_op("primus_turbo::grouped_gemm", mutates_args=())
def grouped_gemm_impl(
    a: torch.Tensor,
    b: torch.Tensor,
    group_lens: torch.Tensor,
    trans_b: bool,
    offs: torch.Tensor | None = None,
) -> torch.Tensor:
    """offs: optional precomputed ``cutlass_offsets(group_lens, a.shape[0])`` (CUTLASS only)."""
    return GroupedGemmDispatcher.dispatch(a=a, b=b, group_lens=group_lens, trans_b=trans_b, offs=offs)


@grouped_gemm_impl.register_fake
def _(a, b, group_lens, trans_b, offs=None):
    n = b.shape[1] if trans_b else b.shape[2]
    return a.new_empty(a.shape[0], n)


@eager_direct
@torch.library.custom_op("primus_turbo::grouped_gemm_variable_k", mutates_args=())
def grouped_gemm_variable_k_impl(
    x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor, offs: torch.Tensor | None = None
) -> torch.Tensor:
    return GroupedGemmVariableKDispatcher.dispatch(x=x, y=y, group_lens=group_lens, offs=offs)


@grouped_gemm_variable_k_impl.register_fake
def _(x, y, group_lens, offs=None):
    return x.new_empty(group_lens.shape[0], x.shape[1], y.shape[1])


# -- variable-K into a given buffer, in place: out[g] = / += x[rows_g]^T @ y[rows_g] ---------------
_HALF = (torch.bfloat16, torch.float16)


class WgradIntoTritonBackend(KernelBackend):
    """The variable-K kernel writing (``accumulate``: adding, summed in fp32) into ``out`` directly."""

    @staticmethod
    def can_handle(x, y, group_lens, out, **kw) -> bool:
        return (
            x.dtype in _HALF and y.dtype == x.dtype and out.dtype in _FLOAT_DTYPES
            and triton_can_run_on(x, y, group_lens, out) and group_lens.shape[0] < 4096
        )  # fmt: skip

    @staticmethod
    def execute(x, y, group_lens, out, accumulate, reverse_groups=False, **kw):
        rev = {"reverse_groups": reverse_groups}
        if tma_variable_k_supported(x, y):
            launch_grouped_gemm_variable_k_tma(x, y, out, group_lens, accumulate=int(accumulate) * 2, **rev)
            return
        if not accumulate:
            launch_grouped_gemm_variable_k(x, y, out, group_lens, **rev)
            return
        # C read as the accumulator's start (its load leaves before the K loop), 4 stages: H200, deepseek_moe
        # experts, fc1 1.65 ms / fc2 0.95 against CUTLASS + the add pass 1.75 / 0.95 and the epilogue read
        # 2.16 / 1.19 (bench_expert_wgrad_accumulate, session 18)
        config = {"num_stages": 4} if x.is_cuda else None
        launch_grouped_gemm_variable_k(x, y, out, group_lens, accumulate=2, config=config, **rev)


def _compute_then_add(variable_k: type[KernelBackend]) -> type[KernelBackend]:
    """A wgrad-into backend from a variable-K one: its gradient (x's dtype), then copied / added into out."""

    class ComputeThenAdd(KernelBackend):
        syncs_host = variable_k.syncs_host

        @staticmethod
        def can_handle(x, y, group_lens, out, offs=None, **kw) -> bool:
            handles = variable_k.can_handle(x=x, y=y, group_lens=group_lens, offs=offs)
            return out.dtype in _FLOAT_DTYPES and handles

        @staticmethod
        def execute(x, y, group_lens, out, accumulate, offs=None, reverse_groups=False, **kw):
            grad = variable_k.execute(x=x, y=y, group_lens=group_lens, offs=offs)
            if accumulate:  # group g belongs in out[G-1-g] when reverse_groups
                add_into_(out, grad, reverse_groups)
            else:
                out.copy_(grad.flip(0) if reverse_groups else grad)

    ComputeThenAdd.__name__ = f"{variable_k.__name__}ThenAdd"
    return ComputeThenAdd


class GroupedWgradIntoDispatcher(AutoKernelDispatcher):
    op_name = "grouped_wgrad_accumulate"
    autotune = False  # in place: timing every candidate would add the gradient several times
    cache_default = True  # the choice depends on make_key's fields only
    backends = {
        BackendType.TRITON: WgradIntoTritonBackend,
        BackendType.CUTLASS: _compute_then_add(VariableKCutlassBackend),
        BackendType.TORCH: _compute_then_add(VariableKTorchBackend),
    }

    @classmethod
    def make_key(cls, x, y, group_lens, out, accumulate, reverse_groups=False, **kw) -> tuple:
        return ("wgrad_into", tuple(x.shape), tuple(y.shape), int(group_lens.shape[0]), x.dtype, out.dtype,
                bool(accumulate), bool(reverse_groups), x.device.type)  # fmt: skip

    @classmethod
    def default_backend(cls, x, accumulate=False, **kw):
        """Measured on an H200 (deepseek_moe_fp8 experts, 49152 routed rows): writing fp32, TRITON beats
        CUTLASS + a cast (fc1 1.49 vs 1.91 ms, fc2 0.81 vs 1.01; bench_expert_wgrad_accumulate, session 18).
        Adding: with balanced experts TRITON (C read as the accumulator's start) beats CUTLASS + the add pass
        by 5-10% (fc1 1.69 vs 1.79 ms, fc2 0.87 vs 0.97, session 26), but with the recipe's real routing it
        lost inside Megatron's step: 36.05 ms of fused wgrad kernels per step against 17.24 (CUTLASS) + 15.68
        (add) (torch.profiler, same machine): CUTLASS + add where it can run (bf16 on sm_90), else TRITON."""
        if x.device.type == "cpu":
            return BackendType.TORCH
        return BackendType.CUTLASS if accumulate else BackendType.TRITON


@eager_direct
@torch.library.custom_op("primus_turbo::grouped_gemm_variable_k_into_", mutates_args=("out",))
def grouped_gemm_variable_k_into_(
    x: torch.Tensor, y: torch.Tensor, group_lens: torch.Tensor, out: torch.Tensor, accumulate: bool,
    offs: torch.Tensor | None = None, reverse_groups: bool = False,
) -> None:  # fmt: skip
    """``out[g] = x[rows_g]^T @ y[rows_g]`` (``accumulate``: ``+=``, summed in fp32) for out [G, P, Q] of any
    float dtype and strides; empty groups: zeros (accumulate: unchanged). ``offs``: CUTLASS offsets.
    ``reverse_groups``: group g's result goes to out[G-1-g] (buffers laid out in reverse group order, as
    Megatron's DDP lays out the experts' main_grads)."""
    GroupedWgradIntoDispatcher.dispatch(
        x=x, y=y, group_lens=group_lens, out=out, accumulate=accumulate, offs=offs,
        reverse_groups=reverse_groups,
    )  # fmt: skip


@grouped_gemm_variable_k_into_.register_fake
def _(x, y, group_lens, out, accumulate, offs=None, reverse_groups=False):
    return None
