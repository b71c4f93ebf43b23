"""Test harness: CPU interpreter mode, GPU pinning, markers and suite-selection flags.

With no CUDA device, TRITON_INTERPRET=1 is set here, before any kernel module is imported, and
three interpreter gaps are patched:
  * bf16 ``tl.dot`` multiplies raw uint16 bits: operands are upcast to fp32 first;
  * fp32 -> bf16 casts truncate (and "RTNE" drops ties-to-even and the carry into the exponent):
    they round to nearest even through torch, as ``cvt.rn.bf16.f32`` does on the GPU;
  * ``@triton.autotune`` with several configs wants a GPU benchmarker: on CPU every config
    "times" the same, so the first config runs (the GPU suite tunes for real).
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _patch_triton_interpreter() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    builder_cls = interpreter.InterpreterBuilder
    original_dot = builder_cls.create_dot

    def _to_fp32(handle):
        if handle.dtype.scalar == tl.bfloat16:
            flat = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
            return np.asarray(flat).view(np.float32).reshape(handle.data.shape)
        return None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a32, b32 = _to_fp32(a), _to_fp32(b)
        if a32 is None and b32 is None:
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32 = a.data.astype(np.float32) if a32 is None else a32
        b32 = b.data.astype(np.float32) if b32 is None else b32
        out = np.matmul(a32, b32, dtype=np.float32).astype(d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    builder_cls.create_dot = create_dot

    original_cast, original_fp_to_fp = builder_cls.cast_impl, builder_cls.create_fp_to_fp
    rtne = interpreter._ir.ROUNDING_MODE.RTNE

    def _to_bf16(src):
        bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(bits.view(np.uint16).reshape(src.data.shape), tl.bfloat16)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return _to_bf16(src)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        to_bf16 = src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16
        if to_bf16 and rounding_mode in (None, rtne):
            return _to_bf16(src)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_cls.cast_impl, builder_cls.create_fp_to_fp = cast_impl, create_fp_to_fp

    def _bench(self, *args, config, **meta):
        return [1.0, 1.0, 1.0]

    autotuner.Autotuner._bench = _bench


if not HAS_CUDA:
    _patch_triton_interpreter()


def pytest_addoption(parser):
    parser.addoption("--dist-only", action="store_true", help="run only multi-GPU (multigpu) tests")
    parser.addoption("--deterministic-only", action="store_true", help="run only bitwise-determinism tests")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (Hopper for FP8)")
    config.addinivalue_line("markers", "multigpu: needs 2 or more CUDA devices")
    config.addinivalue_line("markers", "deterministic: bitwise run-to-run determinism check")
    config.addinivalue_line("markers", "slow: takes more than ~30 s on a 2-core CPU")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if HAS_CUDA and worker.startswith("gw"):
        torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())


def pytest_collection_modifyitems(config, items):
    dist_only = config.getoption("--dist-only")
    det_only = config.getoption("--deterministic-only")
    n_gpu = torch.cuda.device_count() if HAS_CUDA else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs 2 CUDA devices")
    deselected, kept = [], []
    for item in items:
        if dist_only and "multigpu" not in item.keywords:
            deselected.append(item)
            continue
        if det_only and "deterministic" not in item.keywords:
            deselected.append(item)
            continue
        kept.append(item)
        if "gpu" in item.keywords and n_gpu == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(skip_multi)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


# Fresh random inputs every run; the seed is printed so a failure can be replayed with
# PRIMUS_TURBO_TEST_SEED=<seed>.
SESSION_SEED = int(os.environ.get("PRIMUS_TURBO_TEST_SEED", int.from_bytes(os.urandom(3), "little")))


def pytest_report_header(config):
    n_gpu = torch.cuda.device_count()
    return f"primus-turbo: seed {SESSION_SEED} (PRIMUS_TURBO_TEST_SEED), cuda devices {n_gpu}"


@pytest.fixture(autouse=True)
def _reset_backends(request):
    """Each test starts from default backend selection and its own seed."""
    import zlib

    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    GlobalBackendManager.reset()
    torch.manual_seed(SESSION_SEED + zlib.crc32(request.node.nodeid.encode()))
    yield
    GlobalBackendManager.reset()
    if HAS_CUDA and torch.cuda.memory_reserved() > _IDLE_CACHE_BYTES:
        torch.cuda.empty_cache()


# The xdist workers share the GPUs (8 on one GPU on the device machine): a worker keeping a big test's
# cached blocks (up to 37 GB seen) while idle made other workers' training-shape tests run out of memory
# (session 36).
_IDLE_CACHE_BYTES = 2 << 30


@pytest.fixture
def device():
    return torch.device("cuda", torch.cuda.current_device()) if HAS_CUDA else torch.device("cpu")
