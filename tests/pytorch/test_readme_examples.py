"""The README's operator examples run as written (on a CPU: device "cuda" -> "cpu", the reference backends),
so the documented calls and argument orders cannot drift from the API."""

import os
import re

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _operator_examples() -> list[str]:
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Using the operators", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_readme_gemm_and_moe_examples_run_on_a_cpu():
    blocks = _operator_examples()
    basic = next(b for b in blocks if "turbo.ops.gemm(a, b)" in b)
    moe = next(b for b in blocks if "fused_topk_routing" in b)
    scope: dict = {}
    for block in (basic, moe):
        exec(compile(block.replace('device="cuda"', 'device="cpu"'), "README.md", "exec"), scope)
    y, x, f8 = scope["y"], scope["x"], scope["f8"]
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert x.grad is not None and scope["w_up"].grad.abs().sum() > 0
    assert f8(torch.randn(4, f8.in_features)).shape == (4, f8.out_features)
    assert scope["c"].shape == (128, 256) and scope["a"].grad is not None
