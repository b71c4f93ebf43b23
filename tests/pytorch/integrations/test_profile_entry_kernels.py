"""profile_entry's E2E_PROFILE_KERNEL lists: every launch of one kernel in start order with its GPU time,
and what each live turbo AdamW launches per step (so a slow launch can be named)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "benchmark", "e2e"))

import profile_entry  # noqa: E402

from primus_turbo.pytorch.core.utils import triton_interpret_enabled  # noqa: E402


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class _Event:
    def __init__(self, name, start, end, gpu=True):
        self.name, self.time_range = name, _Range(start, end)
        self.device_type = torch.autograd.DeviceType.CUDA if gpu else torch.autograd.DeviceType.CPU


def test_kernel_calls_lists_matching_launches_in_start_order():
    events = [
        _Event("adamw_kernel", 500, 1700),
        _Event("void at::native::copy_kernel<float>(int)", 0, 50),
        _Event("adamw_kernel", 100, 350),
        _Event("adamw_kernel", 0, 10, gpu=False),  # the host op of that name: not a GPU launch
    ]
    prof = type("P", (), {"events": lambda self: events})()
    assert profile_entry.kernel_calls(prof, "adamw") == [
        {"kernel": "adamw_kernel", "us": 250}, {"kernel": "adamw_kernel", "us": 1200}
    ]
    assert profile_entry.kernel_calls(prof, "copy_kernel") == [{"kernel": "copy_kernel", "us": 50}]


def test_adamw_launches_describes_each_live_optimizer():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not triton_interpret_enabled():
        pytest.skip("the AdamW kernel runs on CPU only under TRITON_INTERPRET=1")
    from primus_turbo.pytorch.optim import AdamW
    from primus_turbo.triton.optim.adamw_kernel import BLOCK

    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (5000, 3)]
    params.append(torch.nn.Parameter(torch.randn(7, device=device).bfloat16()))
    for p in params:
        p.grad = torch.randn_like(p)
    opt = AdamW(params, lr=1e-3)
    opt.step()
    mine = [launches for launches in profile_entry.adamw_launches() if launches == opt.launches()]
    blocks = -(-5000 // BLOCK) + 1  # 5000 elements, then 3
    assert mine and mine[0] == [
        {"group": 0, "tensors": 2, "elements": 5003, "blocks": blocks, "dtypes": ("float32",) * 3 + (None,),
         "aligned": mine[0][0]["aligned"]},
        {"group": 0, "tensors": 1, "elements": 7, "blocks": 1, "dtypes": ("bfloat16",) * 3 + (None,),
         "aligned": mine[0][1]["aligned"]},
    ]
