"""The optional CUDA C++ extension ``primus_turbo.pytorch._C`` (built from csrc/ by setup.py).

Importing ``_C`` registers every csrc op under ``torch.ops.primus_turbo_cpp_extension``. It exists
only when the package was installed with a CUDA torch; every op that has a TURBO backend also has
TRITON/TORCH backends, so a missing extension only removes choices. Backends test
``HAS_CPP_EXTENSION`` in ``can_handle``; code that needs the extension calls
``require_cpp_extension(op)`` for a clear error.
"""

from __future__ import annotations

import torch

__all__ = ["HAS_CPP_EXTENSION", "CPP_EXTENSION_ERROR", "require_cpp_extension", "cpp_ops"]

CPP_EXTENSION_ERROR: str = ""
try:
    from primus_turbo.pytorch import _C  # noqa: F401  (import registers the ops)

    HAS_CPP_EXTENSION = True
except ImportError as exc:  # CPU torch build, or the extension was not compiled
    HAS_CPP_EXTENSION = False
    CPP_EXTENSION_ERROR = str(exc)

_BUILD_HINT = (
    "build it with a CUDA torch: `GPU_ARCHS=90a MAX_JOBS=16 pip install --no-build-isolation -e .` "
    "(setup.py skips it when torch has no CUDA or PRIMUS_TURBO_SKIP_CUDA=1)"
)


def require_cpp_extension(op: str) -> None:
    """Raise RuntimeError naming ``op`` when the CUDA extension is not importable."""
    if not HAS_CPP_EXTENSION:
        raise RuntimeError(
            f"{op}: the TURBO backend needs the CUDA extension primus_turbo.pytorch._C, which is not "
            f"importable ({CPP_EXTENSION_ERROR or 'not built'}); {_BUILD_HINT}"
        )


def cpp_ops():
    """The ``torch.ops.primus_turbo_cpp_extension`` namespace (after ``require_cpp_extension``)."""
    return torch.ops.primus_turbo_cpp_extension
