"""primus_turbo.triton.launch: the autotuned path once per plan key, then the compiled kernel directly.

The CPU tests drive ``launch_autotuned`` with stand-ins for ``triton.autotune`` objects (the interpreter
returns no compiled kernel); the GPU test runs the real bf16/fp32 GEMM kernels through it."""

from types import SimpleNamespace

import pytest
import torch
from test_utils import compute_snr

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


def test_the_first_call_autotunes_then_the_compiled_kernel_is_launched_with_every_argument(_as_if_cuda):
    hooked = []
    kernel = _Autotuned(_Config(4, pre_hook=lambda nargs: hooked.append(dict(nargs))))
    x0, x1, x2 = (torch.randn(64) for _ in range(3))  # fresh tensors, same dtype and alignment
    launch_autotuned(kernel, _grid, {"x": x0, "n": 10, "FLAG": True})
    # positional, in signature order: the autotuner passes only positional arguments to prune hooks
    assert kernel.calls == [((3,), (x0, 10, True), {})] and kernel.compiled.launches == []
    assert launch_plan_count(kernel) == 1 and launch_plan_count() == 1
    launch_autotuned(kernel, _grid, {"x": x1, "n": 10, "FLAG": True})
    assert len(kernel.calls) == 1
    assert kernel.compiled.launches == [((3, 1, 1), (x1, 10, True, 4))]  # the config's BLOCK appended
    assert hooked == [{"x": x1, "n": 10, "FLAG": True, "BLOCK": 4}]  # the config's pre-hook ran
    launch_autotuned(kernel, _grid, {"x": x2, "n": 20, "FLAG": True})  # another specialization
    assert len(kernel.calls) == 2 and len(kernel.compiled.launches) == 1
    assert launch_plan_count(kernel) == 2


def test_no_plan_off_cuda_or_without_a_compiled_kernel(monkeypatch):
    from primus_turbo.triton import launch

    kernel = _Autotuned(_Config(8))
    for _ in range(2):  # CPU tensors: the interpreter path
        launch_autotuned(kernel, _grid, {"x": torch.randn(4), "n": 16, "FLAG": False})
    assert len(kernel.calls) == 2 and launch_plan_count() == 0

    monkeypatch.setattr(launch, "_on_cuda", lambda args, kwargs: True)
    monkeypatch.setattr(launch, "_device_index", lambda: 0)
    opaque = _Autotuned(_Config(8), compiled=object())  # e.g. what an interpreter returns: no launcher
    for _ in range(3):
        launch_autotuned(opaque, _grid, {"x": torch.randn(4), "n": 16, "FLAG": False})
    assert len(opaque.calls) == 3 and launch_plan_count(opaque) == 0


def test_two_kernels_with_the_same_key_keep_their_own_plans(_as_if_cuda):
    first, second = _Autotuned(_Config(4)), _Autotuned(_Config(8))
    x = torch.randn(16)
    for kernel in (first, second, first, second):
        launch_autotuned(kernel, _grid, {"x": x, "n": 16, "FLAG": True})
    assert first.compiled.launches == [((4, 1, 1), (x, 16, True, 4))]
    assert second.compiled.launches == [((2, 1, 1), (x, 16, True, 8))]


@pytest.mark.gpu
@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (True, False), (False, False), (True, True)])
@pytest.mark.parametrize(
    "dtype,offset,variant",
    [
        (torch.bfloat16, 0, None),
        (torch.bfloat16, 0, "tma"),
        (torch.float32, 0, None),
        (torch.bfloat16, 1, None),
    ],
)
def test_gemm_triton_relaunch_matches_the_autotuned_launch(trans_a, trans_b, dtype, offset, variant):
    """Second and third calls per shape take the plan: bitwise the first call's result (same config), and
    within tolerance of an fp64 reference on fresh inputs. bf16 aligned: the TMA kernel (device descriptors
    by default, host descriptors with variant "tma"); fp32 and a base shifted by one element: the pointer
    kernel."""
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
        first = gk.gemm_triton(a, b, dtype, variant=variant)
        again = gk.gemm_triton(a, b, dtype, variant=variant)
        assert torch.equal(first, again)
        ref = (a.double() @ b.double()).to(dtype).float()
        torch.testing.assert_close(again.float(), ref, rtol=2e-2, atol=2e-2 * k**0.5)
    assert launch_plan_count() == before + 1


def test_relaunch_can_be_turned_off_and_the_environment_is_checked(monkeypatch, _as_if_cuda):
    from primus_turbo.triton import launch

    kernel = _Autotuned(_Config(4))
    launch.set_relaunch(False)
    try:
        for _ in range(2):
            launch_autotuned(kernel, _grid, {"x": torch.randn(8), "n": 8, "FLAG": True})
        assert len(kernel.calls) == 2 and launch_plan_count() == 0
    finally:
        launch.set_relaunch(True)
    assert launch.relaunch_enabled()
    monkeypatch.setenv(launch.ENV_RELAUNCH, "0")
    assert launch._env_enabled() is False
    monkeypatch.setenv(launch.ENV_RELAUNCH, "maybe")
    with pytest.raises(ValueError, match="PRIMUS_TURBO_TRITON_RELAUNCH"):
        launch._env_enabled()


class _Jit:
    """A plain @triton.jit stand-in: parameters (x, n, FLAG, BLOCK=32), launches recorded, one compiled."""

    def __init__(self):
        def fn(x, n, FLAG, BLOCK=32):  # noqa: N803 - Triton constexpr naming
            pass

        self.fn = fn
        self.arg_names = ["x", "n", "FLAG", "BLOCK"]
        self.compiled = _Compiled()
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.compiled

        return launch


@pytest.fixture
def _as_if_cuda(monkeypatch):
    from primus_turbo.triton import launch

    monkeypatch.setattr(launch, "_on_cuda", lambda args, kwargs: True)
    monkeypatch.setattr(launch, "_device_index", lambda: 0)


def test_launch_jit_relaunches_with_every_parameter_in_order(_as_if_cuda):
    from primus_turbo.triton.launch import launch_jit

    kernel = _Jit()
    x = torch.randn(64)
    launch_jit(kernel, (4,), x, 64, FLAG=True, num_warps=4)
    assert kernel.calls == [((4,), (x, 64), {"FLAG": True, "num_warps": 4})]
    y = torch.randn(64)  # fresh tensor, same dtype and alignment: the plan
    launch_jit(kernel, (8, 2), y, 64, FLAG=True, num_warps=4)
    assert len(kernel.calls) == 1
    assert kernel.compiled.launches == [((8, 2, 1), (y, 64, True, 32))]  # default BLOCK, this grid


@pytest.mark.parametrize(
    "change",
    [
        {"x": torch.randn(64, dtype=torch.float64)},  # dtype
        {"x": torch.randn(65)[1:]},  # a base off 16-byte alignment
        {"n": 65},
        {"FLAG": 1},  # an int where a bool was: Triton specializes them differently
        {"num_warps": 8},
        {"BLOCK": 64},
    ],
)
def test_launch_jit_keys_everything_triton_specializes_on(change, _as_if_cuda):
    from primus_turbo.triton.launch import launch_jit

    kernel = _Jit()
    base = {"x": torch.randn(64), "n": 64, "FLAG": True, "num_warps": 4}
    launch_jit(kernel, (1,), **base)
    launch_jit(kernel, (1,), **{**base, **change})
    assert len(kernel.calls) == 2 and kernel.compiled.launches == []
    assert launch_plan_count() == 2


def test_launch_jit_without_cuda_or_when_off_always_goes_through_triton():
    from primus_turbo.triton import launch

    kernel = _Jit()
    for _ in range(2):  # CPU tensors: the interpreter path
        launch.launch_jit(kernel, (1,), torch.randn(4), 4, FLAG=False)
    assert len(kernel.calls) == 2 and launch_plan_count() == 0


def test_specialization_key_of_a_descriptor_holds_its_layout():
    from primus_turbo.triton.launch import specialization_key

    base = torch.randn(8, 16)
    desc = SimpleNamespace(base=base, shape=[8, 16], strides=[16, 1], block_shape=[8, 8], padding="zero")
    other = SimpleNamespace(base=base, shape=[8, 16], strides=[16, 1], block_shape=[8, 16], padding="zero")
    assert specialization_key([desc]) != specialization_key([other])
    assert specialization_key([desc, None, 3]) == specialization_key([desc, None, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("trans_b", [True, False])
def test_grouped_gemm_triton_relaunch_matches_the_reference(dtype, trans_b):
    """The Triton grouped GEMM (bf16: TMA kernels; fp32: pointer kernels) forward, dgrad and wgrad twice per
    shape on fresh inputs: the second round launches from plans, and both match the fp64 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ref.grouped_gemm_ref import grouped_gemm_grads_ref, grouped_gemm_ref

    import primus_turbo.pytorch as turbo
    from primus_turbo.pytorch.core.backend import GlobalBackendManager

    GlobalBackendManager.set_grouped_gemm_backend("TRITON")
    group_lens = torch.tensor([96, 0, 200, 152], device="cuda", dtype=torch.int64)
    g, m, n, k = 4, 448, 136, 264
    counts = []
    for _ in range(2):
        a = torch.randn(m, k, device="cuda", dtype=dtype, requires_grad=True)
        b_shape = (g, n, k) if trans_b else (g, k, n)
        b = torch.randn(*b_shape, device="cuda", dtype=dtype, requires_grad=True)
        out = turbo.ops.grouped_gemm(a, b, group_lens, trans_b=trans_b)
        grad = torch.randn_like(out)
        out.backward(grad)
        half = dtype == torch.bfloat16
        tol = {"rtol": 2e-2, "atol": 2e-2 * k**0.5} if half else {"rtol": 1e-4, "atol": 1e-3}
        ref = grouped_gemm_ref(a.double(), b.double(), group_lens, trans_b)
        torch.testing.assert_close(out.double(), ref, **tol)
        ref_da, ref_db = grouped_gemm_grads_ref(a.double(), b.double(), group_lens, grad.double(), trans_b)
        torch.testing.assert_close(a.grad.double(), ref_da, **tol)
        torch.testing.assert_close(b.grad.double(), ref_db, **tol)
        counts.append(launch_plan_count())
    assert counts[0] > 0 and counts[1] == counts[0]  # the second round made no new plan: it used them


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["tma", "tma_device", "pointer"])
def test_fp8_gemm_triton_relaunch_matches_the_dequantized_product(variant):
    """Rowwise-scaled FP8 GEMM through the Triton kernel twice per shape (fresh inputs): the second round
    launches from the plans (TMA descriptors get their boxes from the config's pre-hook) and matches."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from primus_turbo.triton.gemm.gemm_fp8_kernel import SCALE_ROWWISE, gemm_fp8_triton

    m, n, k = 320, 272, 512
    counts = []
    for _ in range(2):
        a8 = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b8 = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
        a_s = torch.rand(m, 1, device="cuda") + 0.5  # dequantization multipliers (scale_inv), per row
        b_s = torch.rand(n, 1, device="cuda") + 0.5
        args = (a8, a_s, b8, b_s, SCALE_ROWWISE, 0, torch.float32)
        runs = [gemm_fp8_triton(*args, variant=variant) for _ in range(2)]
        assert torch.equal(runs[0], runs[1])  # the relaunch ran the autotuned launch's kernel and config
        ref = (a8.double() * a_s.double()) @ (b8.double() * b_s.double()).T
        # Hopper's FP8 wgmma accumulates with fewer bits than fp32 (GPU run, session 33: 0.5% of the elements
        # outside rtol 1e-3 / atol 1e-2, by up to 0.145 absolute at K=512): the gate is an SNR, not an fp32
        # tolerance
        assert compute_snr(ref, runs[1].double()) > 40
        counts.append(launch_plan_count())
    assert counts[0] > 0 and counts[1] == counts[0]


def test_launch_jit_with_an_unhashable_argument_takes_triton_s_path(_as_if_cuda):
    from primus_turbo.triton.launch import launch_jit

    kernel = _Jit()
    for _ in range(2):
        launch_jit(kernel, (1,), torch.randn(4), 4, FLAG=[1, 2])
    assert len(kernel.calls) == 2 and launch_plan_count() == 0


def test_tuples_key_by_their_elements_and_extra_positionals_go_to_triton(_as_if_cuda):
    from primus_turbo.triton.launch import launch_jit, specialization_key

    # a tensor inside a tuple keys by dtype and alignment (not identity): fresh tensors share a key
    assert specialization_key([(torch.randn(4), 3)]) == specialization_key([(torch.randn(4), 3)])
    assert specialization_key([(True,)]) != specialization_key([(1,)])
    kernel = _Jit()
    for _ in range(2):
        launch_jit(kernel, (1,), torch.randn(4), 4, True, 32, "one too many")
    assert len(kernel.calls) == 2 and launch_plan_count() == 0
