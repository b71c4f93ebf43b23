"""bench_gemm --shapes: the sweep restricted to the given MxNxK list; bad text is an argparse error."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "ops"))
import bench_gemm as bench  # noqa: E402


def test_shapes_parse_in_order():
    assert bench.parse_shapes("4096x2048x2048, 8192X2048x4096") == [(4096, 2048, 2048), (8192, 2048, 4096)]


@pytest.mark.parametrize("text", ["", "4096x2048", "4096x2048x0", "ax2x3", "1x2x3,4x5"])
def test_bad_shapes_name_the_option(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--shapes"):
        bench.parse_shapes(text)
