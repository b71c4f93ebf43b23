"""``turbo.fp8_autocast``: turn FP8 on/off for a region, and delayed-scaling amax histories.

Turbo modules (Float8Linear, Linear with an FP8 config, ...) read the innermost active context:

    with turbo.fp8_autocast(enabled=True, config=Float8QuantConfig(granularity=BLOCKWISE)):
        y = model(x)                       # every turbo Linear runs FP8 with that config
        with turbo.fp8_autocast(enabled=False):
            logits = model.lm_head(y)      # ...except what runs in here (first/last layers)

A module's own config wins over the context's config; ``enabled=False`` wins over both.
The state is a module-level stack (a plain list, so torch.compile traces and guards on it; a
ContextVar graph-breaks under fullgraph). Backward passes run outside the context; modules
capture the recipe at forward time, so the backward matches the forward.

Activation checkpointing recomputes the forward during backward, outside the block: pass
``context_fn=turbo.fp8_checkpoint_context_fn`` to ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` so the recomputation runs under the state of the original forward. Without it, a
module that follows the context recomputes in another precision: a CheckpointError, or with
``use_reentrant=True`` the gradients of another function. Modules with their own config need none of this.
DELAYED scaling: a recomputed forward pushes no amax (the original forward did), so the window covers
``amax_history_len`` steps with or without recomputation. It quantizes with the scale of the history as it
is then, which includes the original forward's amax: with ``amax_compute_algo='max'`` it differs from the
forward's only where that amax is the window's largest.

Delayed scaling (``ScalingStrategy.DELAYED``, Transformer Engine's DelayedScaling): each quantized
tensor keeps an ``AmaxHistory`` on device; its scale comes from the history (max over the window or
the most recent entry) and the current amax is pushed after the cast, all with device ops (no host
sync). The very first call of a history uses current scaling, so step 0 does not saturate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig

__all__ = [
    "fp8_autocast",
    "fp8_autocast_state",
    "fp8_checkpoint_context_fn",
    "resolve_fp8_config",
    "FP8AutocastState",
    "AmaxHistory",
    "DelayedScalingState",
]


@dataclass(frozen=True)
class FP8AutocastState:
    enabled: bool
    config: Float8QuantConfig | None


_STACK: list[FP8AutocastState] = []


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, config: Float8QuantConfig | None = None):
    """Run turbo modules in FP8 (``enabled=True``) or high precision (``False``) inside the block."""
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast: enabled must be a bool, got {enabled!r}")
    if config is not None and not isinstance(config, Float8QuantConfig):
        raise TypeError(
            f"fp8_autocast: config must be a Float8QuantConfig or None, got {type(config).__name__}"
        )
    _STACK.append(FP8AutocastState(enabled, config))
    try:
        yield
    finally:
        _STACK.pop()


def fp8_checkpoint_context_fn():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False, context_fn=...)``:
    a no-op for the forward, and for the recomputation a context that replays this forward's state."""
    return contextlib.nullcontext(), _replay(list(_STACK))


@contextlib.contextmanager
def _replay(snapshot: list):
    saved = list(_STACK)
    _STACK[:] = snapshot  # in place: the list object is what torch.compile guards on
    try:
        yield
    finally:
        _STACK[:] = saved


def fp8_autocast_state() -> FP8AutocastState | None:
    """The innermost active fp8_autocast state, or None outside any."""
    return _STACK[-1] if _STACK else None


def resolve_fp8_config(
    module_config: Float8QuantConfig | None, fp8_by_default: bool
) -> Float8QuantConfig | None:
    """The FP8 recipe a turbo module should use now, or None for high precision.

    ``fp8_autocast(enabled=False)`` wins; then the module's own config; then the autocast's config
    (or the default config when the autocast gives none); outside any autocast, modules that are
    FP8 by construction (``fp8_by_default``) use the default config and others stay high precision.
    """
    state = fp8_autocast_state()
    if state is not None and not state.enabled:
        return None
    if module_config is not None:
        return module_config
    if state is not None:
        return state.config or Float8QuantConfig()
    return Float8QuantConfig() if fp8_by_default else None


class AmaxHistory(torch.nn.Module):
    """Rolling window of amaxes for one tensor; index 0 is the most recent.

    The buffer is non-persistent: modules that own histories keep nn.Linear-compatible state dicts.
    A history on the meta device (built there, or moved there with ``.to("meta")``) starts over at
    its first push after ``to_empty``, as a new one does.
    """

    def __init__(self, length: int = 16, algo: str = "max", device=None) -> None:
        super().__init__()
        if length < 1:
            raise ValueError(f"AmaxHistory: length must be >= 1, got {length}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"AmaxHistory: algo must be 'max' or 'most_recent', got {algo!r}")
        self.algo = algo
        self.initialized = False  # python flag: the first quantization uses current scaling
        self.register_buffer(
            "history", torch.zeros(length, dtype=torch.float32, device=device), persistent=False
        )

    def amax(self) -> torch.Tensor:
        return self.history.amax() if self.algo == "max" else self.history[0]

    def scale(self, fp8_dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
        """Device scalar ``fp8_max / amax`` (1 where the history is all zero), rounded down to a power of two
        with ``power_of_two`` (the config's ``power_of_two_scales``)."""
        from primus_turbo.pytorch.kernels.quantization.quantization_impl import scale_from_amax

        return scale_from_amax(self.amax(), fp8_dtype, power_of_two)

    @torch.no_grad()
    def update(self, amax: torch.Tensor) -> None:
        amax = amax.detach().float().reshape(1).to(self.history.device)
        # the first push starts the window: the buffer is not known to be zero then (a history built on
        # meta and materialized with to_empty holds uninitialized memory, whose huge values would set the
        # scale for amax_history_len steps and flush every quantized value to zero)
        rest = self.history[:-1] if self.initialized else torch.zeros_like(self.history[:-1])
        self.history.copy_(torch.cat([amax, rest]))
        self.initialized = True

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        if self.history.is_meta:  # no values on meta: after to_empty the window restarts
            self.initialized = False
        return self


class DelayedScalingState(torch.nn.Module):
    """The three histories one FP8 GEMM needs: its two inputs and the output gradient."""

    def __init__(self, config: Float8QuantConfig, device=None) -> None:
        super().__init__()
        n, algo = config.amax_history_len, config.amax_compute_algo
        self.a = AmaxHistory(n, algo, device)
        self.b = AmaxHistory(n, algo, device)
        self.grad = AmaxHistory(n, algo, device)

    def matches(self, config: Float8QuantConfig) -> bool:
        """Whether these histories have ``config``'s length and reduction (a module run under another
        DELAYED ``fp8_autocast`` config builds new ones rather than keep the first config's)."""
        return self.a.history.numel() == config.amax_history_len and self.a.algo == config.amax_compute_algo
