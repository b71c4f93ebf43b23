"""CPU shims for Megatron-Core 0.16.1: everything Megatron needs to train without a CUDA device.

Used only when ``torch.cuda.is_available()`` is False (dev machine, CI). Megatron-Core assumes a GPU in a
few places that are not on the compute path: buffers allocated with ``device=torch.cuda.current_device()``,
``torch.cuda.synchronize()``, side streams for gradient reduction, the CUDA RNG tracker and memory stats.
Each shim below maps one of those to its CPU meaning; nothing here changes numerics.

What breaks on CPU without these (megatron-core 0.16.1, torch 2.13 CPU, no apex, no TE):
- ``torch.cuda.current_device()`` raises (no driver): param/grad buffers (DDP, distributed optimizer),
  ``tensor_parallel.layers`` workspaces.
- ``torch.cuda.synchronize`` / ``torch.cuda.Stream`` / ``torch.cuda.stream`` raise.
- ``tensor_parallel.random``: ``_get_cuda_rng_state``/``_set_cuda_rng_state`` and
  ``model_parallel_cuda_manual_seed`` (``torch.cuda.manual_seed``) need CUDA generators.
- ``Tensor.cuda()`` calls in the schedule and optimizer; ``param.type() == "torch.cuda.FloatTensor"`` checks
  in the (distributed) optimizer; ``device="cuda"`` literals (see ``_CpuTorch``).
"""

from __future__ import annotations

import contextlib
import importlib
import types

import torch

_APPLIED = False
_ORIGINALS: list[tuple[object, str, object]] = []  # (object, attribute, original value) for remove_cpu_shims
TESTED_MEGATRON_CORE = ("0.16.1",)


class _NullStream:
    """Stands in for torch.cuda.Stream: every op is already ordered on CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        pass


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _cpu_device(*args, **kwargs):
    return torch.device("cpu")


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CpuTorch:
    """A view of the ``torch`` module whose functions turn ``device="cuda"`` into ``device="cpu"`` (and drop
    ``pin_memory``, which needs an accelerator).

    Installed as the module-global ``torch`` of the Megatron modules listed in ``_MODULES_WITH_CUDA_LITERALS``
    (they allocate small bookkeeping tensors such as overflow flags and norms on ``"cuda"`` literally).
    Classes (``torch.Tensor``, ``torch.dtype``...) pass through untouched so ``isinstance`` still works.
    """

    def __init__(self):
        self._wrapped = {}

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if not isinstance(attr, types.BuiltinFunctionType | types.FunctionType):
            return attr
        if name not in self._wrapped:

            def call(*args, _fn=attr, **kwargs):
                if _is_cuda(kwargs.get("device")):
                    kwargs["device"] = "cpu"
                kwargs.pop("pin_memory", None)  # needs an accelerator; staging for a .cuda() that is a no-op
                return _fn(*args, **kwargs)

            self._wrapped[name] = call
        return self._wrapped[name]


# Megatron-Core modules on the training path that write device="cuda" literally (0.16.1).
_MODULES_WITH_CUDA_LITERALS = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.models.common.embeddings.rope_utils",  # context parallelism: RoPE slice per CP rank
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.data",
    "megatron.core.utils",
)


def apply_cpu_shims() -> list[str]:
    """Install the shims once per process. Returns the names of the patched attributes.

    Raises RuntimeError when a CUDA device is present: the shims must never run on a GPU machine.
    """
    global _APPLIED
    if torch.cuda.is_available():
        raise RuntimeError("apply_cpu_shims() called on a machine with a CUDA device; they are CPU-only")
    if _APPLIED:
        return []
    patched = []

    def put(obj, name, value):
        _ORIGINALS.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)
        patched.append(f"{getattr(obj, '__name__', type(obj).__name__)}.{name}")

    put(torch.cuda, "current_device", _cpu_device)
    put(torch.cuda, "synchronize", lambda *a, **k: None)
    put(torch.cuda, "Stream", _NullStream)
    put(torch.cuda, "Event", _NullEvent)
    put(torch.cuda, "current_stream", lambda *a, **k: _NullStream())
    put(torch.cuda, "default_stream", lambda *a, **k: _NullStream())
    put(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    put(torch.cuda, "manual_seed", lambda seed: None)
    put(torch.cuda, "manual_seed_all", lambda seed: None)
    put(torch.cuda, "max_memory_allocated", lambda *a, **k: 0)
    put(torch.cuda, "memory_allocated", lambda *a, **k: 0)
    put(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    put(torch.cuda, "empty_cache", lambda *a, **k: None)
    put(torch.cuda, "device_count", lambda: 0)
    put(torch.Tensor, "cuda", lambda self, *a, **k: self)
    # The optimizers classify params by ``param.type() == "torch.cuda.FloatTensor"``: report CPU tensors
    # under their CUDA type name (only the no-argument form, which returns a string).
    original_type = torch.Tensor.type

    def type_as_cuda(self, *args, **kwargs):
        if args or kwargs:
            return original_type(self, *args, **kwargs)
        name = original_type(self)
        return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)

    put(torch.Tensor, "type", type_as_cuda)
    put(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    put(torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))

    from megatron.core.tensor_parallel import random as mp_random

    put(mp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    put(mp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    cpu_torch = _CpuTorch()
    for module_name in _MODULES_WITH_CUDA_LITERALS:
        module = importlib.import_module(module_name)
        if getattr(module, "torch", None) is torch:
            put(module, "torch", cpu_torch)
    _APPLIED = True
    return patched


def remove_cpu_shims() -> None:
    """Undo apply_cpu_shims (tests that build Megatron modules in-process restore torch afterwards)."""
    global _APPLIED
    while _ORIGINALS:
        obj, name, original = _ORIGINALS.pop()
        setattr(obj, name, original)
    _APPLIED = False
