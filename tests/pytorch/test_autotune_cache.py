"""Triton's on-disk autotune cache on turbo's autotuned kernels (``primus_turbo.triton.autotune_cache``).

CPU: which kernels get it and the switches. GPU: a second process reads the first one's choice instead of
timing its configs again, and kernels with pre-hook configs keep working under ``TRITON_CACHE_AUTOTUNING=1``
(Triton cannot restore those from its file)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import triton

from primus_turbo.triton import autotune_cache
from primus_turbo.triton.gemm import gemm_fp8_kernel, gemm_kernel


def _autotuner(pre_hook=None):
    configs = [triton.Config({"BLOCK": b}, num_warps=4, num_stages=2, pre_hook=pre_hook) for b in (16, 32)]

    @triton.jit
    def kernel(x_ptr, BLOCK: triton.language.constexpr):
        pass

    return triton.autotune(configs=configs, key=[])(kernel)


@pytest.fixture
def compiled_mode(monkeypatch):
    """As on a GPU: no interpreter, no turbo switch set."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(autotune_cache.ENV_AUTOTUNE_CACHE, raising=False)


def test_restorable_kernel_gets_the_cache(compiled_mode):
    assert autotune_cache.configure(_autotuner()).cache_results is True


def test_pre_hook_kernel_is_kept_off_even_under_triton_env(compiled_mode, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    tuned = _autotuner(pre_hook=lambda nargs: None)
    assert not autotune_cache.disk_cacheable(tuned)
    assert autotune_cache.configure(tuned).cache_results is False


@pytest.mark.parametrize("value, expected", [("0", False), ("off", False), ("1", True), ("", True)])
def test_env_switch(compiled_mode, monkeypatch, value, expected):
    monkeypatch.setenv(autotune_cache.ENV_AUTOTUNE_CACHE, value)
    assert autotune_cache.configure(_autotuner()).cache_results is expected


def test_env_switch_rejects_unknown_values(compiled_mode, monkeypatch):
    monkeypatch.setenv(autotune_cache.ENV_AUTOTUNE_CACHE, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_AUTOTUNE_CACHE"):
        autotune_cache.configure(_autotuner())


def test_interpreter_never_uses_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert autotune_cache.configure(_autotuner(), enabled=True).cache_results is False


def test_turbo_kernels(compiled_mode):
    """The GEMM kernels without pre-hooks get the cache; the host-descriptor ones (box shapes set by a
    pre-hook) do not."""
    assert autotune_cache.disk_cacheable(gemm_kernel.gemm_tma_device_persistent_kernel)
    assert autotune_cache.disk_cacheable(gemm_kernel.gemm_persistent_kernel)
    assert not autotune_cache.disk_cacheable(gemm_kernel.gemm_tma_persistent_kernel)
    assert not autotune_cache.disk_cacheable(gemm_fp8_kernel.gemm_fp8_persistent_kernel)


_GEMM_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from triton.runtime.autotuner import Autotuner

    if sys.argv[1] == "read":  # the second process must not time any config of a key the first one tuned
        def _no_timing(self, *args, **kwargs):
            raise AssertionError("autotune timed a config that the disk cache holds")
        Autotuner._bench = _no_timing

    from primus_turbo.triton.gemm.gemm_kernel import gemm_triton

    torch.manual_seed(0)
    a = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 640, device="cuda", dtype=torch.bfloat16)
    c = gemm_triton(a, b, torch.bfloat16, variant="tma_device")
    torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=1e-2, atol=1e-1)
    print("ok")
    """
)

_FP8_SCRIPT = textwrap.dedent(
    """
    import torch
    from primus_turbo.triton.gemm.gemm_fp8_kernel import gemm_fp8_triton

    torch.manual_seed(0)
    a = torch.randn(512, 384, device="cuda")
    b = torch.randn(640, 384, device="cuda")
    a_s = a.abs().amax(1) / 448
    b_s = b.abs().amax(1) / 448
    qa = (a / a_s[:, None]).to(torch.float8_e4m3fn)
    qb = (b / b_s[:, None]).to(torch.float8_e4m3fn)
    c = gemm_fp8_triton(qa, a_s, qb, b_s, 1, 128, torch.float32)
    ref = (qa.float() * a_s[:, None]) @ (qb.float() * b_s[:, None]).T
    torch.testing.assert_close(c, ref, rtol=2e-2, atol=2e-1)
    print("ok")
    """
)


def _run(script: str, mode: str, cache_dir, extra_env=None) -> None:
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir), **(extra_env or {})}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


@pytest.mark.gpu
def test_second_process_reads_the_choice(tmp_path):
    _run(_GEMM_SCRIPT, "write", tmp_path)
    assert list(tmp_path.rglob("*.autotune.json")), "the first process wrote no autotune cache file"
    _run(_GEMM_SCRIPT, "read", tmp_path)


@pytest.mark.gpu
def test_pre_hook_kernel_survives_triton_cache_env(tmp_path):
    """Without the guard the second process fails: Triton writes the FP8 kernel's file without its
    pre-hook configs and then cannot pick a config from it."""
    for _ in range(2):
        _run(_FP8_SCRIPT, "run", tmp_path, {"TRITON_CACHE_AUTOTUNING": "1"})

