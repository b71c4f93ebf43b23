"""Look up turbo ops by name at start-up: ``has("ops.gemm")``, ``get("ops.gemm")``.

The op slices land independently; the adapter asks for what it needs when the run starts, so a missing op is a
clear start-up message (or a stock fallback under turbo.strict=false), never an ImportError mid-step.
"""

from __future__ import annotations

import importlib

_ROOT = "primus_turbo.pytorch"


def get(name: str):
    """``name`` relative to primus_turbo.pytorch: "ops.gemm", "modules.GroupedLinear", "deep_ep.Buffer"."""
    module_name, _, attr = name.rpartition(".")
    module = importlib.import_module(f"{_ROOT}.{module_name}" if module_name else _ROOT)
    return getattr(module, attr)


def has(name: str) -> bool:
    try:
        get(name)
        return True
    except (ImportError, AttributeError):
        return False
