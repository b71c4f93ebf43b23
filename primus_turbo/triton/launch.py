"""Low-overhead relaunch of ``triton.autotune``d kernels.

A launch through ``triton.autotune`` + ``JITFunction.run`` costs 100-200 us of Python on the H100/H200
device hosts (binding every argument, the specialization key, the autotune key, the config pre-hook;
session 32: ``gemm_triton`` issued 144 us per call against 24 us for ``torch.mm``), more than a small
training GEMM runs on the GPU. ``launch_autotuned`` takes that path once per plan key (the autotuner
times its configs and launches the best; Triton returns the compiled kernel) and afterwards launches
the compiled kernel of the chosen config directly.

Both key a plan on ``specialization_key`` of the arguments (a superset of what Triton specializes on:
the integer arguments' values, the tensors' dtypes and 16-byte alignment, the descriptors' dtypes and
layouts) and the current device. ``launch_autotuned`` reuses the grid computed for the first call: the
grid must follow from the arguments and the config. CUDA only: the CPU interpreter runs Triton's own path
every time.
``PRIMUS_TURBO_TRITON_RELAUNCH=0`` (read at import) or ``set_relaunch(False)`` turns it off (A/B runs, or
a Triton whose compiled-kernel launcher differs). A plan keeps the compiled kernel of its first launch: after
changing Triton's ``knobs.runtime.debug`` or instrumentation mode, call ``clear_launch_plans()``.
Checked against Triton 3.6.0's source (session 32): the runner of ``CompiledKernel[grid]`` calls the launcher
exactly as ``JITFunction.run`` does (constexprs included, in signature order; stream, hooks and scratch
handled per call), and 3.6 specializes a launch on a subset of what these keys hold.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from primus_turbo.env import parse_bool_env

__all__ = [
    "launch_autotuned",
    "launch_jit",
    "specialization_key",
    "clear_launch_plans",
    "launch_plan_count",
    "set_relaunch",
    "relaunch_enabled",
]

ENV_RELAUNCH = "PRIMUS_TURBO_TRITON_RELAUNCH"


def _env_enabled() -> bool:
    return parse_bool_env(ENV_RELAUNCH, default=True)


_ENABLED = _env_enabled()

_PLANS: dict[tuple, tuple[Any, Any, tuple[int, ...], tuple[str, ...]] | None] = {}
_MAX_PLANS = 4096
_LOCK = threading.Lock()
_FIRST_LOCK = threading.RLock()


def _relaunch(plan, args: dict[str, Any]) -> None:
    kernel, config, grid, names = plan
    full = {**args, **config.kwargs}
    if config.pre_hook is not None:  # e.g. TMA descriptor box shapes of this config
        config.pre_hook(full)
    kernel[grid](*[full[name] for name in names])


def _first_launch(autotuned, grid, args: dict[str, Any]):
    """The autotuned launch, the arguments passed by position as Triton's own callers do (the autotuner
    hands only positional arguments to ``early_config_prune`` hooks)."""
    names = autotuned.fn.arg_names
    head = names[: len(args)]
    if set(head) == args.keys():
        return autotuned[grid](*[args[name] for name in head])
    return autotuned[grid](**args)


def launch_autotuned(
    autotuned, grid: Callable[[dict[str, Any]], tuple[int, ...]], args: dict[str, Any]
) -> None:
    """Launch ``autotuned`` (a ``triton.autotune`` kernel) with ``args`` (every non-config argument, by
    name). ``grid(meta)`` gives the launch grid for a config's meta-parameters. A call whose arguments have
    a specialization seen before skips the autotuner and the JIT binder."""
    if not (_ENABLED and _on_cuda((), args)):
        _first_launch(autotuned, grid, args)
        return
    key = (id(autotuned), _device_index(), specialization_key(args.values()))
    plan = _PLANS.get(key)
    if plan is not None:
        _relaunch(plan, args)
        return
    # One first launch at a time: the plan pairs the kernel Triton returns with ``best_config``, which another
    # thread's first launch would overwrite in between (and Triton's Autotuner.nargs is not thread-safe)
    with _FIRST_LOCK:
        kernel = _first_launch(autotuned, grid, args)
        if key in _PLANS:  # None: this kernel cannot be relaunched directly (see below)
            return
        config = autotuned.best_config
    names = tuple(autotuned.fn.arg_names)
    meta = {**args, **config.all_kwargs()}
    # Triton returns the CompiledKernel it launched; anything else (an interpreter function, an API
    # change) keeps the autotuned path for this key rather than guessing at a launcher.
    runnable = hasattr(kernel, "run") and hasattr(kernel, "__getitem__") and set(names) <= meta.keys()
    with _LOCK:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        grid3 = (tuple(grid(meta)) + (1, 1))[:3]  # CompiledKernel's runner reads all three dimensions
        _PLANS[key] = (kernel, config, grid3, names) if runnable else None


_SCALARS = frozenset((bool, int, float, str, type(None)))


def _desc_spec(value: Any) -> Any:
    if type(value) is tuple:  # element by element (a tensor inside keys by dtype and alignment, not identity)
        return (tuple,) + specialization_key(value)
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(value, "block_shape"):  # a host TensorDescriptor
        return ("desc", base.dtype, base.data_ptr() % 16 == 0, tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), getattr(value, "padding", None),
                getattr(value, "round_f32_to_tf32", None))  # fmt: skip
    return value  # constexpr objects such as tl.float8e4nv (hashable)


def specialization_key(values: Iterable[Any]) -> tuple:
    """A superset of what Triton specializes a launch on, from the argument values: each tensor's dtype and
    16-byte alignment, each descriptor's dtype, alignment, shape, strides and box, any other value itself
    with its type (True and 1 specialize differently). One flat loop: it runs on every launch (2.9 us for 27
    arguments on the idle CI CPU; a helper call per argument, 4.1)."""
    out: list[Any] = []
    add = out.append
    for value in values:
        kind = type(value)
        if kind in _SCALARS:
            add(kind)
            add(value)
        elif isinstance(value, torch.Tensor):
            add(value.dtype)
            add(value.data_ptr() % 16 == 0)
        else:
            add(_desc_spec(value))
    return tuple(out)


def _on_cuda(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether any tensor argument, or a TMA descriptor's base, is on a CUDA device."""
    for value in (*args, *kwargs.values()):
        tensor = value if isinstance(value, torch.Tensor) else getattr(value, "base", None)
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            return True
    return False


def _device_index() -> int:  # the device Triton launches on (its current device)
    return torch.cuda.current_device()


_DEFAULTS: dict[int, dict[str, Any]] = {}


def _defaults(kernel) -> dict[str, Any]:
    found = _DEFAULTS.get(id(kernel))
    if found is None:
        params = inspect.signature(kernel.fn).parameters.values()
        found = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        _DEFAULTS[id(kernel)] = found
    return found


def launch_jit(kernel, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` for a plain ``@triton.jit`` kernel; from the second call with the
    same specialization (``specialization_key`` of the arguments, the launch options, the device) the
    compiled kernel is launched directly (omitted parameters take the kernel's defaults, as in Triton's
    binder)."""
    if not (_ENABLED and _on_cuda(args, kwargs)):
        kernel[grid](*args, **kwargs)
        return
    names = kernel.arg_names
    if len(args) > len(names):  # Triton reports the misuse
        kernel[grid](*args, **kwargs)
        return
    bound = dict(zip(names, args))
    options = {}
    for name, value in kwargs.items():
        (bound if name in names else options)[name] = value
    for name, value in _defaults(kernel).items():  # what Triton's binder fills in for omitted parameters
        bound.setdefault(name, value)
    key = (id(kernel), _device_index(), tuple(sorted(options.items())), tuple(bound),
           specialization_key(bound.values()))  # fmt: skip
    grid3 = (tuple(grid) + (1, 1))[:3]
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument (a list, say): no key, Triton's own path every time
        kernel[grid](*args, **kwargs)
        return
    if plan is not None:
        compiled, order = plan
        compiled[grid3](*[bound[name] for name in order])
        return
    compiled = kernel[grid](*args, **kwargs)
    if key in _PLANS:
        return
    runnable = hasattr(compiled, "run") and hasattr(compiled, "__getitem__") and set(names) <= bound.keys()
    with _LOCK:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = (compiled, tuple(names)) if runnable else None


def set_relaunch(enabled: bool) -> None:
    """Turn the direct relaunch on or off for this process (plans made so far are kept for later)."""
    global _ENABLED
    _ENABLED = bool(enabled)


def relaunch_enabled() -> bool:
    return _ENABLED


def clear_launch_plans() -> None:
    with _LOCK:
        _PLANS.clear()


def launch_plan_count(autotuned=None) -> int:
    """Plans held (for ``autotuned`` only when given); tests check the fast path is taken."""
    return sum(1 for k, v in _PLANS.items() if v is not None and (autotuned is None or k[0] == id(autotuned)))
