"""Environment-variable parsing shared by every layer (no torch or Triton imports: the Triton launch helpers
read it at import, before ``primus_turbo.pytorch`` exists)."""

from __future__ import annotations

import os

__all__ = ["parse_bool_env", "triton_interpret_env"]


def parse_bool_env(name: str, default: bool = False) -> bool:
    """A yes/no environment variable (1/0/true/false/on/off/yes/no; unset or empty: ``default``); any other
    value is an error naming the variable."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("0", "false", "off", "no"):
        return False
    if raw in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"{name}: expected one of 1/0/true/false/on/off/yes/no, got {raw!r}")


# The values Triton itself reads as true (libtriton getenv_bool: case-insensitive, no stripping; anything
# else is false). "not in ('', '0')" took TRITON_INTERPRET=false/off/no for on.
_TRITON_TRUE = frozenset(("1", "true", "on", "yes"))


def triton_interpret_env() -> bool:
    """TRITON_INTERPRET as Triton reads it: whether its kernels run in the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRITON_TRUE
