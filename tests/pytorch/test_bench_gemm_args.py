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


@pytest.mark.gpu
def test_gpu_paced_time_is_the_gpu_s_not_the_host_s():
    """gpu_paced_ms times the GPU with the host ahead: a call with 1 ms of host work and a ~0.05 ms kernel
    reads near the kernel, where a synced wall clock reads the host; a ~1 ms kernel reads ~1 ms."""
    import time

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import bench_utils

    def host_heavy():
        time.sleep(1e-3)
        torch.cuda._sleep(100_000)  # ~0.05 ms at the H100/H200 clocks

    assert bench_utils.gpu_paced_ms(host_heavy) < 0.5
    assert 0.3 < bench_utils.gpu_paced_ms(lambda: torch.cuda._sleep(2_000_000)) < 3.0
