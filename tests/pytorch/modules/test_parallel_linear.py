"""ColumnParallelLinear / RowParallelLinear: fwd + bwd of each TP rank against the unsharded fp64 layer.

Each rank builds the full layer's weight, input and upstream gradient from one seed, loads its
shard, runs forward/backward, and compares its output shard and gradient shards with autograd
on the full fp64 layer. CPU: gloo, 2 ranks, NCCL backend. 2 GPUs: TURBO / SYMM_MEM, bf16 and FP8.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from ref.async_tp_ref import linear_ref
from test_utils import assert_close, assert_snr, fp8_snr_gate

from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, ScalingGranularity
from primus_turbo.pytorch.modules.parallel_linear import ColumnParallelLinear, RowParallelLinear


def _full_problem(seed, seq, batch, d_in, d_out, dtype):
    """The unsharded layer in fp64 on inputs already rounded to ``dtype`` (what the layer sees)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()

    # w and g scaled by 1/4: the partial products that get reduced across ranks stay below 1 in
    # magnitude, so one bf16 ulp of a partial (rounded before the reduction) stays under atol
    x, w = rand(seq, batch, d_in), rand(d_out, d_in, scale=0.25 * d_in**-0.5)
    b, g = rand(d_out), rand(seq, batch, d_out, scale=0.25)
    x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    y = linear_ref(x, w, b)
    (y * g).sum().backward()
    return x.detach(), w.detach(), b.detach(), g, y.detach(), x.grad, w.grad, b.grad


def _check_layer(
    kind, rank, world, device, seed, dtype, sp, backend=None, fp8=None, seq=6, d_in=32, d_out=48, **layer_kw
):
    x, w, b, g, y_ref, dx_ref, dw_ref, db_ref = _full_problem(seed, seq, 3, d_in, d_out, dtype)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = cls(
        d_in,
        d_out,
        sequence_parallel=sp,
        fp8_config=fp8,
        backend=backend,
        device=device,
        dtype=dtype,
        **layer_kw,
    )
    seq_shard = lambda t: t.chunk(world, 0)[rank] if sp else t  # noqa: E731
    if kind == "column":
        w_shard, b_shard = w.chunk(world, 0)[rank], b.chunk(world, 0)[rank]
        x_in, out_of = seq_shard(x), lambda t: t.chunk(world, -1)[rank]
        dx_want, dw_want, db_want = (
            seq_shard(dx_ref),
            dw_ref.chunk(world, 0)[rank],
            db_ref.chunk(world, 0)[rank],
        )
    else:
        w_shard, b_shard = w.chunk(world, 1)[rank], b
        x_in, out_of = x.chunk(world, -1)[rank], seq_shard
        dx_want, dw_want, db_want = dx_ref.chunk(world, -1)[rank], dw_ref.chunk(world, 1)[rank], db_ref
    assert tuple(layer.weight.shape) == tuple(w_shard.shape), "Megatron weight shape"
    with torch.no_grad():
        layer.weight.copy_(w_shard), layer.bias.copy_(b_shard)
    xd = x_in.to(device, dtype).requires_grad_(True)
    y = layer(xd)
    y.backward(out_of(g).to(device, dtype))
    tag = f"{kind} sp={sp} {dtype} {backend} fp8={fp8 is not None}"
    results = [
        ("out", y, out_of(y_ref)),
        ("dx", xd.grad, dx_want),
        ("dw", layer.weight.grad, dw_want),
        ("db", layer.bias.grad, db_want),
    ]
    for name, got, want in results:
        assert got.shape == want.shape, f"{tag} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if fp8 is None:
            assert_close(got.cpu(), want, dtype, msg=f"{tag} {name}")
        else:  # FP8 forward GEMM, bf16 backward on the dequantized saved input: gate everything by SNR
            assert_snr(got.float().cpu(), want, fp8_snr_gate(fp8.format), msg=f"{tag} {name}")


def _gloo_body(rank, world, device, seed):
    for i, (kind, sp) in enumerate([("column", True), ("row", True), ("column", False), ("row", False)]):
        _check_layer(kind, rank, world, device, seed + i, torch.float32, sp)
    _check_layer("column", rank, world, device, seed + 4, torch.bfloat16, True)
    _check_layer("column", rank, world, device, seed + 10, torch.float32, True, save_gathered_input=False)
    _check_layer("row", rank, world, device, seed + 5, torch.bfloat16, True)
    for j, gran in enumerate((ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE)):
        cfg = Float8QuantConfig(granularity=gran)
        _check_layer("column", rank, world, device, seed + 6 + j, torch.bfloat16, True, fp8=cfg)
        _check_layer("row", rank, world, device, seed + 8 + j, torch.bfloat16, True, fp8=cfg)
    # bad input: sequence not divisible by TP, wrong feature size, dtype mix
    row = RowParallelLinear(32, 48, sequence_parallel=True)
    # its bias gradient is already the full-sequence sum (db above): marked sequence_parallel, Megatron's
    # finalize_model_grads would all-reduce it over TP once more (tp x the gradient)
    assert not getattr(row.bias, "sequence_parallel", False)
    with pytest.raises(ValueError, match="not divisible by the TP size"):
        row(torch.randn(5, 2, 16))
    col = ColumnParallelLinear(32, 48, sequence_parallel=True)
    with pytest.raises(ValueError, match="in_features=32"):
        col(torch.randn(4, 2, 31))
    with pytest.raises(TypeError, match="dtype"):
        col(torch.randn(4, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_features=47"):
        ColumnParallelLinear(32, 47)


def test_parallel_linear_gloo():
    run_distributed(_gloo_body, world_size=2, backend="gloo", args=(int(torch.randint(0, 2**30, ()).item()),))


def _gpu_body(rank, world, device, seed):
    shape = dict(seq=2048, d_in=1024, d_out=2048)
    for backend in ("NCCL", "TURBO", "SYMM_MEM", None):
        for kind in ("column", "row"):
            _check_layer(kind, rank, world, device, seed, torch.bfloat16, True, backend, **shape)
        _check_layer(
            "column", rank, world, device, seed, torch.bfloat16, True, backend, save_gathered_input=False
        )
    for gran in (ScalingGranularity.TENSORWISE, ScalingGranularity.ROWWISE):
        for kind in ("column", "row"):
            cfg = Float8QuantConfig(granularity=gran)
            _check_layer(kind, rank, world, device, seed, torch.bfloat16, True, "TURBO", cfg, **shape)


@pytest.mark.multigpu
def test_parallel_linear_2gpu():
    run_distributed(_gpu_body, world_size=2, backend="nccl", args=(int(torch.randint(0, 2**30, ()).item()),))
