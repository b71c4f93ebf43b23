"""Triton's on-disk autotune cache for turbo's ``triton.autotune`` kernels.

A process times every config of an autotuned kernel once per new autotune key (Triton's do_bench: ~25 ms
of warm-up and ~100 ms of runs per config), before the first launch of each new shape: 6-24 s of the first
training step of ``llama3_8b_fp8`` / ``deepseek_moe_fp8`` with the TRITON FP8 GEMM (session 34, H200),
against ~2 s with cuBLAS. Triton can keep those timings in its cache directory (``TRITON_CACHE_DIR``,
default ``~/.triton/cache``) so that a later process (a restart, the next job, every rank after the first
on a shared cache) reads the chosen config instead of timing. Its file is keyed by the Triton version, the
target (``cuda:90``: an H100 and an H200 share it, so a cache written on one is read on the other), the
kernel's source, the config list, the environment variables Triton tracks, and the autotune key.

``configure(kernel)`` turns that cache on for a kernel whose configs can be restored from the file, and
**off** for a kernel whose configs carry a ``pre_hook`` (the host TMA descriptors' box shapes): Triton
drops pre-hook configs from the file it writes and a later process then fails reading it back (``min()`` of
an empty sequence), so such a kernel must not use it even when ``TRITON_CACHE_AUTOTUNING=1`` is set
globally. ``PRIMUS_TURBO_AUTOTUNE_CACHE=0`` (read when the kernels are defined, at import) turns it off for
every turbo kernel, e.g. to re-time after a driver change; ``1`` is the default. The CPU interpreter never
uses it.
"""

from __future__ import annotations

from typing import Any

from primus_turbo.env import parse_bool_env, triton_interpret_env

__all__ = ["ENV_AUTOTUNE_CACHE", "configure", "disk_cacheable", "cache_enabled"]

ENV_AUTOTUNE_CACHE = "PRIMUS_TURBO_AUTOTUNE_CACHE"


def cache_enabled() -> bool:
    """The ``PRIMUS_TURBO_AUTOTUNE_CACHE`` switch (default on; an unknown value is an error naming it)."""
    return parse_bool_env(ENV_AUTOTUNE_CACHE, default=True)


def disk_cacheable(autotuned: Any) -> bool:
    """True when every config of ``autotuned`` can be restored from Triton's cache file (no pre_hook)."""
    return all(getattr(config, "pre_hook", None) is None for config in autotuned.configs)


def configure(autotuned: Any, enabled: bool | None = None) -> Any:
    """Set ``autotuned.cache_results`` (Triton's switch for the on-disk cache) for a turbo kernel and return
    the kernel, so it can wrap a ``triton.autotune(...)`` result. ``enabled=None`` reads the environment."""
    if not hasattr(autotuned, "cache_results"):  # a Triton without the on-disk autotune cache
        return autotuned
    if enabled is None:
        enabled = cache_enabled()
    interpret = triton_interpret_env()
    autotuned.cache_results = bool(enabled) and disk_cacheable(autotuned) and not interpret
    return autotuned
