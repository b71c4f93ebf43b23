"""Environment-variable parsing shared by every layer (no torch or Triton imports: the Triton launch helpers
read it at import, before ``primus_turbo.pytorch`` exists)."""

from __future__ import annotations

import os

__all__ = ["parse_bool_env"]


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
