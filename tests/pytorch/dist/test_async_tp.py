"""Async-TP ops: numerics of every backend against an fp64 single-process reference.

CPU (gloo, 2 ranks): the NCCL backend, the op layer's reshaping/validation, FP8 quantization and
group-of-one fall-through; all checks of one spawn share a body to keep process start-up (~7 s) low.
2 GPUs (multigpu): TURBO and SYMM_MEM against NCCL at training shapes, bf16 tolerance and FP8 SNR,
odd row counts split into uneven chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from ref.async_tp_ref import all_gather_matmul_ref, matmul_reduce_scatter_ref, rank_inputs
from test_utils import assert_close, assert_snr, fp8_snr_gate

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity
from primus_turbo.pytorch.ops.async_tp import (
    fused_all_gather_matmul,
    fused_all_gather_scaled_matmul,
    fused_matmul_reduce_scatter,
    fused_scaled_matmul_reduce_scatter,
    quantize_for_async_tp,
)

FP8_CONFIGS = [
    Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.TENSORWISE),
    Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.ROWWISE),
]


def _seed() -> int:
    return int(torch.randint(0, 2**30, ()).item())


def _check_all_gather(rank, world, device, seed, dtype, lead, gather_dim, n_list, backend, num_splits=None):
    shapes = [lead] + [(lead[-1], n) for n in n_list]
    ins = rank_inputs(seed, world, *shapes, dtype=dtype)
    a = ins[rank][0].to(device)
    bs = [b.to(device) for b in ins[0][1:]]  # weights identical on all ranks
    a_full, outs = fused_all_gather_matmul(a, bs, gather_dim, backend=backend, num_splits=num_splits)
    for i, (b, out) in enumerate(zip(ins[0][1:], outs)):
        ref_a, ref = all_gather_matmul_ref([r[0] for r in ins], b, gather_dim)
        assert out.shape == ref.shape and out.dtype == dtype
        assert_close(out.cpu(), ref, dtype, msg=f"AG+GEMM out[{i}] {backend} dim={gather_dim}")
    torch.testing.assert_close(a_full.cpu().double(), ref_a, rtol=0, atol=0)
    none_a, outs2 = fused_all_gather_matmul(a, bs[:1], gather_dim, return_a=False, backend=backend)
    assert none_a is None and outs2[0].shape == outs[0].shape


def _check_reduce_scatter(
    rank, world, device, seed, dtype, shape_a, n, reduce_op, dim, backend, num_splits=None
):
    ins = rank_inputs(seed, world, shape_a, (shape_a[-1], n))
    # Partials ~N(0, 0.25^2): each partial is rounded to `dtype` before the reduction, and where two
    # partials cancel only atol is left; 1 ulp of a partial must stay below it (|partial| < 1).
    ins = [[a.to(dtype), (b * (0.25 / shape_a[-1] ** 0.5)).to(dtype)] for a, b in ins]
    a, b = ins[rank][0].to(device), ins[rank][1].to(device)
    out = fused_matmul_reduce_scatter(a, b, reduce_op, dim, backend=backend, num_splits=num_splits)
    ref = matmul_reduce_scatter_ref([r[0] for r in ins], [r[1] for r in ins], reduce_op, dim, rank)
    assert out.shape == ref.shape and out.dtype == dtype
    # the reduction adds `world` rounded partials: one extra rounding step of the output dtype
    assert_close(out.cpu(), ref, dtype, msg=f"GEMM+RS {reduce_op} dim={dim} {backend}")


def _check_fp8(rank, world, device, seed, backend):
    ins = rank_inputs(seed, world, (96, 128), (128, 160), dtype=torch.bfloat16)
    a, b = ins[rank][0].to(device), ins[0][1].to(device)
    rs_b = ins[rank][1].to(device)
    for cfg in FP8_CONFIGS:
        _, (out,) = fused_all_gather_matmul(a, [b], 0, fp8_config=cfg, backend=backend)
        _, ref = all_gather_matmul_ref([r[0] for r in ins], ins[0][1], 0)
        assert out.dtype == torch.bfloat16
        assert_snr(out.cpu(), ref, fp8_snr_gate(cfg.format), msg=f"AG fp8 {cfg.granularity.name} {backend}")
        out = fused_matmul_reduce_scatter(a, rs_b, "sum", 0, fp8_config=cfg, backend=backend)
        ref = matmul_reduce_scatter_ref([r[0] for r in ins], [r[1] for r in ins], "sum", 0, rank)
        assert_snr(out.cpu(), ref, fp8_snr_gate(cfg.format), msg=f"RS fp8 {cfg.granularity.name} {backend}")


def _check_fp8_out_dtypes(rank, world, device, seed, backend):
    """One output dtype per b (FP8 GEMMs): each output in its own dtype, each product right. N = 40 / 24
    are not multiples of 16: NCCL and TURBO pad for cuBLAS; torch's SYMM_MEM op cannot, so pinned there
    it must refuse with a clear error (and it runs at N = 48 / 32)."""
    n, n2 = 40, 24
    if backend == "SYMM_MEM" and device.type == "cuda":
        with pytest.raises(ValueError, match="cannot handle"):
            _fp8_out_dtypes_case(rank, world, device, seed, backend, n, n2)
        n, n2 = 48, 32
    _fp8_out_dtypes_case(rank, world, device, seed, backend, n, n2)


def _fp8_out_dtypes_case(rank, world, device, seed, backend, n, n2):
    ins = rank_inputs(seed, world, (48, 64), (64, n), dtype=torch.bfloat16)
    a, b = ins[rank][0].to(device), ins[0][1].to(device)
    cfg = Float8QuantConfig(format=Format.E4M3, granularity=ScalingGranularity.TENSORWISE)
    _, outs = fused_all_gather_matmul(
        a, [b, b[:, :n2]], 0, fp8_config=cfg, out_dtypes=[torch.float32, None], backend=backend
    )
    _, ref = all_gather_matmul_ref([r[0] for r in ins], ins[0][1], 0)
    assert [o.dtype for o in outs] == [torch.float32, torch.bfloat16], [o.dtype for o in outs]
    assert_snr(outs[0].cpu(), ref, fp8_snr_gate(cfg.format), msg=f"AG fp8 out fp32 {backend}")
    assert_snr(outs[1].cpu(), ref[:, :n2], fp8_snr_gate(cfg.format), msg=f"AG fp8 out bf16 {backend}")


def _check_scaled_variants(rank, world, device, seed, backend):
    """Pre-quantized operands: the scaled APIs must match dequantize-then-matmul exactly-ish."""
    ins = rank_inputs(seed, world, (2, 24, 64), (64, 48), dtype=torch.float32)
    a, b = ins[rank][0].to(device), ins[0][1].to(device)
    a_q, a_scale = quantize_for_async_tp(a, torch.float8_e4m3fn, -1)  # row-wise [2, 24, 1]
    bt_q, b_scale = quantize_for_async_tp(b.t().contiguous(), torch.float8_e4m3fn, 1)
    a_full, scale_full, (out,) = fused_all_gather_scaled_matmul(
        a_q, [bt_q.t()], a_scale, [b_scale.view(1, -1)], 1, backend=backend
    )
    assert a_full.shape == (2, 24 * world, 64) and scale_full.shape == (2, 24 * world, 1)
    deq = a_full.float() * scale_full
    ref = deq.double() @ (bt_q.t().double() * b_scale.view(1, -1).double().cpu().to(device))
    assert_snr(out.double().cpu(), ref.cpu(), 40.0, msg="scaled AG vs dequantized reference")
    out_rs = fused_scaled_matmul_reduce_scatter(
        a_q, bt_q.t(), a_scale, b_scale.view(1, -1), "sum", 1, backend=backend
    )  # row-wise cuBLAS FP8 GEMMs only produce bf16
    assert out_rs.shape == (2, 24 // world, 48) and out_rs.dtype == torch.bfloat16
    a_all = [quantize_for_async_tp(r[0], torch.float8_e4m3fn, -1) for r in ins]
    deq_all = [(q.double() * s.double()).to(device) for q, s in a_all]
    ref_rs = sum(d @ (bt_q.t().double() * b_scale.view(1, -1).double()) for d in deq_all)
    assert_snr(out_rs.cpu(), ref_rs.chunk(world, 1)[rank].cpu(), 30.0, msg="scaled GEMM+RS")


def _gloo_body(rank, world, device, seed):
    for dtype in (torch.float32, torch.bfloat16):
        _check_all_gather(rank, world, device, seed, dtype, (3, 32), 0, [40, 24], "NCCL")  # odd rows
        _check_all_gather(rank, world, device, seed + 1, dtype, (2, 5, 32), 1, [16], None)
        _check_reduce_scatter(rank, world, device, seed + 2, dtype, (6, 32), 40, "sum", 0, None)
        _check_reduce_scatter(rank, world, device, seed + 3, dtype, (3, 4, 32), 24, "avg", 1, "NCCL")
    _check_fp8(rank, world, device, seed + 4, "NCCL")
    _check_fp8_out_dtypes(rank, world, device, seed + 6, "NCCL")
    _check_scaled_variants(rank, world, device, seed + 5, "NCCL")
    # zero-size: K = 0 gives zeros, M = 0 gives empty outputs
    a_full, (out,) = fused_all_gather_matmul(torch.zeros(3, 0), [torch.zeros(0, 8)], 0)
    assert a_full.shape == (3 * world, 0) and out.shape == (3 * world, 8) and not out.any()
    out = fused_matmul_reduce_scatter(torch.randn(0, 8), torch.randn(8, 4), "sum", 0)
    assert out.shape == (0, 4)
    # symmetric-memory backends need CUDA + NCCL: pinned on gloo they must refuse, never fall back
    for backend in ("TURBO", "SYMM_MEM"):
        with pytest.raises(ValueError, match=backend):
            fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 8)], 0, backend=backend)
        with pytest.raises(ValueError, match=backend):
            fused_matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 8), "sum", 0, backend=backend)
    with pytest.raises(ValueError, match="not divisible by the group size"):
        fused_matmul_reduce_scatter(torch.randn(5, 8), torch.randn(8, 4), "sum", 0)
    # groups of one: every rank in its own group runs a plain GEMM, no communication
    singles = [dist.new_group([r]) for r in range(world)]
    a, b = torch.randn(5, 16), torch.randn(16, 8)
    a_full, (out,) = fused_all_gather_matmul(a, [b], 0, singles[rank], backend="NCCL")
    assert torch.equal(a_full, a) and torch.allclose(out, a @ b)
    assert torch.allclose(fused_matmul_reduce_scatter(a, b, "avg", 0, singles[rank]), a @ b)


def test_async_tp_ops_gloo():
    run_distributed(_gloo_body, world_size=2, backend="gloo", args=(_seed(),))


# -- validation: raised before any communication, so no process group is needed -------------------
def test_dtype_mix_rejected():
    with pytest.raises(TypeError, match="dtypes must match"):
        fused_all_gather_matmul(torch.randn(4, 8, dtype=torch.bfloat16), [torch.randn(8, 4)], 0, "g")
    with pytest.raises(TypeError, match="dtypes must match"):
        fused_matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 4, dtype=torch.float16), "sum", 0, "g")
    fp8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="fp8_config"):
        fused_all_gather_matmul(fp8, [fp8.t()], 0, "g")
    with pytest.raises(TypeError, match="float8"):
        fused_all_gather_scaled_matmul(torch.randn(4, 8), [fp8.t()], torch.ones(()), [torch.ones(())], 0, "g")


def test_out_dtypes_validation():
    from primus_turbo.pytorch.ops.async_tp import _out_dtype_list

    bf16, fp32 = torch.bfloat16, torch.float32
    assert _out_dtype_list(None, 2, bf16, False) == [bf16, bf16]
    assert _out_dtype_list(fp32, 2, bf16, False) == [fp32, fp32]
    assert _out_dtype_list([None, fp32], 2, bf16, False) == [bf16, fp32]
    with pytest.raises(ValueError, match="list of 2"):
        _out_dtype_list([fp32], 2, bf16, False)
    with pytest.raises(ValueError, match="bfloat16/float16/float32"):
        _out_dtype_list([torch.int32, fp32], 2, bf16, False)
    with pytest.raises(ValueError, match="row-wise FP8 GEMMs"):
        _out_dtype_list([bf16, fp32], 2, bf16, True)
    with pytest.raises(ValueError, match="return the input dtype"):  # bf16 GEMMs: no other output dtype
        fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 4)], 0, "g", out_dtypes=[torch.bfloat16])


def test_bad_dims_and_ops_rejected():
    with pytest.raises(ValueError, match="gather_dim=1"):
        fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 4)], 1, "g")
    with pytest.raises(ValueError, match="K mismatch"):
        fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(6, 4)], 0, "g")
    with pytest.raises(ValueError, match="reduce_op"):
        fused_matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 4), "max", 0, "g")
    with pytest.raises(ValueError, match="scatter_dim=-1"):
        fused_matmul_reduce_scatter(torch.randn(4, 8), torch.randn(8, 4), "sum", -1, "g")
    with pytest.raises(TypeError, match="group"):
        fused_all_gather_matmul(torch.randn(4, 8), [torch.randn(8, 4)], 0, 3)


# -- default backend rule: the measured 2x H200 table in async_tp_impl.py, on shape-only tensors ---
@pytest.mark.parametrize(
    "shape,ag_want,rs_fused",
    [
        ((8192, 4096, 14336), "SYMM_MEM", True),  # GEMM-bound: SYMM_MEM 1-4% ahead of TURBO
        ((8192, 8192, 8192), "SYMM_MEM", True),
        ((16384, 7168, 2048), "TURBO", True),  # comm-heavy gather: TURBO 1.86x vs SYMM_MEM 1.41x
        ((4096, 4096, 4096), "NCCL", False),  # both fused paths lose to unfused here
    ],
)
def test_default_backend_rule(monkeypatch, shape, ag_want, rs_fused):
    from primus_turbo.pytorch.core.backend import BackendType
    from primus_turbo.pytorch.kernels.async_tp import async_tp_impl as impl

    world = 2
    monkeypatch.setattr(impl, "group_info", lambda name: (None, world, 0))
    for cls in (impl._AGTurbo, impl._RSTurbo):
        monkeypatch.setattr(cls, "can_handle", staticmethod(lambda **kw: True))
    M, K, N = shape
    meta = dict(device="meta", dtype=torch.bfloat16)
    a_shard, b_col = torch.empty(M // world, K, **meta), torch.empty(K, N // world, **meta)
    got = impl.AllGatherMatmulDispatcher.default_backend(a_shard=a_shard, bs=[b_col], group_name="g")
    assert got is BackendType[ag_want], f"AG+GEMM {shape}: {got}"
    a, b_row = torch.empty(M, K // world, **meta), torch.empty(K // world, N, **meta)
    got = impl.MatmulReduceScatterDispatcher.default_backend(a=a, b=b_row, group_name="g")
    assert got is (impl._RS_FUSED_BACKEND if rs_fused else BackendType.NCCL), f"GEMM+RS {shape}: {got}"
    # off CUDA + NCCL (can_handle False) the default is always the unfused path
    for cls in (impl._AGTurbo, impl._RSTurbo):
        monkeypatch.setattr(cls, "can_handle", staticmethod(lambda **kw: False))
    got_ag = impl.AllGatherMatmulDispatcher.default_backend(a_shard=a_shard, bs=[b_col], group_name="g")
    got_rs = impl.MatmulReduceScatterDispatcher.default_backend(a=a, b=b_row, group_name="g")
    assert got_ag is BackendType.NCCL and got_rs is BackendType.NCCL


# -- 2 GPUs: TURBO / SYMM_MEM against the fp64 reference and against NCCL ------------------------
def _gpu_body(rank, world, device, seed):
    for backend in ("NCCL", "TURBO", "SYMM_MEM"):
        # training-like shapes; 1000 rows per rank is not a multiple of the 3 / 4 row blocks
        _check_all_gather(rank, world, device, seed, torch.bfloat16, (1000, 512), 0, [768, 256], backend, 3)
        _check_all_gather(rank, world, device, seed, torch.bfloat16, (2, 512, 512), 1, [1024], backend)
        _check_reduce_scatter(
            rank, world, device, seed, torch.bfloat16, (2002, 512), 768, "sum", 0, backend, 4
        )
        _check_reduce_scatter(
            rank, world, device, seed, torch.bfloat16, (4, 256, 384), 512, "avg", 1, backend
        )
        _check_fp8(rank, world, device, seed + 1, backend)
        _check_fp8_out_dtypes(rank, world, device, seed + 5, backend)
        _check_scaled_variants(rank, world, device, seed + 2, backend)
    # the pipeline's workspace is reused across calls and grows: results must stay right
    for rows in (64, 4096, 64):
        _check_all_gather(rank, world, device, seed + rows, torch.bfloat16, (rows, 1024), 0, [2048], "TURBO")
    # the default (no backend) must be consistent across ranks and correct
    _check_all_gather(rank, world, device, seed + 3, torch.bfloat16, (4096, 4096), 0, [4096], None)
    _check_reduce_scatter(rank, world, device, seed + 4, torch.bfloat16, (8192, 2048), 4096, "sum", 0, None)


@pytest.mark.multigpu
def test_async_tp_backends_2gpu():
    run_distributed(_gpu_body, world_size=2, backend="nccl", args=(_seed(),), timeout_s=300)


def _gpu_bitwise_body(rank, world, device, seed):
    """TURBO is run-to-run deterministic, and its gathered input equals NCCL's bit for bit."""
    gen = torch.Generator(device="cpu").manual_seed(seed + rank)
    a = torch.randn(2048, 1024, generator=gen).to(device, torch.bfloat16)
    b = torch.randn(1024, 1536, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    ref_full, (ref,) = fused_all_gather_matmul(a, [b], 0, backend="NCCL")
    full, (out,) = fused_all_gather_matmul(a, [b], 0, backend="TURBO", num_splits=2)
    full2, (out2,) = fused_all_gather_matmul(a, [b], 0, backend="TURBO", num_splits=2)
    assert torch.equal(full, ref_full) and torch.equal(full2, ref_full)
    assert torch.equal(out, out2), "TURBO AG+GEMM not run-to-run deterministic"
    assert_close(out, ref, torch.bfloat16, msg="TURBO vs NCCL")
    rs = [fused_matmul_reduce_scatter(a, b, "sum", 0, backend="TURBO", num_splits=2) for _ in range(2)]
    assert torch.equal(rs[0], rs[1]), "TURBO GEMM+RS not run-to-run deterministic"
    # the csrc schedule (async_tp_rs_fused) runs the same GEMMs on the same row blocks as the Python one
    from primus_turbo.pytorch.kernels.async_tp import async_tp_impl

    assert async_tp_impl._has_cpp_rs(), "a CUDA build must have the csrc GEMM+RS schedule"
    min_s = async_tp_impl._RS_FUSE_OWN_MIN_S
    try:
        for splits, m in ((2, 1024), (3, 1001)):  # 1001 output rows per rank: uneven row blocks
            x = a[: world * m]
            async_tp_impl._RS_FUSE_OWN_MIN_S = 0.0  # own block in the addmm epilogue, as in Python
            cpp = fused_matmul_reduce_scatter(x, b, "avg", 0, backend="TURBO", num_splits=splits)
            async_tp_impl._CPP_RS = False
            py = fused_matmul_reduce_scatter(x, b, "avg", 0, backend="TURBO", num_splits=splits)
            async_tp_impl._CPP_RS = None
            assert torch.equal(cpp, py), f"csrc vs Python GEMM+RS schedule differ (splits={splits})"
            # own block as one GEMM plus an add pass: what NCCL does (partials rounded, then summed)
            async_tp_impl._RS_FUSE_OWN_MIN_S = float("inf")
            for op in ("sum", "avg"):
                add = fused_matmul_reduce_scatter(x, b, op, 0, backend="TURBO", num_splits=splits)
                ref = fused_matmul_reduce_scatter(x, b, op, 0, backend="NCCL")
                assert_close(add, ref, torch.bfloat16, msg=f"csrc GEMM+RS add mode {op} vs NCCL")
    finally:
        async_tp_impl._CPP_RS, async_tp_impl._RS_FUSE_OWN_MIN_S = None, min_s


@pytest.mark.multigpu
@pytest.mark.deterministic
def test_async_tp_turbo_matches_nccl_2gpu():
    run_distributed(_gpu_bitwise_body, world_size=2, backend="nccl", args=(_seed(),), timeout_s=180)


def _compile_body(rank, world, device, seed):
    """torch.compile(fullgraph=True) traces the custom ops through their fake implementations."""
    from primus_turbo.pytorch.kernels.async_tp.async_tp_impl import (
        all_gather_matmul_impl,
        matmul_reduce_scatter_impl,
    )

    group_name = dist.group.WORLD.group_name

    def step(a, b):
        res = all_gather_matmul_impl(a, [b], None, [], group_name, True, [], "", 0)
        return (
            res[0],
            res[2],
            matmul_reduce_scatter_impl(res[2], b, None, None, "sum", group_name, None, "", 0),
        )

    gen = torch.Generator().manual_seed(seed + rank)
    a = torch.randn(256, 512, generator=gen).to(device, torch.bfloat16)
    b = (torch.randn(512, 512, generator=torch.Generator().manual_seed(seed)) / 16).to(device, torch.bfloat16)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(a, b), step(a, b)):
        assert_close(got, want, torch.bfloat16, msg="compiled async-TP")


@pytest.mark.multigpu
def test_async_tp_torch_compile_2gpu():
    run_distributed(_compile_body, world_size=2, backend="nccl", args=(_seed(),), timeout_s=300)
