"""Start-up checks found missing by an audit of the training layer ("one flag, clear errors, nothing
silently falling back"): each case ran on before, or stopped later with an error naming no key. None of these
tests trains."""

import os

import pytest
import torch
from hydra import compose, initialize_config_dir
from primus_turbo.integrations.common.config import ConfigError, validate_config

RECIPES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "recipes"))


def _cfg(*overrides):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    if cfg.data.kind == "text" and cfg.data.path == "data/sample.txt":
        cfg.data.path = os.path.join(RECIPES, "..", "data", "sample.txt")
    return cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("+turbo.atention=false", r"turbo.atention: unknown key \(did you mean turbo.attention\?\); acc"),
        ("+turbo.fp8=true", r"turbo.fp8: unknown key.*accepted: enabled, strict, gemm"),
        ("+fp8.recipes=blockwise", r"fp8.recipes: unknown key \(did you mean fp8.recipe\?\)"),
        ("+parallel.sequence_paralel=true", r"unknown key \(did you mean parallel.sequence_parallel\?\)"),
    ],
)
def test_a_key_added_with_plus_is_not_silently_ignored(override, message):
    """Hydra rejects `turbo.atention=false` but its message says to append with `+turbo.atention=false`, which
    composed and ran with attention on: the key was never read."""
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(override), world_size=2)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.hidden_size=128x", "model.hidden_size='128x': expected an integer >= 1"),  # was a TypeError
        ("model.num_attention_heads=0", "model.num_attention_heads=0: expected an integer >= 1"),  # was / 0
        ("model.moe.topk=abc", "model.moe.topk='abc': expected an integer >= 1"),
        ("model.moe.topk=1.5", r"model.moe.topk=1.5: expected an integer >= 1"),
        ("model.seq_length=0", "model.seq_length=0: expected an integer >= 1"),
        ("data.micro_batch_size=two", "data.micro_batch_size='two': expected an integer >= 1"),
        ("train.lr=3e-4x", r"train.lr='3e-4x': expected >= 0 \(a number\)"),
        ("train.min_lr=abc", r"train.min_lr='abc': expected >= 0 \(a number\)"),
        ("train.weight_decay=abc", r"train.weight_decay='abc': expected >= 0 \(a number\)"),
        ("train.adam_beta2=1.5", r"train.adam_beta2=1.5: expected a number in \[0, 1\)"),
        ("train.seed=abc", "train.seed='abc': expected an integer >= 0"),
        ("train.steps=true", "train.steps=True: expected an integer >= 1"),  # bool is an int in Python
        ("parallel.ep=true", "parallel.ep=True: expected an integer >= 1"),
        ("parallel.sequence_parallel=ture", "parallel.sequence_parallel='ture': expected true or false"),
        ("fp8.enabled=ture", "fp8.enabled='ture': expected true or false"),
        ("train.metrics_file=123", "train.metrics_file=123: expected a path or null"),  # open(123): a fd
        ("model.moe.score_function=softmx", r"model.moe.score_function='softmx': expected one of \('soft"),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key(override, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(override), world_size=2)


def test_mla_rope_type_is_checked():
    cfg = _cfg("recipe=deepseek_moe_bf16", "model.mla.rope_type=ropee")
    with pytest.raises(ConfigError, match=r"model.mla.rope_type='ropee': expected one of \('rope', 'yarn'\)"):
        validate_config(cfg, world_size=1)


def test_torchtitan_rejects_yarn_it_would_not_build():
    """The TorchTitan adapter builds DeepSeek-V3 with original_seq_len = seq_length: RoPE without YaRN."""
    from primus_turbo.integrations.torchtitan.job_config import check_expressible

    overrides = ("recipe=deepseek_moe_bf16", "framework=torchtitan")
    check_expressible(_cfg(*overrides))
    with pytest.raises(ConfigError, match="model.mla.rope_type=yarn: this adapter builds DeepSeek-V3 with"):
        check_expressible(_cfg(*overrides, "model.mla.rope_type=yarn"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("framework=torchtitan", "framework.compile=no"), "framework.compile='no': expected true or false"),
        (("framework.name=titan",), r"framework.name='titan': expected one of \('megatron', 'torchtitan'\)"),
    ],
)
def test_framework_settings_are_checked(overrides, message):
    """framework.compile=no was bool("no") = True: TorchTitan compiled every block."""
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(*overrides), world_size=2)


def test_fp8_with_turbo_off_is_an_error_on_an_fp8_gpu_too(monkeypatch):
    """Megatron-Core without TE has no FP8 path: with turbo.strict=false the turbo.fp8 row fell back and the
    run trained in bf16 under precision=fp8 (TorchTitan's adapter already refused it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    validate_config(_cfg("parallel.ep=1", "precision=fp8"), world_size=1)  # turbo on: fine on this "GPU"
    cfg = _cfg("parallel.ep=1", "precision=fp8", "turbo.enabled=false", "turbo.strict=false")
    with pytest.raises(ConfigError, match="precision=fp8 runs the turbo FP8 ops: it needs turbo.enabled"):
        validate_config(cfg, world_size=1)


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("PRIMUS_TURBO_GEM_BACKEND", "TRITON",
         r"PRIMUS_TURBO_GEM_BACKEND: no such backend pin \(did you mean PRIMUS_TURBO_GEMM_BACKEND\?\)"),
        ("PRIMUS_TURBO_GEMM_BACKEND", "TRITONN", "PRIMUS_TURBO_GEMM_BACKEND: unknown backend 'TRITONN'"),
        ("PRIMUS_TURBO_ATTENTION_BACKEND", "fp8:FLASH,bf17:TORCH",
         "PRIMUS_TURBO_ATTENTION_BACKEND: unknown precision 'bf17'"),
    ],
)  # fmt: skip
def test_a_bad_backend_pin_stops_the_run_at_start_up(monkeypatch, name, value, message):
    """A misspelled variable was ignored (the op picked its own backend); a bad value stopped the run only in
    step 1, after the process groups and the model, with a traceback."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(), world_size=2)


def test_good_backend_pins_pass(monkeypatch):
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "fp8:TRITON,bf16:cublas,other:TORCH")
    monkeypatch.setenv("PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND", "")
    validate_config(_cfg(), world_size=2)


def test_train_py_prints_the_error_and_exits_2(monkeypatch, capsys):
    """hydra_main.run: a ConfigError is one line on stderr and exit code 2, before any process group."""
    from primus_turbo.integrations.hydra_main import run

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("PRIMUS_TURBO_GEMM_BACKEND", "TRITONN")
    with pytest.raises(SystemExit) as stop:
        run(_cfg())
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "train.py: configuration error: environment variable PRIMUS_TURBO_GEMM_BACKEND" in err, err


@pytest.mark.parametrize(
    "ep_enabled, clip", [(False, "the clip factor applied inside"), (True, "TorchTitan's clip")]
)
def test_torchtitan_turbo_optimizer_log_says_where_the_clip_runs(ep_enabled, clip):
    """With EP (tiny_moe's default) the sync-free step clips with TorchTitan's clip_grad_norm_; the start-up
    line said the factor was applied inside the turbo AdamW step."""
    pytest.importorskip("torchtitan")
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from primus_turbo.integrations.torchtitan import sync_free

    class Trainer:
        def __init__(self, job_config):
            params = [torch.nn.Parameter(torch.zeros(2))]
            self.optimizers = SimpleNamespace(optimizers=[torch.optim.AdamW(params)])
            self.parallel_dims = SimpleNamespace(ep_enabled=ep_enabled, pp_enabled=False)

    cfg = OmegaConf.create({"turbo": {"enabled": True, "sync_free_step": True, "optimizer": True}})
    lines = []
    sync_free.trainer_class(cfg, Trainer, lines.append)(None)
    (line,) = [x for x in lines if x.startswith("turbo.optimizer")]
    assert line == f"turbo.optimizer: 1 torch AdamW -> turbo.optim.AdamW (Triton, {clip})"


@pytest.mark.parametrize("overrides", [("turbo.dispatch=false",), ("turbo.enabled=false",)])
def test_flex_dispatcher_needs_turbo_dispatch_without_deep_ep(overrides):
    """Megatron's flex dispatcher without turbo's Buffer stopped at model build with Megatron's DeepEP
    traceback; the config check names the flags (deep_ep is not installed here)."""
    cfg = _cfg("model.moe.dispatcher=flex", *overrides)
    with pytest.raises(ConfigError, match="dispatcher=flex runs on DeepEP"):
        validate_config(cfg, world_size=2)
    validate_config(_cfg("model.moe.dispatcher=flex"), world_size=2)  # turbo dispatch on: fine
