"""Fixtures shared by the Megatron integration tests."""

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port


@pytest.fixture(scope="module")
def megatron_world():
    """One gloo rank with Megatron's model-parallel state and the CPU shims (CPU-only tests)."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from primus_turbo.integrations.megatron.cpu_shims import apply_cpu_shims, remove_cpu_shims

    if torch.cuda.is_available():
        pytest.skip("CPU-shim test; the GPU path is covered by the train.py GPU runs")
    apply_cpu_shims()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    remove_cpu_shims()


@pytest.fixture
def compare_on_cpu():
    """Run ``benchmark/e2e/compare.py ARGS`` on the CPU (no GPU visible, the Triton interpreter off: the
    trainers never launch a Triton kernel on a CPU) from the repository root; returns (returncode, output)."""
    import subprocess
    import sys

    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

    def run(args: list[str], timeout: float) -> tuple[int, str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, "benchmark/e2e/compare.py", *args]
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr

    return run
