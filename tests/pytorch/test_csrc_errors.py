"""A csrc op's TORCH_CHECK with numbers in its message reaches Python as a RuntimeError.

Seen on the GPU machine (session 9): built with a compiler wrapper that linked libstdc++ statically into
``_C``, every such error crashed the process (SIGSEGV in the static copy's ``std::ostream::_M_insert<long>``,
whose locale facets the process's shared libstdc++ had initialised instead). Runs in a subprocess so a crash
fails this test instead of killing the test session."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from primus_turbo.pytorch.core.cpp_extension import HAS_CPP_EXTENSION

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not HAS_CPP_EXTENSION, reason="needs the CUDA extension"
    ),
]

_SNIPPET = """
import torch
import primus_turbo.pytorch._C  # noqa: F401
x = torch.randn(8, 8, device="cuda").t()  # not contiguous: the check prints x.sizes()
try:
    torch.ops.primus_turbo_cpp_extension.quantize_fp8_rowwise(x, torch.float8_e4m3fn, False)
except RuntimeError as e:
    print("RAISED", str(e).splitlines()[0])
"""


def test_error_message_with_numbers_raises_instead_of_crashing():
    proc = subprocess.run([sys.executable, "-c", _SNIPPET], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert "RAISED quantize_fp8_rowwise: x must be a contiguous 2-D CUDA tensor, got [8, 8]" in proc.stdout
