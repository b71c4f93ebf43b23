"""turbo.ops.rmsnorm / rmsnorm_residual: every backend x dtype vs an fp64 reference (odd hidden
sizes included), zero-size dims, non-contiguous inputs, bad input, backend pinning, torch.compile
tracing, sm_90 compilation of the Triton kernels; GPU: TURBO (csrc) at training shapes."""

import pytest
import torch
from ref.rmsnorm_ref import rmsnorm_grads_ref, rmsnorm_ref
from test_utils import assert_close, get_tolerances
from triton_compile_utils import compile_for_sm90, run_compile_check

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core.backend import BackendType
from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION
from primus_turbo.pytorch.kernels.normalization.rmsnorm_impl import (
    RMSNormDispatcher,
    rmsnorm_bwd_impl,
    rmsnorm_fwd_impl,
    rmsnorm_residual_fwd_impl,
    turbo_max_hidden,
)
from primus_turbo.triton.normalization import rmsnorm_kernel as rk

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HIDDEN = [1, 7, 100, 2048, 5120, 7168]
CPU_BACKENDS = ["TORCH", "TRITON", pytest.param("TURBO", marks=pytest.mark.gpu)]
needs_turbo = pytest.mark.skipif(not HAS_CPP_EXTENSION, reason="primus_turbo.pytorch._C not built")


def _inputs(shape, dtype, device, zero_centered_gamma=False):
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_()
    scale = 0.1 if zero_centered_gamma else 1.0  # stored gamma - 1 is small around 0
    w = (torch.randn(shape[-1], device=device) * 0.5 * scale + (0.0 if zero_centered_gamma else 1.0)).to(
        dtype
    )
    return x, w.requires_grad_()


def _assert_dweight(out, ref, dtype, rows, msg):
    """dweight is a sum over all rows: its absolute rounding error grows ~sqrt(rows) (fp32 partial
    sums, per-row rstd rounding), while entries whose sum cancels to ~0 get only atol. Scale atol by
    sqrt(rows / 4096) beyond 4096 rows (32768 rows: x2.8); rtol stays the dtype's."""
    tol = get_tolerances(dtype)
    atol = tol["atol"] * max(1.0, (rows / 4096) ** 0.5)
    assert not torch.isnan(out).any(), f"{msg}: output has NaN"
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=tol["rtol"], atol=atol, msg=lambda m: f"{msg}: {m}"
    )


def _check_plain(shape, dtype, device, backend, zero_centered_gamma=False, eps=1e-6):
    x, w = _inputs(shape, dtype, device, zero_centered_gamma)
    y = turbo.ops.rmsnorm(x, w, eps=eps, zero_centered_gamma=zero_centered_gamma, backend=backend)
    assert RMSNormDispatcher.last_backend == BackendType[backend]
    assert y.shape == x.shape and y.dtype == dtype
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_y, _ = rmsnorm_ref(x, w, eps, zero_centered_gamma)
    ref_dx, ref_dw = rmsnorm_grads_ref(x, w, dy, eps, zero_centered_gamma)
    tag = f"{backend} {dtype} {tuple(shape)} zcg={zero_centered_gamma}"
    assert_close(y, ref_y, dtype, msg=f"y {tag}")
    assert x.grad.shape == x.shape and w.grad.shape == w.shape and w.grad.dtype == dtype
    assert_close(x.grad, ref_dx, dtype, msg=f"dx {tag}")
    _assert_dweight(w.grad, ref_dw, dtype, x.numel() // max(shape[-1], 1), f"dweight {tag}")


def _check_residual(shape, dtype, device, backend, use_sum_grad=True):
    x, w = _inputs(shape, dtype, device)
    res = torch.randn(shape, dtype=dtype, device=device).requires_grad_()
    y, s = turbo.ops.rmsnorm_residual(x, res, w, backend=backend)
    assert RMSNormDispatcher.last_backend == BackendType[backend]
    tag = f"residual {backend} {dtype} {tuple(shape)} sum_grad={use_sum_grad}"
    assert_close(s, rmsnorm_ref(x, w, residual=res)[1], dtype, msg=f"sum {tag}")
    # y and the gradients are checked against the s the op returned (just checked ~= x + residual):
    # the Triton interpreter rounds fp32 -> bf16 differently from torch (the GPU rounds to nearest
    # even, like torch), and a one-ulp difference in s shows up in y and in dweight.
    assert_close(y, rmsnorm_ref(s, w)[0], dtype, msg=f"y {tag}")
    if dtype == torch.float32 or backend != "TRITON" or torch.cuda.is_available():
        assert torch.equal(s, x + res), f"sum {tag}: not bitwise x + residual"
    dy = torch.randn_like(y)
    ds = torch.randn_like(s) if use_sum_grad else None
    torch.autograd.backward([y, s] if use_sum_grad else [y], [dy, ds] if use_sum_grad else [dy])
    ref_dx, ref_dw = rmsnorm_grads_ref(s, w, dy, dsum=ds)
    assert_close(x.grad, ref_dx, dtype, msg=f"dx {tag}")
    assert_close(res.grad, ref_dx, dtype, msg=f"dresidual {tag}")
    _assert_dweight(w.grad, ref_dw, dtype, x.numel() // max(shape[-1], 1), f"dweight {tag}")


# -- numerics on CPU (TORCH, TRITON interpreter) -----------------------------------------------------
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rmsnorm(backend, dtype, hidden, device):
    _check_plain((2, 3, hidden), dtype, device, backend, zero_centered_gamma=hidden % 2 == 1)


@pytest.mark.parametrize("hidden", [7, 100, 2048])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rmsnorm_residual(backend, dtype, hidden, device):
    _check_residual((5, hidden), dtype, device, backend, use_sum_grad=True)
    _check_residual((3, hidden), dtype, device, backend, use_sum_grad=False)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_rmsnorm_many_rows_and_eps(backend, device):
    # 130 rows: several Triton row blocks per backward program; large eps changes rstd visibly.
    _check_plain((130, 64), torch.float32, device, backend, eps=0.5)


@pytest.mark.parametrize("hidden", [4096, 4100, 7168])
def test_triton_forward_wide_rows(hidden, device):
    # 2049-8192 columns: the TRITON forward runs the row-per-program two-pass kernel (the row length a
    # compile-time constant; 4100 and 7168: a masked tail in its one 8192-column chunk)
    _check_plain((3, hidden), torch.float32, device, "TRITON", zero_centered_gamma=True)
    _check_residual((2, hidden), torch.float32, device, "TRITON", use_sum_grad=True)


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (4, 0)])
def test_zero_size(backend, shape, device):
    x, w = _inputs(shape, torch.float32, device)
    y = turbo.ops.rmsnorm(x, w, backend=backend)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))
    res = torch.randn(shape, device=device)
    y, s = turbo.ops.rmsnorm_residual(x.detach(), res, w.detach(), backend=backend)
    assert y.shape == s.shape == x.shape


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
def test_non_contiguous(backend, device):
    base = torch.randn(6, 40, dtype=torch.float32, device=device)
    x = base[:, ::2].detach().requires_grad_()  # [6, 20], last-dim stride 2
    assert not x.is_contiguous()
    w = torch.randn(x.shape[-1], device=device).requires_grad_()
    y = turbo.ops.rmsnorm(x, w, backend=backend)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_dx, ref_dw = rmsnorm_grads_ref(x, w, dy)
    assert_close(y, rmsnorm_ref(x, w)[0], torch.float32, msg="y non-contiguous")
    assert_close(x.grad, ref_dx, torch.float32, msg="dx non-contiguous")
    assert_close(w.grad, ref_dw, torch.float32, msg="dweight non-contiguous")
    # non-contiguous upstream gradient too
    x2 = x.detach().clone().requires_grad_()
    y2 = turbo.ops.rmsnorm(x2, w.detach(), backend=backend)
    g = torch.randn(y2.shape[1], y2.shape[0], device=device).t()
    y2.backward(g)
    assert_close(x2.grad, rmsnorm_grads_ref(x2, w, g)[0], torch.float32, msg="dx with strided dy")


def test_default_backend_rule_per_stage():
    class _CudaLike:  # only .is_cuda and .numel() are read by the rule
        is_cuda = True

        def __init__(self, rows, hidden):
            self.n = rows * hidden

        def numel(self):
            return self.n

    small, large = _CudaLike(32768, 4096), _CudaLike(32768, 4104)  # 128M elements: the last TURBO forward
    assert RMSNormDispatcher.default_backend(stage="fwd", x=small) == BackendType.TURBO
    assert RMSNormDispatcher.default_backend(stage="fwd", x=large) == BackendType.TRITON
    assert RMSNormDispatcher.default_backend(stage="bwd", x=small) == BackendType.TURBO
    assert RMSNormDispatcher.default_backend(stage="bwd", x=large) == BackendType.TURBO
    assert RMSNormDispatcher.default_backend(stage="bwd", x=torch.empty(1)) == BackendType.TORCH


def test_default_backend_cpu_is_torch():
    x, w = _inputs((3, 8), torch.float32, "cpu")
    turbo.ops.rmsnorm(x, w)
    assert RMSNormDispatcher.last_backend == BackendType.TORCH


# -- bad input -----------------------------------------------------------------------------------
def test_bad_input():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        turbo.ops.rmsnorm(x, torch.ones(7))
    with pytest.raises(ValueError, match="weight must have shape"):
        turbo.ops.rmsnorm(x, torch.ones(1, 8))
    with pytest.raises(TypeError, match="weight dtype torch.bfloat16 != x dtype torch.float32"):
        turbo.ops.rmsnorm(x, w.bfloat16())
    with pytest.raises(TypeError, match="float64 is not supported"):
        turbo.ops.rmsnorm(x.double(), w.double())
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        turbo.ops.rmsnorm([1.0, 2.0], w)
    with pytest.raises(ValueError, match="weight is on meta but x is on cpu"):
        turbo.ops.rmsnorm(x, w.to("meta"))
    with pytest.raises(ValueError, match="0-dim"):
        turbo.ops.rmsnorm(torch.tensor(1.0), torch.ones(1))
    for eps in (0.0, -1e-6, float("nan"), float("inf"), "1e-6", True):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            turbo.ops.rmsnorm(x, w, eps=eps)
    with pytest.raises(ValueError, match=r"residual shape \[4, 7\] != x shape \[4, 8\]"):
        turbo.ops.rmsnorm_residual(x, torch.randn(4, 7), w)
    with pytest.raises(TypeError, match="residual dtype"):
        turbo.ops.rmsnorm_residual(x, x.half(), w)
    with pytest.raises(ValueError, match="residual is on meta"):
        turbo.ops.rmsnorm_residual(x, x.to("meta"), w)
    with pytest.raises(ValueError, match="unknown backend 'cudnnx'"):
        turbo.ops.rmsnorm(x, w, backend="cudnnx")
    with pytest.raises(ValueError, match="backend CUBLAS is not implemented"):
        turbo.ops.rmsnorm(x, w, backend="CUBLAS")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal of TURBO")
def test_pinned_turbo_on_cpu_refuses():
    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(
        ValueError, match="backend TURBO cannot handle these inputs.*backends that can: TRITON, TORCH"
    ):
        turbo.ops.rmsnorm(x, w, backend=BackendType.TURBO)


def test_turbo_max_hidden_rule():
    aligned = torch.empty(64, dtype=torch.bfloat16)
    assert turbo_max_hidden(7168, torch.bfloat16, [aligned]) == 16384
    assert turbo_max_hidden(7168, torch.float32, [aligned.float()]) == 8192
    assert turbo_max_hidden(7, torch.bfloat16, [aligned]) == 4096
    assert turbo_max_hidden(7168, torch.bfloat16, [aligned[1:]]) == 4096  # 2-byte offset: scalar path


# -- tracing, custom-op contracts ----------------------------------------------------------------
def test_opcheck_custom_ops():
    x, w = torch.randn(5, 24), torch.randn(24)
    res = torch.randn(5, 24)
    torch.library.opcheck(rmsnorm_fwd_impl, (x, w, 1e-6, False, "TORCH"))
    torch.library.opcheck(rmsnorm_residual_fwd_impl, (x, res, w, 1e-6, False, "TORCH"))
    y, rstd = rmsnorm_fwd_impl(x, w, 1e-6, False, "TORCH")
    for dsum in (None, res):
        torch.library.opcheck(rmsnorm_bwd_impl, (torch.randn_like(y), x, w, rstd, dsum, True, "TORCH"))


@pytest.mark.parametrize("backend", [None, " torch ", BackendType.TORCH])
def test_torch_compile_fullgraph(backend):
    # backend= as a string / enum is parsed inside the traced region: must not graph-break
    def f(x, r, w):
        y, s = turbo.ops.rmsnorm_residual(x, r, w, backend=backend)
        return turbo.ops.rmsnorm(y + s, w, zero_centered_gamma=True, backend=backend)

    x, w = _inputs((4, 32), torch.float32, "cpu")
    r = torch.randn(4, 32)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, r, w)
    out.sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    f(x_ref, r, w_ref).sum().backward()
    assert_close(out, f(x_ref, r, w_ref), torch.float32, msg="compiled out")
    assert_close(x.grad, x_ref.grad, torch.float32, msg="compiled dx")
    assert_close(w.grad, w_ref.grad, torch.float32, msg="compiled dweight")


# -- Triton kernels compile for sm_90 --------------------------------------------------------------
_TY = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}


_FWD_SIG = {
    "x_ptr": "T", "res_ptr": "T", "w_ptr": "T", "y_ptr": "T", "sum_ptr": "T", "rstd_ptr": "*fp32",
    "n_rows": "i32", "n_cols": "i32", "eps": "fp32", "HAS_RESIDUAL": "constexpr",
    "ZERO_CENTERED": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
}  # fmt: skip
_BWD_SIG = {
    "dy_ptr": "T", "x_ptr": "T", "w_ptr": "T", "rstd_ptr": "*fp32", "dsum_ptr": "T", "dx_ptr": "T",
    "dw_partial_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32", "HAS_DSUM": "constexpr",
    "ZERO_CENTERED": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
}  # fmt: skip


def _compile_all():
    """Every tile config the launchers pick for hidden 100 .. 65536, fwd and bwd, on sm_90."""
    cases = [(100, torch.float32), (2048, torch.bfloat16), (7168, torch.bfloat16), (16384, torch.float16),
             (65536, torch.bfloat16)]  # fmt: skip
    for hidden, dtype in cases:
        for sig, flag in ((_FWD_SIG, "HAS_RESIDUAL"), (_BWD_SIG, "HAS_DSUM")):
            kernel = rk.rmsnorm_fwd_kernel if sig is _FWD_SIG else rk.rmsnorm_bwd_kernel
            block_m, block_n, num_warps = rk.tile_config(hidden, 16384)
            signature = {k: (_TY[dtype] if v == "T" else v) for k, v in sig.items()}
            constexprs = {flag: hidden != 100, "ZERO_CENTERED": hidden == 100, "BLOCK_M": block_m,
                          "BLOCK_N": block_n}  # fmt: skip
            compile_for_sm90(kernel, signature, constexprs, num_warps=num_warps)
    rows_sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "sum_ptr": "*bf16",
                "rstd_ptr": "*fp32", "eps": "fp32", "N_COLS": "constexpr", "HAS_RESIDUAL": "constexpr",
                "ZERO_CENTERED": "constexpr", "CHUNK": "constexpr"}  # fmt: skip
    for n_cols, chunk, warps in ((4096, 4096, 8), (7168, 8192, 16), (5120, 8192, 16)):
        for residual in (False, True):
            constexprs = {"N_COLS": n_cols, "HAS_RESIDUAL": residual, "ZERO_CENTERED": residual}
            constexprs["CHUNK"] = chunk
            compile_for_sm90(rk.rmsnorm_fwd_rows_kernel, rows_sig, constexprs, num_warps=warps, num_stages=1)


def test_triton_kernels_compile_sm90():
    # A fresh process with the interpreter off: under TRITON_INTERPRET=1 Triton's code generator
    # fails on compile_for_sm90 (ir.value has no dtype), see ref/moe_compile_check.py.
    run_compile_check("test_rmsnorm")


# -- GPU: TURBO (csrc) and TRITON at training shapes -----------------------------------------------
# TURBO backward plans: (16384, 1024) bf16: 64-thread row groups, 4 per CTA; (8192, 1000) bf16: scalar
# path (1000 % 8 != 0); bf16 7168 / 7680 and fp32 4000 columns: 4 vectors a thread with the prefetch
# (rmsnorm_bwd_vpt4_kernel); the rest (1536 included): one row group per CTA. Forward of bf16 1536-8192 /
# fp32 768-4096 columns in multiples of 1024 bytes: rmsnorm_fwd_row_kernel, one pass up to 4096 bf16
# columns, two above.
GPU_SHAPES = [
    (8192, 2048), (16384, 4096), (32768, 7168), (8192, 7168), (16384, 1024), (8192, 1000), (4096, 5120),
    (2048, 6144), (1000, 8192), (1000, 7680), (3000, 4000), (3000, 1536),
]  # fmt: skip


GPU_BACKENDS = [pytest.param("TURBO", marks=needs_turbo), "TRITON"]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_training_shapes(backend, dtype, tokens, hidden, device):
    _check_plain((tokens, hidden), dtype, device, backend)
    _check_residual((tokens, hidden), dtype, device, backend)


@pytest.mark.gpu
@needs_turbo
@pytest.mark.parametrize("hidden", [1, 7, 100, 1536, 4100, 7168, 8192, 16384])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_turbo_edge_hidden(dtype, hidden, device):
    # 4100 bf16: not a multiple of 8 -> scalar path up to 4096 -> TURBO refuses, TRITON serves it.
    # 1536 / 7168: the row-kernel forward (one pass / two) and those widths' backward plans, fp16 included.
    x = torch.empty(37, hidden, dtype=dtype, device=device)
    if hidden <= turbo_max_hidden(hidden, dtype, [x]):
        _check_plain((37, hidden), dtype, device, "TURBO", zero_centered_gamma=True)
        _check_residual((37, hidden), dtype, device, "TURBO")
    else:
        with pytest.raises(ValueError, match="backend TURBO cannot handle"):
            turbo.ops.rmsnorm(x, torch.ones(hidden, dtype=dtype, device=device), backend="TURBO")
        turbo.ops.rmsnorm(x.normal_(), torch.ones(hidden, dtype=dtype, device=device))
        assert RMSNormDispatcher.last_backend == BackendType.TRITON


@pytest.mark.gpu
@needs_turbo
def test_gpu_turbo_misaligned_and_default():
    buf = torch.randn(64 * 2048 + 1, dtype=torch.bfloat16, device="cuda")
    x = buf[1:].view(64, 2048).detach().requires_grad_()  # 2-byte offset: scalar path
    w = torch.randn(2048, dtype=torch.bfloat16, device="cuda").requires_grad_()
    y = turbo.ops.rmsnorm(x, w)  # automatic on CUDA, 128K elements: TURBO both ways (measured rule)
    assert RMSNormDispatcher.last_backend == BackendType.TURBO
    big = torch.randn(65536, 2049, dtype=torch.bfloat16, device="cuda")  # > 2**27 elements: TRITON forward
    w_big = torch.randn(2049, dtype=torch.bfloat16, device="cuda")
    y_big = turbo.ops.rmsnorm(big, w_big)
    assert_close(y_big, rmsnorm_ref(big, w_big)[0], torch.bfloat16, msg="large default")
    assert RMSNormDispatcher.last_backend == BackendType.TRITON
    dy = torch.randn_like(y)
    y.backward(dy)
    assert RMSNormDispatcher.last_backend == BackendType.TURBO
    assert_close(y, rmsnorm_ref(x, w)[0], torch.bfloat16, msg="misaligned y")
    ref_dx, ref_dw = rmsnorm_grads_ref(x, w, dy)
    assert_close(x.grad, ref_dx, torch.bfloat16, msg="misaligned dx")
    assert_close(w.grad, ref_dw, torch.bfloat16, msg="misaligned dweight")


@pytest.mark.gpu
@needs_turbo
def test_gpu_cpp_ops_opcheck():
    ops = torch.ops.primus_turbo_cpp_extension
    x = torch.randn(33, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(ops.rmsnorm_fwd.default, (x, w, 1e-6, False))
    torch.library.opcheck(ops.rmsnorm_residual_fwd.default, (x, torch.randn_like(x), w, 1e-6, True))
    _, rstd = ops.rmsnorm_fwd(x, w, 1e-6, False)
    torch.library.opcheck(ops.rmsnorm_bwd.default, (torch.randn_like(x), x, w, rstd, None, False))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_torch_compile_inductor(backend):
    def f(x, r, w):
        y, s = turbo.ops.rmsnorm_residual(x, r, w, backend=backend)
        return turbo.ops.rmsnorm(y * s, w, backend=backend)

    x, w = _inputs((512, 4096), torch.bfloat16, "cuda")
    r = torch.randn_like(x)
    out = torch.compile(f, fullgraph=True)(x, r, w)
    out.float().sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = f(x_ref, r, w_ref)
    ref.float().sum().backward()
    assert_close(out, ref, torch.bfloat16, msg="compiled out")
    assert_close(x.grad, x_ref.grad, torch.bfloat16, msg="compiled dx")
    assert_close(w.grad, w_ref.grad, torch.bfloat16, msg="compiled dweight")


@pytest.mark.gpu
@pytest.mark.deterministic
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_bitwise_deterministic(backend):
    x = torch.randn(16384, 7168, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(7168, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn_like(x)
    runs = []
    for _ in range(2):
        y, rstd = rmsnorm_fwd_impl(x, w, 1e-6, False, backend)
        dx, dw = rmsnorm_bwd_impl(dy, x, w, rstd, None, False, backend)
        runs.append((y, dx, dw))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


if __name__ == "__main__":
    _compile_all()
