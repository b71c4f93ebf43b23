"""fp64 references for grouped GEMM and helpers that build MoE token distributions."""

from __future__ import annotations

import torch


def grouped_gemm_ref(a: torch.Tensor, b: torch.Tensor, group_lens, trans_b: bool = False) -> torch.Tensor:
    """out[rows_g] = a[rows_g] @ b[g] (or b[g].T), computed in fp64 with a per-group loop."""
    a64, b64 = a.detach().double(), b.detach().double()
    outs, start = [], 0
    for g, n in enumerate(group_lens.tolist()):
        w = b64[g].t() if trans_b else b64[g]
        outs.append(a64[start : start + n] @ w)
        start += n
    return torch.cat(outs)


def grouped_gemm_grads_ref(a, b, group_lens, grad_out, trans_b: bool = False):
    """fp64 (grad_a, grad_b) of grouped_gemm_ref through autograd."""
    a64 = a.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    outs, start = [], 0
    for g, n in enumerate(group_lens.tolist()):
        w = b64[g].t() if trans_b else b64[g]
        outs.append(a64[start : start + n] @ w)
        start += n
    torch.cat(outs).backward(grad_out.double())
    return a64.grad, b64.grad


def make_group_lens(total: int, groups: int, kind: str, device="cpu") -> torch.Tensor:
    """Token counts per expert summing to ``total``.

    balanced: near-equal; skewed: expert 0 gets ~60%, the rest random; empty: about half the
    experts get nothing (always including the first and the last).
    """
    if kind == "balanced":
        lens = torch.full((groups,), total // groups, dtype=torch.int64)
        lens[: total % groups] += 1
    elif kind == "skewed":
        big = (total * 3) // 5
        rest = torch.rand(groups - 1).double() + 0.05
        lens = torch.cat([torch.tensor([big]), (rest / rest.sum() * (total - big)).floor().long()])
        lens[-1] += total - lens.sum()
    elif kind == "empty":
        live = torch.randperm(groups)[: max(1, groups // 2)]
        live = live[(live != 0) & (live != groups - 1)]
        if live.numel() == 0:
            live = torch.tensor([groups // 2])
        weights = torch.zeros(groups, dtype=torch.float64)
        weights[live] = torch.rand(live.numel()).double() + 0.1
        lens = (weights / weights.sum() * total).floor().long()
        lens[live[0]] += total - lens.sum()
    else:
        raise ValueError(f"make_group_lens: unknown kind {kind!r}")
    assert int(lens.sum()) == total and (lens >= 0).all()
    return lens.to(device)
