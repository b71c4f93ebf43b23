"""Recipes compose; bad values fail in validate_config with a message naming the key; FLOPs formula."""

import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from primus_turbo.integrations.common.config import ConfigError, validate_config
from primus_turbo.integrations.common.metrics import model_flops_per_token, peak_tflops

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "recipes")
ALL_RECIPES = ["tiny_moe", "tiny_dense", "deepseek_moe_bf16", "deepseek_moe_fp8", "llama3_8b_fp8",
               "mixtral_8x7b_proxy"]  # fmt: skip


def _has_fp8_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _cfg(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(RECIPES), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_is_tiny_moe_with_ep2_and_turbo_strict():
    cfg = _cfg()
    assert cfg.recipe_name == "tiny_moe" and cfg.parallel.ep == 2 and cfg.framework.name == "megatron"
    assert cfg.turbo.enabled is True and cfg.turbo.strict is True and cfg.fp8.enabled is False
    validate_config(cfg, world_size=2)


@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_every_recipe_composes_and_validates_on_one_gpu_shape(recipe):
    cfg = _cfg(f"recipe={recipe}")
    assert cfg.recipe_name == recipe
    assert cfg.fp8.enabled == recipe.endswith("fp8")
    if cfg.fp8.enabled and not _has_fp8_gpu():  # the fp8 check must say why it cannot run here
        with pytest.raises(ConfigError, match="precision=fp8 needs"):
            validate_config(cfg, world_size=1)
        validate_config(_cfg(f"recipe={recipe}", "precision=bf16"), world_size=1)
    elif cfg.fp8.enabled:
        validate_config(cfg, world_size=1)
    else:
        validate_config(cfg, world_size=1 if recipe != "tiny_moe" else 2)


def test_precision_override_and_fp8_recipe_choice():
    cfg = _cfg("recipe=deepseek_moe_bf16", "precision=fp8", "fp8.recipe=blockwise")
    assert cfg.fp8.enabled and cfg.fp8.recipe == "blockwise"
    assert _cfg("recipe=deepseek_moe_fp8", "precision=bf16").fp8.enabled is False


@pytest.mark.parametrize(
    "recipe, experts, expected",
    [("rowwise", "same", "rowwise"), ("rowwise", "blockwise", "blockwise"),
     ("blockwise", "rowwise", "rowwise"), ("delayed", "same", "tensorwise"),
     ("delayed", "rowwise", "rowwise"), ("tensorwise", "same", "tensorwise")],
)  # fmt: skip
def test_fp8_expert_recipe_is_the_linears_unless_given(recipe, experts, expected):
    from omegaconf import OmegaConf
    from primus_turbo.integrations.common.config import fp8_expert_recipe

    assert _cfg().fp8.expert_recipe == "same"
    assert fp8_expert_recipe(OmegaConf.create({"recipe": recipe, "expert_recipe": experts})) == expected
    with pytest.raises(ValueError, match="fp8.expert_recipe='ROWWISE'"):
        fp8_expert_recipe(OmegaConf.create({"recipe": recipe, "expert_recipe": "ROWWISE"}))


@pytest.mark.parametrize(
    "recipe, fmt, expected",
    [("rowwise", "auto", "HYBRID"), ("tensorwise", "auto", "HYBRID"), ("delayed", "auto", "HYBRID"),
     ("blockwise", "auto", "E4M3"), ("rowwise", "e4m3", "E4M3"), ("blockwise", "hybrid", "HYBRID")],
)  # fmt: skip
def test_fp8_format_follows_the_recipe_unless_given(recipe, fmt, expected):
    from primus_turbo.integrations.common.config import fp8_format_name

    from primus_turbo.pytorch.core.low_precision import Format

    assert _cfg().fp8.format == "auto"
    assert Format[fp8_format_name(recipe, fmt)].name == expected
    with pytest.raises(ValueError, match="fp8.format='E4M3'"):
        fp8_format_name(recipe, "E4M3")


def test_unknown_recipe_lists_the_options():
    with pytest.raises(ConfigCompositionException) as err:
        _cfg("recipe=no_such_recipe")
    assert "no_such_recipe" in str(err.value) and "tiny_moe" in str(err.value)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.ep=3"], 2, r"parallel.tp\*ep\*pp = 1\*3\*1 = 3 does not divide world size 2"),
        (
            ["parallel.tp=2", "parallel.ep=1"],
            3,
            r"parallel.tp\*pp\*cp = 2\*1\*1 = 2 does not divide world size 3",
        ),
        (
            ["parallel.tp=2", "parallel.ep=1", "model.num_query_groups=1"],
            2,
            "num_query_groups=1 not divisible",
        ),
        (["parallel.ep=2", "model.moe.num_experts=5"], 2, r"num_experts=5 % ep=2"),
        (["model.moe.topk=9"], 2, r"model.moe.topk=9: expected 1..4"),
        (
            ["parallel.pp=2", "parallel.ep=1", "model.num_layers=3"],
            2,
            "num_layers=3 not divisible by parallel.pp=2",
        ),
        (["parallel.sequence_parallel=true"], 2, "sequence_parallel=true needs parallel.tp > 1"),
        (["data.global_batch_size=6"], 2, "global_batch_size=6 is not a multiple of micro_batch_size\\*dp"),
        (["fp8.recipe=mxfp8"], 2, "fp8.recipe='mxfp8': expected one of"),
        (["fp8.format=e5m2"], 2, r"fp8.format='e5m2': expected one of \('auto', 'hybrid', 'e4m3'\)"),
        (["fp8.expert_recipe=delayed"], 2, r"fp8.expert_recipe='delayed': expected one of \('same', 'tens"),
        (["train.dtype=fp16"], 2, "train.dtype='fp16'"),
        (["train.steps=0"], 2, "train.steps=0"),
        (["resume=true"], 2, "resume=true needs train.ckpt_dir"),
        (["data.path=/no/such/file.txt"], 2, "data.path='/no/such/file.txt' does not exist"),
        (["turbo.gemm=maybe"], 2, "turbo.gemm='maybe': expected true or false"),
        (["turbo.mla_qkv=no"], 2, "turbo.mla_qkv='no': expected true or false"),
        (["resume=no", "train.ckpt_dir=ckpt"], 2, "resume='no': expected true or false"),
        (["train.save_at_end=no"], 2, "train.save_at_end='no': expected true or false"),
        (["train.activation_recompute=yes"], 2, "train.activation_recompute='yes': expected true or false"),
        (["train.log_interval=0"], 2, "train.log_interval=0: expected an integer >= 1"),
        (["data.global_batch_size=0"], 2, "data.global_batch_size=0: expected an integer >= 1"),
        (["train.warmup_steps=-1"], 2, "train.warmup_steps=-1: expected an integer >= 0"),
        (["train.save_interval=-5"], 2, "train.save_interval=-5: expected an integer >= 0"),
        (["train.clip_grad=-1"], 2, r"train.clip_grad=-1(\.0)?: expected >= 0"),
        (["model.moe.dispatcher=nccl"], 2, "model.moe.dispatcher='nccl'"),
        (
            ["parallel.tp=2", "parallel.ep=1", "parallel.sequence_parallel=true", "turbo.enabled=false"],
            2,
            "sequence_parallel=true needs turbo.enabled=true and turbo.rmsnorm=true",
        ),
        (["parallel.cp=2", "turbo.attention=false"], 2, "cp=2 needs turbo.enabled=true and turbo.attention"),
        (["parallel.cp=2", "turbo.enabled=false"], 2, "stock Megatron-Core core attention without Transf"),
        (["parallel.cp=2", "framework=torchtitan"], 2, "context parallelism is wired for framework=megatron"),
        (["parallel.cp=3", "parallel.ep=1"], 3, r"seq_length=128 must be divisible by 2\*parallel.cp=6"),
    ],
)
def test_bad_values_name_the_key(overrides, world, message):
    cfg = _cfg(*overrides)
    if cfg.data.kind == "text" and not os.path.isabs(cfg.data.path) and cfg.data.path == "data/sample.txt":
        cfg.data.path = os.path.join(RECIPES, "..", "data", "sample.txt")
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, world_size=world)


def test_stock_torchtitan_sequence_parallel_is_valid():
    """TorchTitan's TP plan shards the norms itself: only the Megatron path needs turbo's SP RMSNorm."""
    overrides = ("parallel.tp=2", "parallel.ep=1", "parallel.sequence_parallel=true", "turbo.enabled=false")
    validate_config(_cfg(*overrides, "framework=torchtitan"), world_size=2)


def test_dense_model_rejects_expert_parallel():
    with pytest.raises(ConfigError, match="needs an MoE model"):
        validate_config(_cfg("recipe=tiny_dense", "parallel.ep=2"), world_size=2)


def test_flops_dense_gqa_matches_hand_count():
    cfg = _cfg("recipe=llama3_8b_fp8").model
    h, f, s, v, L = 4096, 14336, 4096, 128256, 8
    attn_proj = h * (32 + 2 * 8) * 128 + 32 * 128 * h
    per_layer = 2 * attn_proj + 2 * s * 32 * 256 * 0.5 + 2 * 3 * h * f
    expected = 3 * (L * per_layer + 2 * h * v)
    assert model_flops_per_token(cfg) == pytest.approx(expected, rel=1e-12)


def test_flops_moe_counts_topk_and_shared_experts_only():
    cfg = _cfg("recipe=deepseek_moe_bf16").model
    base = model_flops_per_token(cfg)
    cfg.moe.num_experts = 128  # more experts: only the router grows
    grown = model_flops_per_token(cfg)
    assert grown - base == pytest.approx(3 * 3 * 2 * 2048 * 64, rel=1e-12)  # 3 MoE layers, router 2*h*dE
    cfg.moe.topk = 7
    assert model_flops_per_token(cfg) - grown == pytest.approx(3 * 3 * 2 * 3 * 2048 * 1408, rel=1e-12)


def test_peak_table():
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "fp8") == 1979.0
    assert peak_tflops(None, "bf16") is None and peak_tflops("NVIDIA A100", "bf16") is None
    # the PCIe / NVL cards have their own (lower) peaks: the bare "H100" substring gave them the SXM one
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H100 NVL", "fp8") == 1671.0 and peak_tflops("NVIDIA H200 NVL", "bf16") == 835.0


def test_non_finite_loss_stops_with_the_step():
    from primus_turbo.integrations.common.metrics import check_finite

    check_finite(2.5, 1)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(FloatingPointError, match="at step 7"):
            check_finite(bad, 7)


def test_batches_are_a_pure_function_of_step_microbatch_rank():
    from primus_turbo.integrations.common.data import TokenBatches

    path = os.path.join(RECIPES, "..", "data", "sample.txt")
    a, b = (TokenBatches("text", 32, 2, 256, seed=1, path=path) for _ in range(2))
    assert (a.batch(3, 1, 0) == b.batch(3, 1, 0)).all() and not (a.batch(3, 1, 0) == a.batch(3, 1, 1)).all()
    synthetic = TokenBatches("synthetic", 32, 2, 100, seed=1, path=None).batch(1, 0, 0)
    assert synthetic.shape == (2, 33) and int(synthetic.max()) < 100


def test_a_gzipped_text_corpus_gives_the_same_tokens_as_the_plain_file(tmp_path):
    import gzip

    from primus_turbo.integrations.common.data import load_tokens

    text = "def f(x):\n    return x + 1  # é\n" * 50
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    with gzip.open(tmp_path / "c.txt.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    plain, packed = load_tokens(str(tmp_path / "c.txt")), load_tokens(str(tmp_path / "c.txt.gz"))
    assert len(plain) == len(text.encode("utf-8")) and (plain == packed).all()


def test_build_corpus_writes_what_the_loader_reads_for_plain_and_gz_names(tmp_path):
    """scripts/build_corpus.py with a .gz name writes gzip: the loader opens .gz paths with gzip, and a plain
    file under that name stopped two GPU parity runs at start-up."""
    import subprocess
    import sys
    from pathlib import Path

    from primus_turbo.integrations.common.data import load_tokens

    script = Path(__file__).resolve().parents[3] / "scripts/build_corpus.py"
    outs = [tmp_path / "c.txt", tmp_path / "c.txt.gz"]
    for out in outs:
        cmd = [sys.executable, str(script), str(out), "--mb", "0.2"]
        subprocess.run(cmd, check=True, capture_output=True)
    plain, packed = (load_tokens(str(o)) for o in outs)
    assert len(plain) >= 0.2 * 2**20 and (plain == packed).all()
    assert outs[1].stat().st_size < outs[0].stat().st_size


def test_turbo_ep_buffers_are_sized_from_the_config_unless_the_user_set_it(monkeypatch):
    """turbo.dispatch at ep > 1: TURBO's sync-free buffers fit the tokens a rank feeds its MoE layers
    (seq / cp x micro-batch / tp under sequence parallel), the same on every rank; a user's value stays."""
    from primus_turbo.integrations.megatron.turbo_patches import _size_turbo_ep_buffers

    monkeypatch.delenv("PRIMUS_TURBO_EP_MAX_TOKENS", raising=False)
    cfg = _cfg("recipe=deepseek_moe_fp8", "parallel.ep=2", "parallel.cp=2", "data.micro_batch_size=2")
    assert "tokens per rank" in _size_turbo_ep_buffers(cfg)
    assert os.environ["PRIMUS_TURBO_EP_MAX_TOKENS"] == str(cfg.model.seq_length // 2 * 2)
    monkeypatch.setenv("PRIMUS_TURBO_EP_MAX_TOKENS", "777")
    assert _size_turbo_ep_buffers(cfg) == "" and os.environ["PRIMUS_TURBO_EP_MAX_TOKENS"] == "777"
