"""Core audit (session 36): backend priority, env parsing, autotune under torch.compile and threads,
Float8QuantConfig validation, environment switches and eager_direct. Each test failed before its fix,
except those marked as guards."""

from __future__ import annotations

import threading

import pytest
import torch

import primus_turbo.pytorch as turbo
from primus_turbo.pytorch.core import utils as core_utils
from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
)
from primus_turbo.pytorch.core.collective_choice import measuring_enabled
from primus_turbo.pytorch.core.low_precision import (
    Float8QuantConfig,
    Format,
    ScalingGranularity,
    ScalingStrategy,
)

_ENV = (
    "PRIMUS_TURBO_GEMM_BACKEND",
    "PRIMUS_TURBO_ATTENTION_BACKEND",
    "PRIMUS_TURBO_AUTO_TUNE",
    "PRIMUS_TURBO_DEBUG_CHECKS",
    "PRIMUS_TURBO_ASYNC_TP_MEASURE",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _PlusOne(KernelBackend):
    @staticmethod
    def can_handle(x, **_):
        return True

    @staticmethod
    def execute(x, **_):
        return x + 1


class _PlusTwo(KernelBackend):
    @staticmethod
    def can_handle(x, **_):
        return True

    @staticmethod
    def execute(x, **_):
        return x + 2


class _Toy(AutoKernelDispatcher):
    op_name = "gemm"  # shares the GEMM setter and env var
    backends = {BackendType.TORCH: _PlusOne, BackendType.TRITON: _PlusTwo}
    autotune_warmup, autotune_iters = 0, 1

    @classmethod
    def make_key(cls, x, **_):
        return (tuple(x.shape), x.dtype, x.device.type)

    @classmethod
    def default_backend(cls, x, **_):
        return BackendType.TORCH


# -- priority and setters ------------------------------------------------------------------------------
def test_setter_for_all_precisions_replaces_earlier_per_precision_pins():
    """set_gemm_backend(B) pins every precision: an earlier per-precision pin must not survive it (the last
    call wins); it did, so set_gemm_backend('TORCH') left fp32 on CUBLAS."""
    x = torch.randn(4, 4)
    GlobalBackendManager.set_gemm_backend("TRITON", precision="fp32")
    GlobalBackendManager.set_gemm_backend("TORCH")
    assert _Toy.resolve(x=x) is BackendType.TORCH
    assert _Toy.resolve(x=x.bfloat16()) is BackendType.TORCH
    # a per-precision pin after an all-precision one still narrows only its precision
    GlobalBackendManager.set_gemm_backend("TRITON", precision="bf16")
    assert _Toy.resolve(x=x.bfloat16()) is BackendType.TRITON and _Toy.resolve(x=x) is BackendType.TORCH
    GlobalBackendManager.set_gemm_backend(None, precision="bf16")  # removes only that pin
    assert _Toy.resolve(x=x.bfloat16()) is BackendType.TORCH
    GlobalBackendManager.set_gemm_backend(None)
    assert GlobalBackendManager.user_backend("gemm", "fp32") == (None, "")


def test_setter_precision_of_wrong_type_names_the_argument():
    with pytest.raises(TypeError, match=r"set_gemm_backend: precision must be a str .*torch\.float32"):
        GlobalBackendManager.set_gemm_backend("TRITON", precision=torch.float32)
    GlobalBackendManager.set_gemm_backend("TRITON", precision=" FP32 ")  # as lenient as the env syntax
    assert _Toy.resolve(x=torch.randn(2, 2)) is BackendType.TRITON


@pytest.mark.parametrize("value", ["false", "0", 0, 1, "true"])
def test_set_auto_tune_rejects_non_bools(value):
    """set_auto_tune('false') stored the string, which is truthy: autotune switched on."""
    with pytest.raises(TypeError, match="set_auto_tune: enabled must be a bool or None"):
        GlobalBackendManager.set_auto_tune(value)
    assert not GlobalBackendManager.auto_tune_enabled()


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("fp8:TRITON,fp8:CUBLAS", "'fp8' is given twice"),
        ("other:torch, OTHER:triton", "'other' is given twice"),
    ],
)
def test_env_precision_given_twice_is_an_error(monkeypatch, value, fragment):
    """The last entry silently won; which one was meant is a guess."""
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", value)
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GEMM_BACKEND") as err:
        _Toy.resolve(x=torch.randn(2, 2))
    assert fragment in str(err.value)


def test_env_spec_whitespace_and_case_guard(monkeypatch):
    """Guard: spaces, case and a trailing comma are accepted; a code pin still beats the env var."""
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "  FP32 : triton , bf16:Torch, ")
    assert _Toy.resolve(x=torch.randn(2, 2)) is BackendType.TRITON
    assert _Toy.resolve(x=torch.randn(2, 2).bfloat16()) is BackendType.TORCH
    assert _Toy.resolve(x=torch.randn(2, 2).half()) is BackendType.TORCH  # unlisted: the default
    GlobalBackendManager.set_gemm_backend("TORCH", precision="fp32")
    assert _Toy.resolve(x=torch.randn(2, 2)) is BackendType.TORCH


# -- autotune --------------------------------------------------------------------------------------------
def test_compiled_dispatch_with_autotune_uses_the_eager_choice_without_graph_break():
    """With autotune on, resolve entered a threading.Lock, which Dynamo cannot trace: fullgraph failed
    ("Unsupported context manager"). A choice tuned eagerly is used in the graph; a miss runs the default."""

    class _Tuned(_Toy):
        @classmethod
        def _autotune(cls, **kwargs):
            return BackendType.TRITON  # the "measured" winner

    GlobalBackendManager.set_auto_tune(True)
    x = torch.randn(8, 4)
    compiled = torch.compile(lambda t: _Tuned.dispatch(x=t), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), x + 1)  # untuned key while tracing: the default (TORCH)
    assert not _Tuned._cache
    torch._dynamo.reset()
    torch.testing.assert_close(_Tuned.dispatch(x=x), x + 2)  # eager: tuned and cached
    torch.testing.assert_close(compiled(x), x + 2)  # traced again: the cached choice
    set_to_false = torch.compile(lambda t: _Tuned.dispatch(x=t) * 1, fullgraph=True, backend="eager")
    GlobalBackendManager.set_auto_tune(False)  # cached choices no longer apply
    torch.testing.assert_close(set_to_false(x), x + 1)


def test_compiled_attention_with_autotune_is_one_graph():
    """turbo.ops attention resolves its backend in traced code (outside a custom op): with autotune on it
    failed fullgraph on the lock."""
    from primus_turbo.pytorch.ops.attention.attention import flash_attn_func

    GlobalBackendManager.set_auto_tune(True)
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    compiled = torch.compile(lambda *t: flash_attn_func(*t, causal=True), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("setup", ["autotune", "pin", "env"])
def test_compiled_gemm_and_rmsnorm_are_one_graph(setup, monkeypatch):
    """Guard: gemm and rmsnorm trace in one graph (fullgraph) under every selection source."""
    if setup == "autotune":
        GlobalBackendManager.set_auto_tune(True)
    elif setup == "pin":
        GlobalBackendManager.set_gemm_backend("TORCH")
    else:
        monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp32:torch")
    a, b, w = torch.randn(16, 8), torch.randn(8, 4), torch.rand(8) + 0.5
    gemm = torch.compile(lambda x, y: turbo.ops.gemm(x, y), fullgraph=True, backend="eager")
    torch.testing.assert_close(gemm(a, b), a @ b, rtol=1e-4, atol=1e-4)
    norm = torch.compile(lambda x, g: turbo.ops.rmsnorm(x, g), fullgraph=True, backend="eager")
    ref = a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(norm(a, w), ref, rtol=1e-4, atol=1e-4)


def test_autotune_cache_hits_from_threads_while_evicting():
    """Guard for the lock-free hit path: threads (autograd's backward runs on its own) resolving keys that
    evict each other from a 2-entry cache never fail and never see another key's choice."""

    class _Small(_Toy):
        cache_size = 2

        @classmethod
        def _autotune(cls, x, **_):
            return BackendType.TRITON if x.shape[0] % 2 else BackendType.TORCH

    GlobalBackendManager.set_auto_tune(True)
    inputs = [torch.randn(n, 2) for n in range(1, 6)]
    errors: list[BaseException] = []

    def work():
        try:
            for _ in range(100):
                for x in inputs:
                    expected = BackendType.TRITON if x.shape[0] % 2 else BackendType.TORCH
                    assert _Small.resolve(x=x) is expected
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(_Small._cache) <= 2


# -- environment switches --------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "false", "FALSE", "off", "No"])
def test_collective_measuring_switch_reads_every_off_spelling(monkeypatch, value):
    """PRIMUS_TURBO_ASYNC_TP_MEASURE=off (or FALSE, no) kept measuring: only 0/false/False were read."""
    monkeypatch.setenv("PRIMUS_TURBO_ASYNC_TP_MEASURE", value)
    assert measuring_enabled("PRIMUS_TURBO_ASYNC_TP_MEASURE") is False


def test_collective_measuring_switch_rejects_garbage(monkeypatch):
    assert measuring_enabled("PRIMUS_TURBO_ASYNC_TP_MEASURE") is True  # unset: measure
    monkeypatch.setenv("PRIMUS_TURBO_ASYNC_TP_MEASURE", "sometimes")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_ASYNC_TP_MEASURE"):
        measuring_enabled("PRIMUS_TURBO_ASYNC_TP_MEASURE")


@pytest.mark.parametrize(
    "value", ["1", "true", "TRUE", "on", "yes", "0", "false", "off", "no", "", "2", " 1"]
)
def test_triton_interpret_switch_reads_as_triton_does(monkeypatch, value):
    """TRITON_INTERPRET=false (off, no) counted as on: CPU tensors were offered to compiled Triton kernels."""
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", value)
    expected = value.lower() in ("1", "true", "on", "yes")
    assert core_utils.triton_interpret_enabled() is expected
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:  # Triton's own reading, where this Triton has it
        assert knobs.runtime.interpret is expected


def test_debug_checks_switch_rejects_garbage(monkeypatch):
    """PRIMUS_TURBO_DEBUG_CHECKS=enable silently checked nothing."""
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", "enable")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_DEBUG_CHECKS"):
        core_utils.debug_checks_enabled()
    monkeypatch.setenv("PRIMUS_TURBO_DEBUG_CHECKS", " ON ")
    assert core_utils.debug_checks_enabled()


# -- eager_direct ------------------------------------------------------------------------------------------
_SEEN: list[type] = []


@torch.library.custom_op("primus_turbo_audit_s36::sum_list", mutates_args=())
def _sum_list(x: torch.Tensor, ys: list[torch.Tensor]) -> torch.Tensor:
    _SEEN.extend(type(y) for y in ys)
    return x + sum(y.sum() for y in ys)


@_sum_list.register_fake
def _(x, ys):
    return torch.empty_like(x)


def test_eager_direct_routes_a_subclass_inside_a_tensor_list_through_the_op():
    """A tensor subclass inside a list argument (all_gather_matmul's weights) reached the op's body directly,
    whose kernels need real storage; the op's dispatch unwraps it."""
    from torch.testing._internal.two_tensor import TwoTensor

    call = core_utils.eager_direct(_sum_list)
    x = torch.zeros(2)
    _SEEN.clear()
    call(x, [torch.ones(2)])
    assert _SEEN == [torch.Tensor]
    _SEEN.clear()
    out = call(x, [TwoTensor(torch.ones(2), torch.ones(2))])
    assert _SEEN and all(t is torch.Tensor for t in _SEEN)  # the body saw plain tensors
    torch.testing.assert_close(out, torch.full((2,), 2.0))


# -- Float8QuantConfig -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        # accepted before: True read as a 1-step history
        ({"strategy": ScalingStrategy.DELAYED, "amax_history_len": True}, ValueError, "amax_history_len"),
        # accepted before: the amax fields were checked only with DELAYED
        ({"amax_history_len": 0}, ValueError, "amax_history_len must be an int >= 1"),
        ({"amax_compute_algo": "mean"}, ValueError, "amax_compute_algo must be 'max' or 'most_recent'"),
        # the message now lists the members
        ({"granularity": "BLOCKWISE"}, TypeError, r"ScalingGranularity\.BLOCKWISE.*got 'BLOCKWISE'"),
        ({"format": "hybrid"}, TypeError, r"Format \(Format\.E4M3, Format\.E5M2, Format\.HYBRID\)"),
        ({"strategy": "delayed"}, TypeError, r"ScalingStrategy\.DELAYED"),
        # guards (rejected before too)
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": 0}, ValueError, "block_size"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": -128}, ValueError, "block_size"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": 128.0}, ValueError, "block_size"),
        ({"granularity": ScalingGranularity.BLOCKWISE, "block_size": True}, ValueError, "block_size"),
        (
            {"granularity": ScalingGranularity.TENSORWISE, "block_size": 0},
            ValueError,
            "only used by BLOCKWISE",
        ),
    ],
)
def test_float8_config_rejects_bad_values_naming_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8QuantConfig(**kwargs)


def test_float8_config_equality_and_hash_as_cache_keys():
    """Guard: the BLOCKWISE default block size is normalized, so equal configs share a cache entry."""
    implicit = Float8QuantConfig(Format.E4M3, ScalingGranularity.BLOCKWISE)
    explicit = Float8QuantConfig(Format.E4M3, ScalingGranularity.BLOCKWISE, 128)
    assert implicit == explicit and hash(implicit) == hash(explicit) and len({implicit, explicit}) == 1
    assert Float8QuantConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=64) != implicit
    assert Float8QuantConfig(Format.HYBRID) != Float8QuantConfig(Format.E4M3)


def test_float8_config_builds_inside_a_compiled_graph():
    """Guard: modules build the default config in forward (resolve_fp8_config); the validation traces."""

    def fn(x):
        cfg = Float8QuantConfig(granularity=ScalingGranularity.ROWWISE)
        return x * cfg.amax_history_len

    x = torch.randn(3)
    torch.testing.assert_close(torch.compile(fn, fullgraph=True, backend="eager")(x), x * 16)


def test_rmsnorm_autotune_key_holds_every_pointers_alignment():
    """TURBO's widest hidden size depends on every row tensor's alignment (and the weight's): the key held
    only x's, so an autotuned TURBO choice for aligned tensors was reused for a misaligned residual."""
    from primus_turbo.pytorch.kernels.normalization.rmsnorm_impl import RMSNormDispatcher

    x, w = torch.randn(4, 64), torch.randn(64)
    res = torch.randn(4 * 64 + 1)[1:].view(4, 64)  # 4-byte offset: misaligned
    aligned = RMSNormDispatcher.make_key(stage="fwd", x=x, weight=w, residual=torch.randn(4, 64))
    misaligned = RMSNormDispatcher.make_key(stage="fwd", x=x, weight=w, residual=res)
    assert aligned != misaligned
