"""Compile every attention Triton kernel for sm_90 at the real tile configs (no GPU needed).

Catches GPU-only compile errors and shared-memory overflow (> 227 KB) that the interpreter cannot.
"""

from __future__ import annotations

import inspect

from triton_compile_utils import compile_for_sm90, run_compile_check

from primus_turbo.pytorch.kernels.attention.attention_triton_impl import (
    block_dim,
    bwd_dkdv_config,
    bwd_dq_config,
    fwd_config,
    qk_dim_split,
)
from primus_turbo.triton.attention import attention_bwd_dkdv_kernel, attention_bwd_dq_kernel, attention_kernel

_MODULES = (attention_kernel, attention_bwd_dkdv_kernel, attention_bwd_dq_kernel)


def _kernel(name: str):
    return next(getattr(m, name) for m in _MODULES if hasattr(m, name))


_FLOAT_ARGS = {"qk_scale", "sm_scale"}
_FP32_PTRS = {"LSE", "SINK", "DELTA"}
_I32_PTRS = {"CU_Q", "CU_K"}


def _signature(kernel, dtype: str) -> dict:
    sig = {}
    for name in inspect.signature(_kernel(kernel).fn).parameters:
        if name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name in _I32_PTRS:
            sig[name] = "*i32"
        elif name in _FLOAT_ARGS:
            sig[name] = "fp32"
        elif name in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"):
            sig[name] = f"*{dtype}"  # Q, K, V, Out, DO, DQ, DK, DV
        elif name.isupper():
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    return sig


# (d_qk, d_v, varlen, has_left, has_right, has_sink): Llama d128 causal, MLA 192/128 causal varlen,
# d256 sliding window with sink, d64 varlen without any mask (fp16 shares every path with bf16).
CONFIGS = [
    (128, 128, False, False, True, False),
    (192, 128, True, False, True, False),
    (256, 256, False, True, True, True),
    (64, 64, True, False, False, False),
]


def _dims(d_qk, d_v, varlen, left, right):
    return dict(D_QK=d_qk, D_V=d_v, BLOCK_DQK=qk_dim_split(d_qk)[0],
                  BLOCK_DQK1=qk_dim_split(d_qk)[1], BLOCK_DV=block_dim(d_v), IS_VARLEN=varlen,
                HAS_LEFT=left, HAS_RIGHT=right)  # fmt: skip


def _compile_fwd(cfg):
    d_qk, d_v, varlen, left, right, sink = cfg
    block_m, block_n, warps, stages = fwd_config(d_qk, d_v, interpret=False)
    const = dict(_dims(d_qk, d_v, varlen, left, right), BLOCK_M=block_m, BLOCK_N=block_n, HAS_SINK=sink)
    compiled = compile_for_sm90(
        _kernel("attn_fwd_kernel"), _signature("attn_fwd_kernel", "bf16"), const, warps, stages
    )
    assert "wgmma" in compiled.asm["ptx"], f"fwd {cfg}: no wgmma (mma.sync fallback)"
    print(f"fwd {cfg}: {compiled.metadata.shared} B shared", flush=True)


def _compile_bwd(cfg):
    d_qk, d_v, varlen, left, right, _ = cfg
    dims = _dims(d_qk, d_v, varlen, left, right)
    block_m, block_n, warps, stages = bwd_dkdv_config(d_qk, d_v, interpret=False)
    sig = _signature("attn_bwd_dkdv_kernel", "bf16")
    compiled = compile_for_sm90(
        _kernel("attn_bwd_dkdv_kernel"), sig, dict(dims, BLOCK_M=block_m, BLOCK_N=block_n), warps, stages
    )
    print(f"dkdv {cfg}: {compiled.metadata.shared} B shared, wgmma {'wgmma' in compiled.asm['ptx']}")
    block_m, block_n, warps, stages = bwd_dq_config(d_qk, d_v, interpret=False)
    sig = _signature("attn_bwd_dq_kernel", "bf16")
    compiled = compile_for_sm90(
        _kernel("attn_bwd_dq_kernel"), sig, dict(dims, BLOCK_M=block_m, BLOCK_N=block_n), warps, stages
    )
    print(f"dq {cfg}: {compiled.metadata.shared} B shared, wgmma {'wgmma' in compiled.asm['ptx']}")
    pre = dict(D_V=d_v, BLOCK_DV=block_dim(d_v), BLOCK_M=64, IS_VARLEN=varlen)
    compile_for_sm90(
        _kernel("attn_bwd_preprocess_kernel"), _signature("attn_bwd_preprocess_kernel", "bf16"), pre
    )


def _compile_all() -> None:
    for cfg in CONFIGS:
        _compile_fwd(cfg)
        _compile_bwd(cfg)


def test_attention_kernels_compile_for_sm90():
    """In a fresh process without TRITON_INTERPRET: in an interpreter process even the @jit helpers
    are interpreter wrappers that cannot be compiled."""
    run_compile_check(__file__)


if __name__ == "__main__":
    _compile_all()
    print("attention kernels compile for sm_90")
