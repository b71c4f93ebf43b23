"""Training-integration audit (session 36), CPU: checkpoints across turbo on/off, fail-loud patches.

- Megatron checkpoints keyed by parameter name (``integrations/megatron/checkpointing.py``): a run saved with
  turbo on resumes with turbo off and the reverse (TEGroupedMLP's ``weight<i>`` vs SequentialMLP's
  ``local_experts.<i>``, and the experts in another DDP buffer, hence other distributed-optimizer shards),
  with the same losses as the run that saved it; a checkpoint that cannot serve the run stops it with the
  names that differ, not a DCP traceback.
- Patch registry: a turbo entry whose Megatron name is gone (another version) is an apply failure (strict:
  stop; else a 'stock' row with nothing left half-patched), not an 'active' row over a dead attribute; a
  condition or probe that raises is reported the same way; turbo.gemm under MLA leaves the stock linears
  when it cannot apply; a TorchTitan swap that finds no module is not 'active'.
"""

import json
import os
import sys
import types

import pytest
from dist_utils import run_on_free_port
from torchtitan_models import TINY_MLA

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
pytest.importorskip("megatron.core")
pytest.importorskip("hydra")



def torchrun(*overrides, nproc=1, timeout=240):
    def cmd(port):
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                f"--master_port={port}", "train.py", "train.progress=false", *overrides]  # fmt: skip

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = run_on_free_port(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def _losses(path):
    with open(path) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


# ---- Megatron checkpoints across turbo on / off ---------------------------------------------------------

# ep=1 on 2 ranks: stock experts live in the dense gradient buffer, turbo experts in the expert buffer, so
# the distributed optimizer cuts the parameters at other places (one layer: the cuts do not line up).
LAYOUT = ["parallel.ep=1", "model.num_layers=1"]


@pytest.mark.parametrize(
    "saved, resumed", [("true", "false"), ("false", "true")], ids=["on_to_off", "off_to_on"]
)
def test_megatron_checkpoint_resumes_across_turbo_on_off_with_the_same_losses(tmp_path, saved, resumed):
    """Format 1 keyed the model by module path and the optimizer state by index: turbo off could not load
    a turbo checkpoint ('Missing key in checkpoint state_dict: ...local_experts.0.linear_fc1.weight') and the
    reverse. Now steps 4 and 5 after the switch (they read the Adam moments) match the saving run (fp32)."""
    ckpt = tmp_path / "ckpt"
    common = [*LAYOUT, "train.steps=5", f"train.ckpt_dir={ckpt}"]
    rc, out = torchrun(*common, "train.save_interval=3", f"turbo.enabled={saved}",
                       f"train.metrics_file={tmp_path / 'full.jsonl'}", nproc=2)  # fmt: skip
    assert rc == 0, out[-3000:]
    (ckpt / "latest").write_text("3")
    rc, out = torchrun(*common, "resume=true", f"turbo.enabled={resumed}",
                       f"train.metrics_file={tmp_path / 'resumed.jsonl'}", nproc=2)  # fmt: skip
    assert rc == 0, out[-3000:]
    assert "resume: loaded step 3" in out
    assert ("TurboGroupedMLP" in out) == (resumed == "true"), out[-3000:]
    full, resumed_losses = _losses(tmp_path / "full.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert list(resumed_losses) == [4, 5]
    for step in (4, 5):
        assert resumed_losses[step] == pytest.approx(full[step], rel=1e-5), (full, resumed_losses)


def test_megatron_resume_that_cannot_load_names_what_differs(tmp_path):
    """Another expert size or world size: one line naming the tensors / ranks, exit 4, no DCP traceback."""
    ckpt = tmp_path / "ckpt"
    rc, out = torchrun(*LAYOUT, "train.steps=1", f"train.ckpt_dir={ckpt}")
    assert rc == 0, out[-3000:]
    rc, out = torchrun(*LAYOUT, "train.steps=2", f"train.ckpt_dir={ckpt}", "resume=true",
                       "model.moe.ffn_hidden_size=64")  # fmt: skip
    assert rc != 0
    assert "differ in shape (saved vs here): decoder.layers.0.mlp.experts.local_experts.0.linear_fc1" in out
    assert "(256, 128) vs (128, 128)" in out and "[rank0]: Traceback" not in out, out[-3000:]
    rc, out = torchrun(*LAYOUT, "train.steps=2", f"train.ckpt_dir={ckpt}", "resume=true", nproc=2)
    assert rc != 0
    assert "holds ranks 0..0 (world size 1), this run has world size 2" in out, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out, out[-3000:]


# ---- patch registry: fail loudly, report, never half-apply ---------------------------------------------


def _megatron_cfg(*overrides):
    from hydra import compose, initialize_config_dir
    from primus_turbo.integrations.hydra_main import RECIPES_DIR

    with initialize_config_dir(config_dir=RECIPES_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture
def megatron_patches():
    """apply_megatron_patches(cfg) -> ({row name: row}, spec); every turbo entry undone afterwards."""
    from primus_turbo.integrations.common.patch_registry import restore_patched_attrs
    from primus_turbo.integrations.megatron.patches import apply_megatron_patches
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider

    def apply(cfg):
        spec = TurboSpecProvider(cfg)
        return {r.name: r for r in apply_megatron_patches(cfg, spec)}, spec

    restore_patched_attrs()
    yield apply
    restore_patched_attrs()


@pytest.mark.parametrize(
    "module, attr, feature",
    [
        ("megatron.core.transformer.moe.moe_layer", "MoEAlltoAllTokenDispatcher", "dispatch"),
        ("megatron.core.transformer.moe.token_dispatcher", "unpermute", "permute"),
    ],
    ids=["dispatch", "permute_second_of_two"],
)
def test_megatron_patch_whose_name_is_gone_fails_or_falls_back_whole(monkeypatch, megatron_patches, module,
                                                                    attr, feature):  # fmt: skip
    """The registry checked the entry's ``target``, but the apply wrote names of its own (moe_layer's import
    of the dispatcher; token_dispatcher's unpermute next to the target permute): with such a name gone
    (another Megatron version) the apply created a dead attribute and the row said 'active' while stock code
    ran. turbo.permute replaced permute before failing on unpermute: the fallback undoes it."""
    import importlib

    from megatron.core.transformer.moe import token_dispatcher
    from primus_turbo.integrations.common.patch_registry import FALLBACK, PatchError

    target = importlib.import_module(module)
    monkeypatch.delattr(target, attr)
    stock_permute = token_dispatcher.permute
    with pytest.raises(PatchError, match=rf"turbo\.{feature} cannot serve this run: apply failed: .*{attr}"):
        megatron_patches(_megatron_cfg("parallel.ep=1"))
    rows, _ = megatron_patches(_megatron_cfg("parallel.ep=1", "turbo.strict=false"))
    assert rows[f"turbo.{feature}"].status == FALLBACK, rows[f"turbo.{feature}"]
    assert not hasattr(target, attr)  # nothing added
    assert token_dispatcher.permute is stock_permute or feature != "permute"  # not half-applied


def test_condition_or_probe_that_raises_is_reported_not_a_traceback():
    from primus_turbo.integrations.common.patch_registry import (
        FALLBACK,
        PatchError,
        PatchRegistry,
        apply_patches,
    )

    def moved(ctx):
        raise AttributeError("module 'megatron.core.utils' has no attribute 'local_multi_tensor_l2_norm'")

    registry = PatchRegistry("demo")
    registry.register("fix.norm", "os.path.join", ("1.0",), condition=moved)(lambda ctx: "fixed")
    registry.register("turbo.gemm", "os.path.join", ("1.0",), feature="gemm", probe=moved)(lambda ctx: "on")
    strict = types.SimpleNamespace(enabled=True, strict=True, gemm=True, get=lambda k, d=None: True)
    with pytest.raises(PatchError, match="fix.norm .* cannot apply: condition failed: AttributeError"):
        apply_patches(registry, None, strict, "1.0")
    lenient = types.SimpleNamespace(enabled=True, strict=False, gemm=True, get=lambda k, d=None: True)
    rows = {r.name: r for r in apply_patches(registry, None, lenient, "1.0")}
    assert rows["fix.norm"].status == FALLBACK and "local_multi_tensor_l2_norm" in rows["fix.norm"].detail
    assert rows["turbo.gemm"].status == FALLBACK and "probe failed" in rows["turbo.gemm"].detail


def test_turbo_gemm_that_cannot_serve_mla_leaves_the_stock_linears(monkeypatch, megatron_patches):
    """With Transformer Engine installed, turbo.gemm under MLA refuses (its linear would shadow TE's in MLA's
    class list). It set spec.linear before refusing: under turbo.strict=false the row said 'stock' while
    every Column/RowParallelLinear was built as the turbo one."""
    from primus_turbo.integrations.common.patch_registry import FALLBACK

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    rows, spec = megatron_patches(_megatron_cfg(*TINY_MLA, "turbo.strict=false"))
    assert rows["turbo.gemm"].status == FALLBACK and "Transformer Engine" in rows["turbo.gemm"].detail
    assert not spec.linear
    assert spec.column_parallel_linear().__name__ == "ColumnParallelLinear"


def test_torchtitan_swap_that_finds_nothing_is_not_reported_active():
    """A model (or TorchTitan version) without nn.RMSNorm: the row said 'active -- 0 nn.RMSNorm -> turbo
    RMSNorm'. Now it is 'n/a' with the reason, as the converter's other swaps over absent modules are."""
    pytest.importorskip("torchtitan")
    from primus_turbo.integrations.common.patch_registry import ACTIVE, NOT_APPLICABLE
    from primus_turbo.integrations.torchtitan import converter as conv
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.proj = nn.Linear(16, 16, bias=False)

    rows = {r.name: r for r in conv.convert_model(Block(), conv.TurboOptions())}
    assert rows["turbo.rmsnorm"].status == NOT_APPLICABLE and "no nn.RMSNorm" in rows["turbo.rmsnorm"].detail
    assert rows["turbo.gemm"].status == ACTIVE and "1 nn.Linear" in rows["turbo.gemm"].detail
    empty = {r.name: r.status for r in conv.convert_model(nn.Sequential(), conv.TurboOptions())}
    assert ACTIVE not in empty.values(), empty  # nothing to swap: nothing active


@pytest.mark.parametrize("resume", [False, True])
def test_metrics_file_starts_fresh_unless_resuming(tmp_path, resume):
    """A second run to the same train.metrics_file appended its rows to the first run's (8 rows for two
    4-step runs); the readers take every row as this run's. A resumed run continues the file."""
    from types import SimpleNamespace

    from primus_turbo.integrations.common.metrics import StepMetrics

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 9.0}\n')  # an earlier run's row
    train = SimpleNamespace(steps=1, progress=False, metrics_file=str(path), tensorboard_dir=None)
    metrics = StepMetrics(SimpleNamespace(train=train, resume=resume), 1, 1e9, "bf16", is_writer=True)
    metrics.record(1, 2.0, 0.5, 1024, 1e-3, 1.0)
    metrics.close()
    assert len(path.read_text().splitlines()) == (2 if resume else 1)
