"""DeepEP-compatible API (normal-mode intranode) over the turbo expert-parallel backends.

from primus_turbo.pytorch.deep_ep import install_as_deep_ep
install_as_deep_ep()          # `import deep_ep` now resolves here (when DeepEP is not installed)
"""

from __future__ import annotations

import sys

from primus_turbo.pytorch.deep_ep import utils  # noqa: F401
from primus_turbo.pytorch.deep_ep.buffer import Buffer, Config  # noqa: F401
from primus_turbo.pytorch.deep_ep.utils import EventHandle, EventOverlap  # noqa: F401

__primus_turbo_shim__ = True


def install_as_deep_ep(force: bool = False) -> bool:
    """Register this package as ``deep_ep`` (and ``deep_ep.utils``) in sys.modules.

    Keeps a real DeepEP when it is importable unless ``force``. Returns True when installed."""
    if not force:
        try:
            import deep_ep as real  # noqa: F401

            if not getattr(real, "__primus_turbo_shim__", False):
                return False
        except ImportError:
            pass
    sys.modules["deep_ep"] = sys.modules[__name__]
    sys.modules["deep_ep.utils"] = utils
    return True
