"""Backend-manager semantics: priority order, env parsing, pinned refusal, autotune cache."""

import time

import pytest
import torch

from primus_turbo.pytorch.core.backend import (
    AutoKernelDispatcher,
    BackendType,
    GlobalBackendManager,
    KernelBackend,
    parse_backend_spec,
)

CALLS: list[str] = []


class _Fast(KernelBackend):
    @staticmethod
    def can_handle(x, **kw):
        return x.shape[0] <= 64

    @staticmethod
    def execute(x, **kw):
        CALLS.append("fast")
        return x + 1


class _Slow(KernelBackend):
    @staticmethod
    def can_handle(x, **kw):
        return True

    @staticmethod
    def execute(x, **kw):
        CALLS.append("slow")
        time.sleep(0.02)  # a floor no scheduling noise can undercut: autotune must never prefer this one
        return x + 1


class _Ref(KernelBackend):
    @staticmethod
    def can_handle(x, **kw):
        return True

    @staticmethod
    def execute(x, **kw):
        CALLS.append("ref")
        time.sleep(0.004)  # far slower than _Fast (it was x + 1 too: a coin flip under CPU timing noise)
        return x + 1


class _ToyDispatcher(AutoKernelDispatcher):
    op_name = "gemm"  # shares the GEMM env var / setter for the test
    backends = {BackendType.TORCH: _Ref, BackendType.CUBLAS: _Slow, BackendType.TRITON: _Fast}
    autotune_warmup = 1
    autotune_iters = 2

    @classmethod
    def make_key(cls, x, **kw):
        return (tuple(x.shape), x.dtype)

    @classmethod
    def default_backend(cls, x, **kw):
        return BackendType.CUBLAS


@pytest.fixture(autouse=True)
def _clear(monkeypatch):
    for var in ("PRIMUS_TURBO_GEMM_BACKEND", "PRIMUS_TURBO_AUTO_TUNE"):
        monkeypatch.delenv(var, raising=False)
    CALLS.clear()
    yield


def _x(n=32):
    return torch.randn(n, 16)


def test_default_then_fallback():
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.CUBLAS


def test_env_beats_default_and_code_beats_env(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "triton")
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.TRITON
    GlobalBackendManager.set_gemm_backend(BackendType.TORCH)
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.TORCH
    GlobalBackendManager.set_gemm_backend(None)
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.TRITON


def test_per_precision_env(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:TRITON, fp32:torch, other:CUBLAS")
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.TORCH  # fp32 entry
    assert _ToyDispatcher.resolve(x=_x().double()) is BackendType.CUBLAS  # falls to 'other'


def test_per_precision_code_setter():
    GlobalBackendManager.set_gemm_backend("triton", precision="fp32")
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.TRITON
    assert _ToyDispatcher.resolve(x=_x().to(torch.bfloat16)) is BackendType.CUBLAS


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("NOPE", "unknown backend 'NOPE'"),
        ("fp9:TRITON", "unknown precision 'fp9'"),
        ("fp8:TRITON,CUBLAS", "has no precision"),
        ("bf16:WHAT", "unknown backend 'WHAT'"),
    ],
)
def test_bad_env_values_name_the_variable(monkeypatch, value, fragment):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", value)
    with pytest.raises(ValueError, match="PRIMUS_TURBO_GEMM_BACKEND") as err:
        _ToyDispatcher.resolve(x=_x())
    assert fragment in str(err.value)


def test_bad_auto_tune_env(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_AUTO_TUNE", "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_AUTO_TUNE"):
        _ToyDispatcher.resolve(x=_x())


def test_bad_setter_values():
    with pytest.raises(ValueError, match="unknown backend"):
        GlobalBackendManager.set_gemm_backend("cuda")
    with pytest.raises(ValueError, match="precision"):
        GlobalBackendManager.set_gemm_backend("TRITON", precision="int4")


def test_pinned_backend_that_cannot_handle_raises():
    GlobalBackendManager.set_gemm_backend(BackendType.TRITON)
    with pytest.raises(ValueError, match="TRITON .*cannot handle"):
        _ToyDispatcher.dispatch(x=_x(128))
    assert CALLS == []  # nothing ran: no silent fallback


def test_pinned_backend_not_implemented_raises():
    GlobalBackendManager.set_gemm_backend(BackendType.CUDNN)
    with pytest.raises(ValueError, match="CUDNN .*not implemented"):
        _ToyDispatcher.dispatch(x=_x())


def test_unhandled_default_falls_back_in_order():
    class _D(_ToyDispatcher):
        @classmethod
        def default_backend(cls, x, **kw):
            return BackendType.TRITON

    assert _D.resolve(x=_x(128)) is BackendType.TORCH  # TRITON refuses 128 rows; TORCH is first


def test_autotune_picks_fastest_and_caches_per_key():
    GlobalBackendManager.set_auto_tune(True)
    x = _x(32)
    out = _ToyDispatcher.dispatch(x=x)
    assert _ToyDispatcher.last_backend is BackendType.TRITON
    torch.testing.assert_close(out, x + 1)  # the winner's result is returned, inputs untouched
    n_calls = len(CALLS)
    assert {"fast", "slow", "ref"} <= set(CALLS)  # every candidate was timed
    _ToyDispatcher.dispatch(x=_x(32))
    assert len(CALLS) == n_calls + 1  # cached: one execution, no re-tuning
    # A new shape is a new key: it is tuned again, and a shape TRITON refuses gets another winner.
    CALLS.clear()
    _ToyDispatcher.dispatch(x=_x(128))
    assert "fast" not in CALLS and _ToyDispatcher.last_backend in (BackendType.TORCH, BackendType.CUBLAS)
    assert len(_ToyDispatcher._cache) == 2


def test_autotune_skips_host_syncing_backends_on_cuda(monkeypatch):
    """A backend marked syncs_host (a reference loop reading device values on the host) is timed for CPU
    inputs but never for CUDA ones, however fast; a pin still reaches it."""
    import primus_turbo.pytorch.core.backend as backend_mod

    class _FastSync(_Fast):
        syncs_host = True

    class _D(_ToyDispatcher):
        backends = {BackendType.TORCH: _Ref, BackendType.CUBLAS: _Slow, BackendType.TRITON: _FastSync}

    GlobalBackendManager.set_auto_tune(True)
    assert _D.resolve(x=_x(32)) is BackendType.TRITON  # CPU inputs: nothing to keep sync-free
    _D.clear_cache()
    CALLS.clear()
    monkeypatch.setattr(backend_mod, "_on_cuda", lambda kwargs: True)
    cost = {"fast": 1.0, "ref": 2.0, "slow": 3.0}  # CUDA-event timing stand-in: the syncing one is fastest
    monkeypatch.setattr(_D, "_time", classmethod(lambda cls, fn, on_cuda: (fn(), cost[CALLS[-1]])[1]))
    assert _D.resolve(x=_x(32)) is BackendType.TORCH
    assert "fast" not in CALLS and {"ref", "slow"} <= set(CALLS)
    GlobalBackendManager.set_gemm_backend("TRITON")
    assert _D.resolve(x=_x(32)) is BackendType.TRITON


@pytest.mark.parametrize("fast_ms,expected", [(0.99, BackendType.CUBLAS), (0.90, BackendType.TRITON)])
def test_autotune_margin_keeps_the_default_on_near_ties(fast_ms, expected, monkeypatch):
    """With autotune_margin 0.05 a challenger must be timed more than 5% under the in-code default."""

    class _D(_ToyDispatcher):
        autotune_margin = 0.05

        @classmethod
        def default_backend(cls, x, **kw):
            return BackendType.CUBLAS

    cost = {"fast": fast_ms, "ref": 3.0, "slow": 1.0}  # _Slow is the default here, "timed" at 1.0
    monkeypatch.setattr(_D, "_time", classmethod(lambda cls, fn, on_cuda: (fn(), cost[CALLS[-1]])[1]))
    assert _D._autotune(x=_x(32)) is expected


def test_autotune_cache_is_bounded():
    class _Small(_ToyDispatcher):
        cache_size = 3

    GlobalBackendManager.set_auto_tune(True)
    for n in range(1, 7):
        _Small.resolve(x=_x(n))
    assert len(_Small._cache) == 3


def test_setter_beats_autotune():
    GlobalBackendManager.set_auto_tune(True)
    GlobalBackendManager.set_gemm_backend("CUBLAS")
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.CUBLAS
    assert len(_ToyDispatcher._cache) == 0


def test_reset_clears_everything(monkeypatch):
    GlobalBackendManager.set_auto_tune(True)
    GlobalBackendManager.set_gemm_backend("TORCH")
    _ToyDispatcher._cache[("k",)] = BackendType.TORCH
    GlobalBackendManager.reset()
    assert not GlobalBackendManager.auto_tune_enabled()
    assert len(_ToyDispatcher._cache) == 0
    assert _ToyDispatcher.resolve(x=_x()) is BackendType.CUBLAS


def test_parse_spec_forms():
    assert parse_backend_spec("triton", source="X") == {"*": BackendType.TRITON}
    assert parse_backend_spec("", source="X") == {}
    assert parse_backend_spec("FP8:cublas,Other:torch", source="X") == {
        "fp8": BackendType.CUBLAS,
        "other": BackendType.TORCH,
    }


class _CountingDefault(_ToyDispatcher):
    """cache_default=True: the automatic choice is memoized per make_key."""

    cache_default = True
    asked = 0

    @classmethod
    def default_backend(cls, x, **kw):
        cls.asked += 1
        return BackendType.TRITON if x.shape[0] <= 64 else BackendType.CUBLAS


def test_cached_default_is_asked_once_per_key_and_pins_still_win(monkeypatch):
    _CountingDefault.clear_cache()
    _CountingDefault.asked = 0
    for _ in range(3):
        assert _CountingDefault.resolve(x=_x(32)) is BackendType.TRITON
    assert _CountingDefault.resolve(x=_x(128)) is BackendType.CUBLAS
    assert _CountingDefault.asked == 2  # one per key
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "torch")  # a pin after the cache filled
    assert _CountingDefault.resolve(x=_x(32)) is BackendType.TORCH
    monkeypatch.delenv("PRIMUS_TURBO_GEMM_BACKEND")
    GlobalBackendManager.set_gemm_backend("TORCH")
    assert _CountingDefault.resolve(x=_x(32)) is BackendType.TORCH
    GlobalBackendManager.reset()  # also clears the memo
    assert _CountingDefault.resolve(x=_x(32)) is BackendType.TRITON and _CountingDefault.asked == 3


def test_dispatchers_without_cache_default_ask_every_time():
    _ToyDispatcher.clear_cache()
    for _ in range(3):
        _ToyDispatcher.resolve(x=_x(32))
    assert not _ToyDispatcher._default_cache


def test_under_cuda_graph_capture_no_autotune_and_no_cached_default(monkeypatch):
    """While a CUDA graph is being captured nothing may be timed (the candidates' launches would be captured)
    and a default chosen then is not memoized (probes decline under capture): the in-code default runs."""
    from primus_turbo.pytorch.core import backend as backend_mod

    GlobalBackendManager.set_auto_tune(True)
    _ToyDispatcher.clear_cache()
    _CountingDefault.clear_cache()
    monkeypatch.setattr(backend_mod, "_is_capturing", lambda: True)
    try:
        _ToyDispatcher.dispatch(x=_x(32))
        assert CALLS == ["slow"] and _ToyDispatcher.last_backend is BackendType.CUBLAS  # the default, untimed
        assert not _ToyDispatcher._cache
        assert _CountingDefault.resolve(x=_x(32)) is BackendType.TRITON
        assert not _CountingDefault._default_cache
        monkeypatch.setattr(backend_mod, "_is_capturing", lambda: False)
        CALLS.clear()
        _ToyDispatcher.dispatch(x=_x(32))  # after capture: tuned and cached as usual
        assert {"fast", "slow", "ref"} <= set(CALLS) and len(_ToyDispatcher._cache) == 1
        monkeypatch.setattr(backend_mod, "_is_capturing", lambda: True)
        CALLS.clear()
        _ToyDispatcher.dispatch(x=_x(32))  # captured again: the cached choice runs, nothing is timed
        assert CALLS == ["fast"] and _ToyDispatcher.last_backend is BackendType.TRITON
    finally:
        GlobalBackendManager.reset()
