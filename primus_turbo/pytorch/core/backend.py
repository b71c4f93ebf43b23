"""Backend selection for multi-backend ops.

Every multi-backend op (GEMM, grouped GEMM, attention, MoE dispatch/combine) has one
``AutoKernelDispatcher`` subclass that knows its ``KernelBackend`` implementations. The dispatcher
resolves a backend per call with this priority:

    code setter (GlobalBackendManager.set_*_backend)
    > environment variable (PRIMUS_TURBO_<OP>_BACKEND)
    > autotune (timed once per ``make_key``, cached in a bounded LRU)
    > the dispatcher's in-code default
    > fallback: the first registered backend whose ``can_handle`` is True.

A backend pinned by the user (setter or env var) that cannot handle the inputs raises
``ValueError``: we never silently run something other than what was asked for.

Environment value syntax (case-insensitive): ``TRITON`` (all precisions) or per precision
``fp8:TRITON,bf16:CUBLAS,other:TORCH``. Precision keys: fp8, bf16, fp16, fp32, other.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar

import torch

from primus_turbo.env import parse_bool_env

__all__ = [
    "BackendType",
    "GlobalBackendManager",
    "KernelBackend",
    "AutoKernelDispatcher",
    "PRECISION_KEYS",
    "precision_of_dtype",
]


class BackendType(Enum):
    TORCH = "TORCH"  # eager reference; runs on CPU
    CUBLAS = "CUBLAS"  # torch.mm / torch._scaled_mm
    CUTLASS = "CUTLASS"  # torch._grouped_mm / torch._scaled_grouped_mm
    CUDNN = "CUDNN"  # SDPA with the cuDNN backend forced
    FLASH = "FLASH"  # SDPA with the flash backend forced
    TRITON = "TRITON"  # our Triton kernels
    TURBO = "TURBO"  # our CUDA C++ kernels (csrc/)
    NCCL = "NCCL"  # torch.distributed collectives (gloo on CPU)
    SYMM_MEM = "SYMM_MEM"  # torch symmetric-memory fused ops
    DEEP_EP = "DEEP_EP"  # the external deep_ep package, when importable

    # Enum's own __hash__ stays (hash of the name, a Python call): an identity __hash__ (object.__hash__)
    # saved a few us per dispatch but made Dynamo in torch 2.11 refuse every dispatch under torch.compile
    # ("user-defined object with overridden __hash__"; fullgraph failed, GPU session 36).

    @classmethod
    def parse(cls, value: BackendType | str, *, source: str) -> BackendType:
        if isinstance(value, BackendType):
            return value
        if isinstance(value, str):
            name = value.strip().upper()
            if name in cls.__members__:
                return cls[name]
        raise ValueError(
            f"{source}: unknown backend {value!r}; accepted: {', '.join(cls.__members__)} (case-insensitive)"
        )


PRECISION_KEYS = ("fp8", "bf16", "fp16", "fp32", "other")

_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


_PRECISION_OF = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_PRECISION_OF.update({dtype: "fp8" for dtype in _FP8_DTYPES})


def precision_of_dtype(dtype: torch.dtype) -> str:
    """Map a tensor dtype to its precision key for backend selection."""
    return _PRECISION_OF.get(dtype, "other")


# op name -> environment variable
_OP_ENV = {
    "gemm": "PRIMUS_TURBO_GEMM_BACKEND",
    "grouped_gemm": "PRIMUS_TURBO_GROUPED_GEMM_BACKEND",
    "grouped_wgrad_accumulate": "PRIMUS_TURBO_GROUPED_WGRAD_ACCUMULATE_BACKEND",
    "attention": "PRIMUS_TURBO_ATTENTION_BACKEND",
    "moe_dispatch_combine": "PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND",
    "async_tp": "PRIMUS_TURBO_ASYNC_TP_BACKEND",
}
ENV_AUTO_TUNE = "PRIMUS_TURBO_AUTO_TUNE"


def parse_backend_spec(value: str, *, source: str) -> dict[str, BackendType]:
    """Parse ``TRITON`` or ``fp8:TRITON,bf16:CUBLAS,other:TORCH`` into {precision: backend}.

    A bare backend name maps to every precision under the key ``"*"``.
    """
    value = value.strip()
    if not value:
        return {}
    if ":" not in value:
        return {"*": BackendType.parse(value, source=source)}
    spec: dict[str, BackendType] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        if ":" not in item:
            raise ValueError(
                f"{source}: entry {item!r} has no precision; write 'precision:BACKEND' for every entry "
                f"(precisions: {', '.join(PRECISION_KEYS)}) or a single backend name for all"
            )
        precision, backend = (part.strip() for part in item.split(":", 1))
        precision = precision.lower()
        if precision not in PRECISION_KEYS:
            raise ValueError(
                f"{source}: unknown precision {precision!r}; accepted: {', '.join(PRECISION_KEYS)}"
            )
        if precision in spec:  # 'fp8:TRITON,fp8:CUBLAS': which one was meant is a guess
            raise ValueError(f"{source}: precision {precision!r} is given twice in {value!r}")
        spec[precision] = BackendType.parse(backend, source=source)
    return spec


def _lookup(spec: dict[str, BackendType], precision: str) -> BackendType | None:
    if precision in spec:
        return spec[precision]
    if "*" in spec:
        return spec["*"]
    return spec.get("other")


class GlobalBackendManager:
    """Process-wide backend choices by op x precision, and the autotune switch."""

    _code: ClassVar[dict[str, dict[str, BackendType]]] = {}
    _auto_tune: ClassVar[bool | None] = None
    _env_cache: ClassVar[dict[tuple[str, str], dict[str, BackendType]]] = {}

    # -- setters --------------------------------------------------------------------------------
    @classmethod
    def _set(cls, op: str, backend: BackendType | str | None, precision: str | None) -> None:
        """Pin ``backend`` for ``precision`` (None: every precision, replacing the per-precision pins made
        before, so the last call wins); ``backend=None`` removes that pin."""
        where = f"GlobalBackendManager.set_{op}_backend"
        if precision is not None:
            if not isinstance(precision, str):
                accepted = ", ".join(PRECISION_KEYS)
                raise TypeError(f"{where}: precision must be a str ({accepted}) or None, got {precision!r}")
            precision = precision.strip().lower()
            if precision not in PRECISION_KEYS:
                raise ValueError(
                    f"{where}: unknown precision {precision!r}; accepted: {', '.join(PRECISION_KEYS)}"
                )
        parsed = None if backend is None else BackendType.parse(backend, source=f"{where}(backend=...)")
        # a new table rather than edits of the live one: a dispatch on another thread (autograd's backward)
        # sees the old pins or the new ones, never a half-cleared table
        table = {} if precision is None else dict(cls._code.get(op, {}))
        if parsed is not None:
            table[precision or "*"] = parsed
        elif precision is not None:
            table.pop(precision, None)
        cls._code = {**cls._code, op: table}

    @classmethod
    def set_gemm_backend(cls, backend: BackendType | str | None, precision: str | None = None) -> None:
        cls._set("gemm", backend, precision)

    @classmethod
    def set_grouped_gemm_backend(
        cls, backend: BackendType | str | None, precision: str | None = None
    ) -> None:
        cls._set("grouped_gemm", backend, precision)

    @classmethod
    def set_grouped_wgrad_accumulate_backend(
        cls, backend: BackendType | str | None, precision: str | None = None
    ) -> None:
        cls._set("grouped_wgrad_accumulate", backend, precision)

    @classmethod
    def set_attention_backend(cls, backend: BackendType | str | None, precision: str | None = None) -> None:
        cls._set("attention", backend, precision)

    @classmethod
    def set_moe_dispatch_combine_backend(
        cls, backend: BackendType | str | None, precision: str | None = None
    ) -> None:
        cls._set("moe_dispatch_combine", backend, precision)

    @classmethod
    def set_async_tp_backend(cls, backend: BackendType | str | None, precision: str | None = None) -> None:
        cls._set("async_tp", backend, precision)

    @classmethod
    def set_auto_tune(cls, enabled: bool | None) -> None:
        """True/False override PRIMUS_TURBO_AUTO_TUNE; None defers to it again."""
        if enabled is not None and not isinstance(enabled, bool):  # "false" or "0" would be truthy
            raise TypeError(
                f"GlobalBackendManager.set_auto_tune: enabled must be a bool or None, got {enabled!r}"
            )
        cls._auto_tune = enabled

    @classmethod
    def reset(cls) -> None:
        """Clear code-set backends, the autotune switch and every dispatcher's autotune cache."""
        cls._code = {}
        cls._auto_tune = None
        cls._env_cache = {}
        for dispatcher in AutoKernelDispatcher.registry():
            dispatcher.clear_cache()

    # -- getters --------------------------------------------------------------------------------
    @classmethod
    def user_backend(cls, op: str, precision: str) -> tuple[BackendType | None, str]:
        """The backend the user pinned for (op, precision) and where it came from ('code'/'env')."""
        backend = _lookup(cls._code.get(op, {}), precision)
        if backend is not None:
            return backend, "code"
        env = _OP_ENV.get(op)
        if env is None:
            return None, ""
        raw = os.environ.get(env, "")
        cached = cls._env_cache.get((env, raw))
        if cached is None:
            cached = parse_backend_spec(raw, source=env)
            cls._env_cache[(env, raw)] = cached
        backend = _lookup(cached, precision)
        return backend, ("env " + env) if backend is not None else ""

    @classmethod
    def auto_tune_enabled(cls) -> bool:
        if cls._auto_tune is not None:
            return cls._auto_tune
        return parse_bool_env(ENV_AUTO_TUNE)


class KernelBackend:
    """One implementation of an op. Subclasses override both methods as staticmethods/classmethods.

    ``can_handle`` returns False (never raises) for inputs it cannot serve, and ``refusal`` may say why;
    ``execute`` must not
    mutate its inputs (the autotuner runs every candidate on the same inputs).

    ``syncs_host``: True for a backend that reads device values on the host (a reference loop over
    ``group_lens.tolist()``). The autotuner never times it on CUDA inputs: a sync-free op must not start
    synchronizing because a loop of cuBLAS calls happened to win a timing (grouped GEMM at skewed
    DeepSeek-V3 and Mixtral shapes did, session 25). Pinning it still works.
    """

    syncs_host: ClassVar[bool] = False

    @staticmethod
    def can_handle(**kwargs: Any) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    @staticmethod
    def refusal(**kwargs: Any) -> str | None:
        """Why ``can_handle`` refuses these inputs ("<argument> (accepted: ...)"), for the error a pinned
        backend raises; None when it serves them or gives no reason."""
        return None

    @staticmethod
    def execute(**kwargs: Any) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _on_cuda(kwargs: dict[str, Any]) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_cuda for v in kwargs.values())


class AutoKernelDispatcher:
    """Base class of a per-op dispatcher. Subclasses set the class attributes and ``make_key``."""

    op_name: ClassVar[str] = ""
    backends: ClassVar[dict[BackendType, type[KernelBackend]]] = {}
    autotune_warmup: ClassVar[int] = 3
    autotune_iters: ClassVar[int] = 10
    cache_size: ClassVar[int] = 1024
    # True when the automatic choice (default_backend + can_handle) depends on nothing but make_key's
    # fields: it is then memoized per key (a dict lookup instead of ~7-13 us of Python per call, measured
    # on H100 for gemm_fp8). Pins and autotune are still looked up on every call.
    cache_default: ClassVar[bool] = False
    # False for an in-place op: the autotuner runs every candidate on the same buffers
    autotune: ClassVar[bool] = True
    # A challenger must beat the in-code default by this fraction of its time to be chosen (0: the
    # fastest wins): a few timed runs carry noise, and a near-tie should not flip a measured default.
    autotune_margin: ClassVar[float] = 0.0

    _registry: ClassVar[list[type[AutoKernelDispatcher]]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls._cache: OrderedDict[tuple, BackendType] = OrderedDict()
        cls._default_cache: dict[tuple, BackendType] = {}
        cls.last_backend: BackendType | None = None
        AutoKernelDispatcher._registry.append(cls)

    @classmethod
    def registry(cls) -> list[type[AutoKernelDispatcher]]:
        return list(cls._registry)

    @classmethod
    def clear_cache(cls) -> None:
        cls._cache.clear()
        cls._default_cache.clear()
        cls.last_backend = None

    # -- to override ----------------------------------------------------------------------------
    @classmethod
    def make_key(cls, **kwargs: Any) -> tuple:
        """Everything that changes the best kernel: shapes, dtypes, layouts, key scalars."""
        raise NotImplementedError

    @classmethod
    def precision(cls, **kwargs: Any) -> str:
        """Precision key of this call; default: dtype of the first tensor argument."""
        for v in kwargs.values():
            if isinstance(v, torch.Tensor):
                return precision_of_dtype(v.dtype)
        return "other"

    @classmethod
    def default_backend(cls, **kwargs: Any) -> BackendType | None:
        """In-code default for these inputs (None: use the fallback order)."""
        return None

    # -- resolution -----------------------------------------------------------------------------
    @classmethod
    def candidates(cls, **kwargs: Any) -> list[BackendType]:
        return [b for b, impl in cls.backends.items() if impl.can_handle(**kwargs)]

    @classmethod
    def resolve(cls, **kwargs: Any) -> BackendType:
        precision = cls.precision(**kwargs)
        pinned, source = GlobalBackendManager.user_backend(cls.op_name, precision)
        if pinned is not None:
            impl = cls.backends.get(pinned)
            if impl is None:
                raise ValueError(
                    f"{cls.op_name}: backend {pinned.name} (from {source}) is not implemented for this op; "
                    f"available: {', '.join(b.name for b in cls.backends)}"
                )
            if not impl.can_handle(**kwargs):
                msg = (
                    f"{cls.op_name}: backend {pinned.name} (from {source}) cannot handle these inputs "
                    f"({cls.describe(**kwargs)}); backends that can: "
                    f"{', '.join(b.name for b in cls.candidates(**kwargs)) or 'none'}"
                )
                reason = impl.refusal(**kwargs)
                if reason is not None:  # say which argument it refuses and what it accepts
                    where = f"GlobalBackendManager.set_{cls.op_name}_backend" if source == "code" else source
                    msg = f"{cls.op_name}: backend {pinned.name} (pinned by {where}) refuses {reason}. {msg}"
                raise ValueError(msg)
            return pinned

        if cls.autotune and GlobalBackendManager.auto_tune_enabled():
            key = (precision,) + tuple(cls.make_key(**kwargs))
            # A hit takes no lock (OrderedDict's get/move_to_end are atomic under the GIL, and Dynamo cannot
            # enter a lock: fullgraph failed) and is used under CUDA-graph capture and torch.compile too.
            hit = cls._cache.get(key)
            if hit is not None:
                if not torch.compiler.is_compiling():  # no LRU bookkeeping in a traced graph
                    try:
                        cls._cache.move_to_end(key)
                    except KeyError:  # evicted by another thread since the get
                        pass
                return hit
            # A miss is timed eagerly, never while Dynamo traces (fake tensors) or a CUDA graph is captured
            # (the candidates' launches would be captured): the default below runs then, untimed.
            if not torch.compiler.is_compiling():
                best = None if _is_capturing() else cls._autotune(**kwargs)
                if best is not None:
                    with cls._lock:
                        cls._cache[key] = best
                        while len(cls._cache) > cls.cache_size:
                            cls._cache.popitem(last=False)
                    return best

        if not cls.cache_default:
            return cls._automatic(**kwargs)
        key = (precision,) + tuple(cls.make_key(**kwargs))
        hit = cls._default_cache.get(key)
        if hit is None:
            hit = cls._automatic(**kwargs)
            if not _is_capturing():  # under capture, probes decline: that answer is not kept
                if len(cls._default_cache) >= cls.cache_size:
                    cls._default_cache.clear()
                cls._default_cache[key] = hit
        return hit

    @classmethod
    def _automatic(cls, **kwargs: Any) -> BackendType:
        """The in-code default if it can handle the inputs, else the first backend that can."""
        default = cls.default_backend(**kwargs)
        if default is not None and default in cls.backends and cls.backends[default].can_handle(**kwargs):
            return default
        for backend, impl in cls.backends.items():
            if impl.can_handle(**kwargs):
                return backend
        raise ValueError(f"{cls.op_name}: no backend can handle these inputs ({cls.describe(**kwargs)})")

    @classmethod
    def dispatch(cls, **kwargs: Any) -> Any:
        backend = cls.resolve(**kwargs)
        if not torch.compiler.is_compiling():  # dynamo cannot trace a class-attribute write
            cls.last_backend = backend
        return cls.backends[backend].execute(**kwargs)

    @classmethod
    def describe(cls, **kwargs: Any) -> str:
        parts = []
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                parts.append(f"{k}={tuple(v.shape)} {str(v.dtype).replace('torch.', '')} {v.device.type}")
            elif isinstance(v, (int, float, bool, str, torch.dtype)) or v is None:
                parts.append(f"{k}={v}")
        return ", ".join(parts)

    # -- autotune -------------------------------------------------------------------------------
    @classmethod
    def _time(cls, fn: Callable[[], Any], on_cuda: bool) -> float:
        for _ in range(cls.autotune_warmup):
            fn()
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(cls.autotune_iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / cls.autotune_iters
        t0 = time.perf_counter()
        for _ in range(cls.autotune_iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / cls.autotune_iters

    @classmethod
    def _autotune(cls, **kwargs: Any) -> BackendType | None:
        """Time every candidate (never a ``syncs_host`` one on CUDA inputs); the fastest wins, unless
        the in-code default is timed within ``autotune_margin`` of it."""
        on_cuda = _on_cuda(kwargs)
        timings: dict[BackendType, float] = {}
        for backend in cls.candidates(**kwargs):
            impl = cls.backends[backend]
            if on_cuda and impl.syncs_host:
                continue
            try:
                timings[backend] = cls._time(lambda impl=impl: impl.execute(**kwargs), on_cuda)
            except Exception:  # a candidate that fails to compile/run is simply not chosen
                continue
        if not timings:
            return None
        best = min(timings, key=timings.get)
        default = cls.default_backend(**kwargs)
        if default in timings and timings[best] > timings[default] * (1 - cls.autotune_margin):
            return default
        return best
