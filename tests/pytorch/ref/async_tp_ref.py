"""fp64 single-process references for async-TP ops and the parallel linears.

Every rank builds all ranks' inputs from one seed, so the reference needs no communication.
"""

from __future__ import annotations

import torch


def rank_inputs(seed: int, world: int, *shapes_per_rank, dtype=torch.float32) -> list[list[torch.Tensor]]:
    """[rank][i] random tensors (randn, never zeros), identical on every process for one seed."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(*shape, generator=gen).to(dtype) for shape in shapes_per_rank] for _ in range(world)]


def all_gather_matmul_ref(
    shards: list[torch.Tensor], b: torch.Tensor, gather_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cat(shards, gather_dim), that @ b) in fp64."""
    a_full = torch.cat([s.double() for s in shards], dim=gather_dim)
    return a_full, a_full @ b.double()


def matmul_reduce_scatter_ref(
    a_per_rank: list[torch.Tensor],
    b_per_rank: list[torch.Tensor],
    reduce_op: str,
    scatter_dim: int,
    rank: int,
) -> torch.Tensor:
    """Chunk ``rank`` along scatter_dim of sum/avg over ranks of a_r @ b_r, in fp64.

    Each partial is rounded to the inputs' dtype first: that is what crosses the wire in every
    backend (and in NCCL's own reduce-scatter), so only the final rounding is left to tolerate.
    """
    dtype = a_per_rank[0].dtype if a_per_rank[0].dtype.is_floating_point else torch.float64
    if dtype.itemsize == 1:  # fp8 operands produce bf16 partials
        dtype = torch.bfloat16
    total = sum((a.double() @ b.double()).to(dtype).double() for a, b in zip(a_per_rank, b_per_rank))
    if reduce_op == "avg":
        total = total / len(a_per_rank)
    return total.chunk(len(a_per_rank), dim=scatter_dim)[rank]


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x @ weight.T + bias in fp64 (the unsharded layer)."""
    y = x.double() @ weight.double().t()
    return y + bias.double() if bias is not None else y
