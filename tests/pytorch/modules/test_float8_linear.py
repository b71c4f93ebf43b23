"""Float8Linear: nn.Linear compatibility, FP8 accuracy of y/dx/dw, weight cache, fp8_autocast, delayed."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_utils import assert_snr, fp8_snr_gate
from torch.utils._python_dispatch import TorchDispatchMode

from primus_turbo.pytorch.core.fp8_autocast import fp8_autocast
from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingStrategy
from primus_turbo.pytorch.core.low_precision import ScalingGranularity as G
from primus_turbo.pytorch.modules.float8_linear import Float8Linear
from primus_turbo.pytorch.modules.linear import Linear


def _ref(layer, x, grad):
    w = layer.weight.detach().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    y = xr @ w.t() + (layer.bias.double() if layer.bias is not None else 0)
    y.backward(grad.double())
    return y.detach(), xr.grad, w.grad


def _run(layer, x):
    x = x.detach().requires_grad_()
    y = layer(x)
    grad = torch.randn_like(y)
    y.backward(grad)
    return y, x.grad, layer.weight.grad, grad


@pytest.mark.parametrize("fmt", [Format.E4M3, Format.HYBRID], ids=lambda f: f.name)
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_float8_linear_snr(gran, fmt):
    cfg = Float8QuantConfig(format=fmt, granularity=gran)
    layer = Float8Linear(160, 96, config=cfg)
    x = torch.randn(2, 40, 160)  # leading dims flattened
    y, dx, dw, grad = _run(layer, x)
    ry, rdx, rdw = _ref(layer, x, grad)
    gate = fp8_snr_gate(fmt)
    assert y.shape == (2, 40, 96)
    assert_snr(y, ry, gate, "y")
    assert_snr(dx, rdx, gate, "dx")
    assert_snr(dw, rdw, gate, "dw")


def test_state_dict_and_from_float_compat():
    ref = torch.nn.Linear(64, 32)
    layer = Float8Linear(64, 32)
    layer.load_state_dict(ref.state_dict())  # strict: same keys, shapes
    assert set(layer.state_dict()) == {"weight", "bias"}
    ref.load_state_dict(layer.state_dict())
    wrapped = Float8Linear.from_float(ref)
    assert wrapped.weight is ref.weight and wrapped.bias is ref.bias  # shared, optimizer refs stay valid
    delayed = Float8Linear(64, 32, config=Float8QuantConfig(strategy=ScalingStrategy.DELAYED))
    assert set(delayed.state_dict()) == {"weight", "bias"}  # histories are not checkpointed
    with pytest.raises(TypeError, match="config"):
        Float8Linear(64, 32, config="fp8")
    with pytest.raises(TypeError, match="nn.Linear"):
        Float8Linear.from_float(torch.nn.Conv1d(3, 3, 1))


def test_no_weight_cache_by_default_sees_untracked_writes():
    layer = Float8Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    y1 = layer(x)
    with torch.no_grad():
        layer.weight.data.mul_(2.0)  # does not bump weight._version
    y2 = layer(x)
    assert layer._weight_cache is None
    torch.testing.assert_close(y2, 2 * y1, rtol=0.07, atol=1e-3)


def test_weight_quantized_once_per_step():
    layer = Float8Linear(64, 32, bias=False, cache_weight=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(8, 64)
    layer(x).sum().backward()
    first = layer._weight_cache[1]
    layer(x).sum().backward()  # second microbatch: same FP8 weight object
    assert layer._weight_cache[1] is first
    opt.step()  # in-place update bumps weight._version: re-quantize
    layer(x)
    assert layer._weight_cache[1] is not first


def test_fp8_autocast_controls_modules():
    layer = Float8Linear(64, 32, cache_weight=True)
    hp = torch.nn.Linear(64, 32)
    hp.load_state_dict(layer.state_dict())
    x = torch.randn(8, 64)
    with fp8_autocast(enabled=False):
        torch.testing.assert_close(layer(x), hp(x))  # high precision: exact nn.Linear
    y_fp8 = layer(x)
    assert not torch.equal(y_fp8, hp(x))
    with fp8_autocast(enabled=True, config=Float8QuantConfig(granularity=G.ROWWISE)):
        y_row = layer(x)
        assert layer._weight_cache[0][-1].granularity is G.ROWWISE
    assert_snr(y_row, hp(x).double(), 25.0, "autocast rowwise")
    with pytest.raises(TypeError, match="config"):
        with fp8_autocast(config="rowwise"):
            pass


def test_delayed_scaling_module():
    cfg = Float8QuantConfig(format=Format.HYBRID, strategy=ScalingStrategy.DELAYED, amax_history_len=4)
    layer = Float8Linear(64, 48, config=cfg)
    for _ in range(3):
        layer.weight.grad = None
        y, dx, dw, grad = _run(layer, torch.randn(16, 64))
    st = layer.delayed_state
    assert st.a.initialized and st.b.initialized and st.grad.initialized
    assert torch.all(st.a.history[:3] > 0) and st.a.history[3] == 0
    torch.testing.assert_close(st.b.history[0], layer.weight.detach().abs().max())
    assert torch.isfinite(dw).all() and torch.isfinite(dx).all()


@pytest.mark.parametrize("reentrant", [False, True])
def test_delayed_scaling_pushes_one_amax_per_step_under_activation_checkpointing(reentrant):
    """Checkpointing recomputes the forward during backward; the recomputation must not push the input and
    weight amaxes a second time (the window would cover half the steps). The gradient's history, pushed in
    the backward, still gets one per step. Before: a and b held two entries after one step."""
    from torch.utils.checkpoint import checkpoint

    cfg = Float8QuantConfig(format=Format.HYBRID, strategy=ScalingStrategy.DELAYED, amax_history_len=4)
    layer = Float8Linear(64, 48, config=cfg)
    xs = [torch.randn(16, 64, requires_grad=True) * (i + 1) for i in range(2)]
    for x in xs:
        x.retain_grad()
        checkpoint(layer, x, use_reentrant=reentrant).square().sum().backward()
    st = layer.delayed_state
    for hist in (st.a, st.b, st.grad):
        assert torch.all(hist.history[:2] > 0) and torch.all(hist.history[2:] == 0), hist.history
    torch.testing.assert_close(st.a.history[0], xs[1].detach().abs().max())
    torch.testing.assert_close(st.a.history[1], xs[0].detach().abs().max())
    assert torch.isfinite(xs[1].grad).all() and xs[1].grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
@pytest.mark.parametrize("nk", [(4096, 4096), (14336, 4096), (4096, 14336), (2048, 7168)])
def test_float8_linear_training_shapes_gpu(gran, nk):
    n, k = nk
    cfg = Float8QuantConfig(format=Format.HYBRID, granularity=gran)
    layer = Float8Linear(k, n, config=cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
    y, dx, dw, grad = _run(layer, x)
    ry, rdx, rdw = _ref(layer, x, grad)
    assert_snr(y, ry, 25.0, "y")
    assert_snr(dx, rdx, 20.0, "dx")
    assert_snr(dw, rdw, 20.0, "dw")


def test_turbo_linear_fp8_config_and_autocast():
    from primus_turbo.pytorch.modules.linear import Linear

    cfg = Float8QuantConfig(granularity=G.ROWWISE)
    lin = Linear(64, 32, fp8_config=cfg)
    f8 = Float8Linear.from_float(lin, config=cfg)
    plain = Linear(64, 32)
    plain.load_state_dict(lin.state_dict())
    x = torch.randn(2, 8, 64)
    torch.testing.assert_close(lin(x), f8(x), rtol=0, atol=0)  # same FP8 recipe, same numbers
    y_hp = plain(x)
    ref = x.double() @ plain.weight.double().t() + plain.bias.double()
    assert_snr(y_hp, ref, 60.0, "turbo Linear outside autocast is high precision")
    with fp8_autocast(enabled=True):
        y_fp8 = plain(x)
    assert not torch.equal(y_fp8, y_hp)
    assert_snr(y_fp8, ref, 25.0, "turbo Linear under fp8_autocast")
    with fp8_autocast(enabled=False):
        torch.testing.assert_close(lin(x), y_hp)  # enabled=False beats the layer's own config
    with pytest.raises(TypeError, match="fp8_config"):
        Linear(64, 32, fp8_config="e4m3")
    fused = Linear(64, 32, fp8_config=cfg, gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion with FP8 needs high_precision_wgrad"):
        fused(x)


@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_torch_compile_fullgraph(gran):
    layer = Float8Linear(64, 32, config=Float8QuantConfig(granularity=gran))
    x = torch.randn(8, 64, requires_grad=True)
    y = torch.compile(layer, fullgraph=True)(x)
    y.sum().backward()
    torch.testing.assert_close(y, layer(x), rtol=0, atol=0)
    assert x.grad is not None and layer.weight.grad is not None


_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}


class _OpCounter(TorchDispatchMode):
    """Counts aten ops and fails on host-syncing ones (would stall the GPU every step)."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}
        self.namespaces: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        assert name not in _SYNC_OPS, f"host sync in the Float8Linear step: aten::{name}"
        self.ops[name] = self.ops.get(name, 0) + 1
        self.namespaces.add(func.namespace)
        return func(*args, **(kwargs or {}))


def _count_passes(monkeypatch):
    """Wrap the quantizers and the GEMM entry of gemm_fp8: every call is one pass over its input."""
    # the ops package re-exports functions under the module names: take the modules themselves
    gemm_mod = importlib.import_module("primus_turbo.pytorch.ops.gemm_fp8")
    quant_mod = importlib.import_module("primus_turbo.pytorch.ops.quantization")

    calls: dict[str, int] = {}

    def wrap(module, name, label):
        fn = getattr(module, name)

        def counted(*a, **k):
            calls[label] = calls.get(label, 0) + 1
            return fn(*a, **k)

        monkeypatch.setattr(module, name, counted)

    wrap(gemm_mod, "quantize_fp8_with_transpose_impl", "quantize")
    wrap(gemm_mod, "quantize_fp8_impl", "quantize")
    wrap(gemm_mod, "gemm_fp8_impl", "gemm")
    wrap(quant_mod, "quantize_fp8_with_transpose_op", "weight_quantize")  # Float8Tensor.from_tensor
    return calls


@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_step_op_budget(gran, monkeypatch, device):
    # Issue 4: a Float8Linear step must be 1 activation + 1 gradient quantization and 3 GEMMs, the
    # weight quantized only when it changed, no host syncs, no custom-op layer in eager, and no
    # copies of activation-sized tensors besides the FP8 casts.
    cfg = Float8QuantConfig(format=Format.HYBRID, granularity=gran)
    layer = Float8Linear(
        256, 128, bias=False, config=cfg, device=device, dtype=torch.bfloat16, cache_weight=True
    )
    x = torch.randn(192, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(192, 128, device=device, dtype=torch.bfloat16)
    layer(x).backward(grad)  # warm-up: weight cache, one-time backend probes
    calls = _count_passes(monkeypatch)
    with _OpCounter() as fwd_ops:
        y = layer(x)
    assert calls == {"quantize": 1, "gemm": 1}, calls
    with _OpCounter() as bwd_ops:
        y.backward(grad)
    assert calls == {"quantize": 2, "gemm": 3}, calls
    for counter in (fwd_ops, bwd_ops):
        ops = counter.ops
        # no Python custom op (the primus_turbo:: namespace); the csrc kernels are plain C++ ops
        assert "primus_turbo" not in counter.namespaces, ops
        if x.is_cuda:  # the CPU reference quantizer transposes with a copy; the Triton kernels do not
            assert ops.get("clone", 0) == 0 and ops.get("contiguous", 0) == 0, ops
    with torch.no_grad():
        layer.weight.mul_(0.5)  # an optimizer step (bumps weight._version): re-quantize once
    layer(x)
    layer(x)
    assert calls["weight_quantize"] == 1, calls


@pytest.mark.gpu
@pytest.mark.parametrize("gran", list(G), ids=lambda g: g.name)
def test_step_has_no_host_sync_gpu(gran):
    # A sync per step serializes host overhead with GPU work (issue 4): CUDA's sync debug mode
    # raises on any, incl. .item() inside torch ops. Warm-up first (autotune and backend probes sync once).
    cfg = Float8QuantConfig(format=Format.HYBRID, granularity=gran)
    layer = Float8Linear(4096, 4096, bias=False, config=cfg, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    layer(x).backward(grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer._weight_cache = None  # the weight re-quantization too
        layer(x).backward(grad)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("cls", ["Linear", "Float8Linear"])
def test_fp8_gradient_accumulation_fusion_sums_into_main_grad(cls):
    """gradient_accumulation_fusion with FP8 (high_precision_wgrad): the weight gradient goes into main_grad,
    as Megatron DDP expects; Float8Linear ignored the flag (main_grad stayed 0, .grad was set)."""
    cfg = Float8QuantConfig(high_precision_wgrad=True)
    torch.manual_seed(0)
    layer = (
        Linear(64, 32, bias=False, fp8_config=cfg, gradient_accumulation_fusion=True)
        if cls == "Linear"
        else Float8Linear(64, 32, bias=False, config=cfg)
    )
    layer.gradient_accumulation_fusion = True
    layer.weight.main_grad = torch.zeros(32, 64)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    for _ in range(2):
        layer(x).backward(dy)
    assert layer.weight.grad is None
    assert_snr(layer.weight.main_grad, 2 * dy.double().t() @ x.double(), 40.0, "main_grad")
    with pytest.raises(ValueError, match="gradient_accumulation_fusion with FP8 needs high_precision_wgrad"):
        layer.fp8_config = layer.config = Float8QuantConfig()
        layer(x)


def test_from_float_keeps_the_source_settings():
    cfg = Float8QuantConfig(granularity=G.BLOCKWISE, high_precision_wgrad=True)
    src = Linear(64, 32, fp8_config=cfg, gradient_accumulation_fusion=True).eval()
    f8 = Float8Linear.from_float(src)
    assert f8.config is cfg and f8.gradient_accumulation_fusion and not f8.training
    again = Float8Linear.from_float(Float8Linear(64, 32, config=cfg, cache_weight=True))
    assert again.config is cfg and again.cache_weight
    other = Float8QuantConfig()
    assert Float8Linear.from_float(src, config=other).config is other  # an explicit config wins
