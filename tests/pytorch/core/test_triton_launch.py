"""primus_turbo.triton.launch: the autotuned path once per plan key, then the compiled kernel directly.

The CPU tests drive ``launch_autotuned`` with stand-ins for ``triton.autotune`` objects (the interpreter
returns no compiled kernel); the GPU test runs the real bf16/fp32 GEMM kernels through it."""

from types import SimpleNamespace

import pytest
import torch

from primus_turbo.triton.launch import clear_launch_plans, launch_autotuned, launch_plan_count


class _Compiled:
    def __init__(self):
        self.launches = []

    def run(self, *args):  # the launcher Triton's runner calls; present on a CompiledKernel
        raise AssertionError("launch_autotuned goes through kernel[grid]")

    def __getitem__(self, grid):
        return lambda *args: self.launches.append((grid, args))


class _Config:
    def __init__(self, block, pre_hook=None):
        self.kwargs = {"BLOCK": block}
        self.pre_hook = pre_hook

    def all_kwargs(self):
        return {**self.kwargs, "num_warps": 4}


class _Autotuned:
    def __init__(self, config, compiled=None):
        self.fn = SimpleNamespace(arg_names=["x", "n", "FLAG", "BLOCK"])
        self.best_config = config
        self.compiled = compiled if compiled is not None else _Compiled()
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid({"n": args[1], **self.best_config.kwargs}), args, kwargs))
            return self.compiled

        return launch


def _grid(meta):
    return ((meta["n"] + meta["BLOCK"] - 1) // meta["BLOCK"],)


@pytest.fixture(autouse=True)
def _fresh_plans():
    clear_launch_plans()
    yield
    clear_launch_plans()


def test_the_first_call_autotunes_then_the_compiled_kernel_is_launched_with_every_argument():
    hooked = []
    kernel = _Autotuned(_Config(4, pre_hook=lambda nargs: hooked.append(dict(nargs))))
    launch_autotuned(kernel, _grid, ("n=10",), {"x": "x0", "n": 10, "FLAG": True})
    # positional, in signature order: the autotuner passes only positional arguments to prune hooks
    assert kernel.calls == [((3,), ("x0", 10, True), {})] and kernel.compiled.launches == []
    assert launch_plan_count(kernel) == 1 and launch_plan_count() == 1
    launch_autotuned(kernel, _grid, ("n=10",), {"x": "x1", "n": 10, "FLAG": True})
    assert len(kernel.calls) == 1
    assert kernel.compiled.launches == [((3, 1, 1), ("x1", 10, True, 4))]  # the config's BLOCK appended
    assert hooked == [{"x": "x1", "n": 10, "FLAG": True, "BLOCK": 4}]  # the config's pre-hook ran
    launch_autotuned(kernel, _grid, ("n=20",), {"x": "x2", "n": 20, "FLAG": True})  # a new key
    assert len(kernel.calls) == 2 and len(kernel.compiled.launches) == 1
    assert launch_plan_count(kernel) == 2


def test_no_plan_without_a_key_or_without_a_compiled_kernel():
    kernel = _Autotuned(_Config(8))
    for _ in range(2):
        launch_autotuned(kernel, _grid, None, {"x": "x", "n": 16, "FLAG": False})
    assert len(kernel.calls) == 2 and launch_plan_count() == 0

    opaque = _Autotuned(_Config(8), compiled=object())  # e.g. what an interpreter returns: no launcher
    for _ in range(3):
        launch_autotuned(opaque, _grid, ("k",), {"x": "x", "n": 16, "FLAG": False})
    assert len(opaque.calls) == 3 and launch_plan_count(opaque) == 0


def test_two_kernels_with_the_same_key_keep_their_own_plans():
    first, second = _Autotuned(_Config(4)), _Autotuned(_Config(8))
    for kernel in (first, second, first, second):
        launch_autotuned(kernel, _grid, ("same",), {"x": "x", "n": 16, "FLAG": True})
    assert first.compiled.launches == [((4, 1, 1), ("x", 16, True, 4))]
    assert second.compiled.launches == [((2, 1, 1), ("x", 16, True, 8))]


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False), (False, False), (True, True)])
@pytest.mark.parametrize("dtype,offset", [(torch.bfloat16, 0), (torch.float32, 0), (torch.bfloat16, 1)])
def test_gemm_triton_relaunch_matches_the_autotuned_launch(trans_a, trans_b, dtype, offset):
    """Second and third calls per shape take the plan: bitwise the first call's result (same config), and
    within tolerance of an fp64 reference on fresh inputs. bf16 aligned: the TMA kernel; fp32 and a base
    shifted by one element: the pointer kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from primus_turbo.triton.gemm import gemm_kernel as gk

    m, n, k = 1000, 392, 264
    before = launch_plan_count()
    for _ in range(2):  # the second round launches from the plans the first made
        a_store = torch.randn(offset + m * k, device="cuda", dtype=dtype)[offset:]
        a = a_store.view(k, m).T if trans_a else a_store.view(m, k)
        b = (
            torch.randn(n, k, device="cuda", dtype=dtype).T
            if trans_b
            else torch.randn(k, n, device="cuda", dtype=dtype)
        )
        first = gk.gemm_triton(a, b, dtype)
        again = gk.gemm_triton(a, b, dtype)
        assert torch.equal(first, again)
        ref = (a.double() @ b.double()).to(dtype).float()
        torch.testing.assert_close(again.float(), ref, rtol=2e-2, atol=2e-2 * k**0.5)
    assert launch_plan_count() == before + 1


def test_relaunch_can_be_turned_off_and_the_environment_is_checked(monkeypatch):
    from primus_turbo.triton import launch

    kernel = _Autotuned(_Config(4))
    launch.set_relaunch(False)
    try:
        for _ in range(2):
            launch_autotuned(kernel, _grid, ("k",), {"x": "x", "n": 8, "FLAG": True})
        assert len(kernel.calls) == 2 and launch_plan_count() == 0
    finally:
        launch.set_relaunch(True)
    assert launch.relaunch_enabled()
    monkeypatch.setenv(launch.ENV_RELAUNCH, "0")
    assert launch._env_enabled() is False
    monkeypatch.setenv(launch.ENV_RELAUNCH, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_TRITON_RELAUNCH"):
        launch._env_enabled()
