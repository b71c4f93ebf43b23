"""The TURBO expert-parallel push kernels (primus_turbo/triton/moe/ep_kernel.py), every rank simulated in
one process: each "rank" has its own workspace tensor and ``peer_ptrs`` holds their addresses, so the
kernels write into the other ranks' buffers exactly as they do into peers' symmetric memory (on CPU through
the Triton interpreter, on a GPU as compiled kernels). The 2-GPU round trip is in tests/pytorch/dist."""

import pytest
import torch

from primus_turbo.pytorch.kernels.moe import ep_turbo
from primus_turbo.pytorch.kernels.moe.dispatch_impl import dispatch_layout
from primus_turbo.pytorch.kernels.moe.permute_impl import build_row_id_map
from primus_turbo.triton.moe import ep_kernel as ek


class _Ranks:
    def __init__(self, world, t, h, e, k, s, device, monkeypatch):
        self.world, self.t, self.h, self.e, self.k, self.s = world, t, h, e, k, s
        # the backend's own workspace layout, sized for t tokens per rank (its receive capacity W x t)
        monkeypatch.setenv("PRIMUS_TURBO_EP_MAX_TOKENS", str(t))
        self.offs, total, self.cap = ep_turbo._layout(world, h, 2, k, s)
        # non-zero garbage in the workspaces: nothing may depend on them starting clean
        self.ws = [torch.randint(0, 255, (total,), dtype=torch.uint8, device=device) for _ in range(world)]
        self.ptrs = torch.tensor([w.data_ptr() for w in self.ws], dtype=torch.int64, device=device)
        self.x = [torch.randn(t, h, device=device).to(torch.bfloat16) for _ in range(world)]
        self.idx = []
        for r in range(world):
            rows = [torch.randperm(e)[:k] for _ in range(t)]
            idx = torch.stack(rows) if t else torch.empty(0, k, dtype=torch.int64)
            if r == 0 and t > 2:  # skew: rank 0's first tokens only hit rank 0's experts
                idx[: t // 2] = torch.stack([torch.randperm(e // world)[:k] for _ in range(t // 2)])
            self.idx.append(idx.to(device))
        self.probs = [torch.rand(t, k, device=device) for _ in range(world)]
        self.scale = [torch.rand(t, max(s, 1), device=device) + 0.5 for _ in range(world)]
        self.maps, self.in_rank, counts = [], [], []
        for r in range(world):  # the reference layout (torch ops, as the NCCL path builds it)
            _, _, in_rank = dispatch_layout(self.idx[r], e, world)
            self.in_rank.append(in_rank)
            self.maps.append(build_row_id_map(in_rank, world, t * world, 0, None)[0])
            counts.append(in_rank.sum(0, dtype=torch.int64))
        self.counts = torch.stack(counts)

    def view(self, r, name, shape, dtype):
        return ep_turbo._view(self.ws[r], self.offs[name], shape, dtype)


def _blocks(h, k, world, block_r):
    r, bh, bk, bw = ek.ep_blocks(h, k, world)
    return (block_r or r), bh, bk, bw


@pytest.mark.parametrize(
    "world,t,h,block_r", [(2, 37, 200, None), (3, 29, 72, 4), (2, 5, 1100, 2), (2, 0, 64, None)]
)
@pytest.mark.parametrize("with_scale,from_mask", [(False, False), (True, True)])
def test_ep_dispatch_and_combine_push_kernels(
    world, t, h, block_r, with_scale, from_mask, device, monkeypatch
):
    e, k = 4 * world, 3
    s = 3 if with_scale else 0
    rk = _Ranks(world, t, h, e, k, s, device, monkeypatch)
    br, bh, bk, bw = _blocks(h, max(k, s), world, block_r)
    epr = e // world
    poss = []
    for r in range(world):  # numbering + count publication, every rank before any push (the barrier)
        pos = torch.full((t, world), -7, dtype=torch.int32, device=device)
        in_rank = rk.in_rank[r].view(torch.uint8) if from_mask else rk.idx[r]
        ek.ep_layout_kernel[(world,)](
            rk.idx[r], in_rank, pos, rk.ptrs, rk.offs["counts"], r, t, world, k, epr,
            FROM_INDICES=not from_mask, BLOCK_T=16, BLOCK_K=4,
        )  # fmt: skip
        poss.append(pos)
    for r in range(world):
        counts = rk.view(r, "counts", (world, world), torch.int64)
        assert torch.equal(counts, rk.counts)
        row_map = torch.full((t, world), -7, dtype=torch.int32, device=device)
        ek.ep_dispatch_push_kernel[(3,)](
            rk.x[r], rk.idx[r], rk.probs[r], rk.scale[r], poss[r], counts, row_map, rk.ptrs, r, t, world, h,
            k, s, epr, rk.offs["recv_x"], rk.offs["recv_idx"], rk.offs["recv_probs"], rk.offs["recv_scale"],
            HAS_PROBS=True, HAS_SCALE=with_scale, WRITE_MAP=True, BLOCK_R=br, BLOCK_H=bh, BLOCK_K=bk,
            BLOCK_W=bw,
        )  # fmt: skip
        assert torch.equal(row_map, rk.maps[r])  # the send layout combine's unpermute reads
    cap = rk.cap
    for d in range(world):
        ox = torch.empty(cap, h, dtype=torch.bfloat16, device=device)
        oi = torch.empty(cap, k, dtype=torch.int64, device=device)
        op = torch.empty(cap, k, device=device)
        tpe = torch.zeros(epr, dtype=torch.int32, device=device)
        ek.ep_recv_finalize_kernel[(2,)](
            rk.view(d, "recv_x", (cap, h), torch.bfloat16), rk.view(d, "recv_idx", (cap, k), torch.int32),
            rk.view(d, "recv_probs", (cap, k), torch.float32), ox, oi, op, tpe, rk.counts, d, world, cap, h,
            k, HAS_PROBS=True, HAS_TPE=True, BLOCK_R=br, BLOCK_H=bh, BLOCK_K=bk, BLOCK_W=bw,
        )  # fmt: skip
        # reference: rank d receives, source by source, the tokens with an expert on d, in token order
        want_x, want_i, want_p, want_s = [], [], [], []
        for src in range(world):
            own = ((rk.idx[src] // epr) == d).any(1)
            local = rk.idx[src][own] - d * epr
            mine = (local >= 0) & (local < epr)
            want_x.append(rk.x[src][own])
            want_i.append(torch.where(mine, local, -1))
            want_p.append(torch.where(mine, rk.probs[src][own], 0.0))
            want_s.append(rk.scale[src][own][:, :s])
        n = int(rk.counts[:, d].sum())
        assert n == sum(v.shape[0] for v in want_x)
        assert torch.equal(ox[:n], torch.cat(want_x))
        assert torch.equal(oi[:n], torch.cat(want_i))
        assert torch.equal(op[:n], torch.cat(want_p))
        assert (oi[n:] == -1).all() and (op[n:] == 0).all()
        routes = torch.cat(want_i)
        assert torch.equal(tpe, torch.bincount(routes[routes >= 0], minlength=epr).to(torch.int32))
        if with_scale:
            assert torch.equal(rk.view(d, "recv_scale", (cap, s), torch.float32)[:n], torch.cat(want_s))

    # combine: every rank pushes its received rows back into their sources' combine regions
    ys = [torch.randn(cap, h, device=device).to(torch.bfloat16) for _ in range(world)]
    ws = [torch.randn(cap, k, device=device) for _ in range(world)]
    for d in range(world):
        ek.ep_combine_push_kernel[(3,)](
            ys[d], ws[d], rk.counts, rk.ptrs, d, world, h, k, rk.offs["comb_y"], rk.offs["comb_w"],
            HAS_W=True, BLOCK_R=br, BLOCK_H=bh, BLOCK_K=bk, BLOCK_W=bw,
        )  # fmt: skip
    for src in range(world):
        comb_y = rk.view(src, "comb_y", (cap, h), torch.bfloat16)
        comb_w = rk.view(src, "comb_w", (cap, k), torch.float32)
        row = 0  # src's send layout is destination-major; d returns them from its receive rows of src
        for d in range(world):
            c, first = int(rk.counts[src, d]), int(rk.counts[:src, d].sum())
            assert torch.equal(comb_y[row : row + c], ys[d][first : first + c]), (src, d)
            assert torch.equal(comb_w[row : row + c], ws[d][first : first + c]), (src, d)
            row += c


def test_ep_blocks_keep_a_tile_near_16k_elements():
    assert ek.ep_blocks(7168, 8, 2) == (16, 1024, 16, 2)
    assert ek.ep_blocks(2048, 6, 8) == (16, 1024, 16, 8)
    assert ek.ep_blocks(64, 64, 3) == (64, 64, 64, 4)
