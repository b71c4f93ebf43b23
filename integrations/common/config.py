"""Start-up checks on the composed Hydra config: every bad value is reported before any heavy work.

``validate_config`` raises ``ConfigError`` naming the key, the value seen and what is accepted. It runs before
process groups, model build or GPU allocation (Hydra itself rejects unknown recipe / group names).
"""

from __future__ import annotations

import difflib
import math
import os

import torch
from omegaconf import DictConfig, OmegaConf

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "delayed")
FP8_FORMATS = ("auto", "hybrid", "e4m3")  # auto: e4m3 for blockwise (DeepSeek-V3's recipe), else hybrid
FP8_EXPERT_RECIPES = ("same", "tensorwise", "rowwise", "blockwise")  # same: fp8.recipe (delayed: tensorwise)
FP8_WGRAD = ("bf16", "fp8")  # bf16: weight gradients from the high-precision tensors (Float8QuantConfig)
DTYPES = ("auto", "bf16", "fp32")
DATA_KINDS = ("synthetic", "text")
DISPATCHERS = ("alltoall", "flex")
TURBO_FEATURES = ("gemm", "grouped_gemm", "attention", "rmsnorm", "router", "permute", "dispatch", "async_tp",
                  "cross_entropy", "embedding", "rope", "sync_free_step", "optimizer", "mla_qkv")  # fmt: skip
# yes/no settings outside turbo.*: a string such as "no" would be truthy
BOOL_SETTINGS = ("resume", "parallel.sequence_parallel", "train.save_at_end", "train.progress",
                 "train.activation_recompute", "model.untie_embeddings")  # fmt: skip
FRAMEWORKS = ("megatron", "torchtitan")
SCORE_FUNCTIONS = ("softmax", "sigmoid")  # what Megatron's, TorchTitan's and turbo's routers compute
ROPE_TYPES = ("rope", "yarn")
# The keys each section takes. Hydra rejects an unknown key (`turbo.atention=true`) but suggests the `+`
# form, which adds it unread: `+turbo.atention=false` ran with attention on.
SECTION_KEYS = {
    "turbo": ("enabled", "strict", *TURBO_FEATURES),
    "fp8": ("enabled", "recipe", "wgrad", "expert_recipe", "format", "emulate"),
    "parallel": ("tp", "pp", "ep", "cp", "sequence_parallel"),
}
# (integer setting, least value, null accepted); a null section (model.moe, model.mla) is skipped. Checked
# before any arithmetic on them: "abc" or true failed later with a TypeError naming no key
INT_SETTINGS = (
    ("parallel.tp", 1, False), ("parallel.pp", 1, False), ("parallel.ep", 1, False),
    ("parallel.cp", 1, False),
    ("model.num_layers", 1, False), ("model.hidden_size", 1, False), ("model.ffn_hidden_size", 1, False),
    ("model.num_attention_heads", 1, False), ("model.num_query_groups", 1, True),
    ("model.kv_channels", 1, True), ("model.vocab_size", 1, False), ("model.seq_length", 1, False),
    ("model.moe.num_experts", 1, False), ("model.moe.topk", 1, False),
    ("model.moe.ffn_hidden_size", 1, False),
    ("model.moe.shared_expert_ffn_hidden_size", 0, True), ("model.moe.num_groups", 1, True),
    ("model.moe.group_topk", 1, True), ("model.moe.first_k_dense", 0, True),
    ("model.mla.q_lora_rank", 1, True), ("model.mla.kv_lora_rank", 1, False),
    ("model.mla.qk_head_dim", 1, False), ("model.mla.qk_pos_emb_head_dim", 1, False),
    ("model.mla.v_head_dim", 1, False), ("data.micro_batch_size", 1, False),
    ("data.global_batch_size", 1, False), ("train.steps", 1, False), ("train.seed", 0, False),
    ("train.log_interval", 1, False), ("train.warmup_steps", 0, False), ("train.save_interval", 0, False),
)  # fmt: skip
# real-number settings and their least value (tighter bounds are checked where the value is used)
NUMBER_SETTINGS = (
    ("train.lr", 0), ("train.min_lr", 0), ("train.clip_grad", 0), ("train.weight_decay", 0),
    ("train.adam_beta1", 0), ("train.adam_beta2", 0), ("model.norm_eps", 0), ("model.init_std", 0),
    ("model.rotary_base", 0), ("model.moe.aux_loss_coeff", 0),
)  # fmt: skip
PATH_SETTINGS = ("data.path", "train.ckpt_dir", "train.metrics_file", "train.tensorboard_dir")  # or null


def moe_layer_pattern(model_cfg: DictConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one: the first ``moe.first_k_dense`` layers are dense."""
    if model_cfg.moe is None:
        return [0] * model_cfg.num_layers
    first_dense = int(model_cfg.moe.get("first_k_dense", 0) or 0)
    return [0] * first_dense + [1] * (model_cfg.num_layers - first_dense)


class ConfigError(ValueError):
    """A config value that cannot run; the message names the key and the accepted values."""


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_known_keys(cfg: DictConfig) -> None:
    for section, known in SECTION_KEYS.items():
        for key in cfg[section]:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {section}.{close[0]}?)" if close else ""
            _require(key in known, f"{section}.{key}: unknown key{hint}; accepted: {', '.join(known)}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_types(cfg: DictConfig) -> None:
    """Every number and path setting has the type its checks and the trainers compute with."""
    for key, least, nullable in INT_SETTINGS:
        section = key.rsplit(".", 1)[0]
        if OmegaConf.select(cfg, section) is None:  # model.moe / model.mla: null for dense / non-MLA models
            continue
        value = OmegaConf.select(cfg, key)
        if value is None and nullable:
            continue
        _require(_is_int(value) and value >= least, f"{key}={value!r}: expected an integer >= {least}")
    for key, least in NUMBER_SETTINGS:
        if OmegaConf.select(cfg, key.rsplit(".", 1)[0]) is None:
            continue
        value = OmegaConf.select(cfg, key)
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value >= least,
            f"{key}={value!r}: expected >= {least} (a number)",
        )  # fmt: skip
    for key in ("train.adam_beta1", "train.adam_beta2"):
        value = OmegaConf.select(cfg, key)
        _require(value < 1, f"{key}={value!r}: expected a number in [0, 1)")
    for key in BOOL_SETTINGS:
        value = OmegaConf.select(cfg, key, default=False)
        _require(isinstance(value, bool), f"{key}={value!r}: expected true or false")
    for key in PATH_SETTINGS:
        value = OmegaConf.select(cfg, key)
        _require(value is None or isinstance(value, str), f"{key}={value!r}: expected a path or null")


def _check_backend_env(environ) -> None:
    """PRIMUS_TURBO_<OP>_BACKEND pins: a misspelled name would be ignored (the op picks its own backend) and a
    bad value would stop the run only in step 1, after the model is built."""
    pins = sorted(k for k in environ if k.startswith("PRIMUS_TURBO_") and k.endswith("_BACKEND"))
    if not pins:
        return
    from primus_turbo.pytorch.core.backend import _OP_ENV, parse_backend_spec

    known = tuple(_OP_ENV.values())
    for name in pins:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        _require(name in known, f"environment variable {name}: no such backend pin{hint}; accepted: "
                                f"{', '.join(known)}")  # fmt: skip
        try:
            parse_backend_spec(environ[name], source=f"environment variable {name}")
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _check_parallel(cfg: DictConfig, world: int) -> int:
    p = cfg.parallel
    model_parallel = p.tp * p.pp * p.cp
    _require(
        world % model_parallel == 0,
        f"parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel} does not divide world size {world}",
    )
    expert_parallel = p.tp * p.ep * p.pp
    _require(
        world % expert_parallel == 0,
        f"parallel.tp*ep*pp = {p.tp}*{p.ep}*{p.pp} = {expert_parallel} does not divide world size {world}",
    )
    _require(
        not p.sequence_parallel or p.tp > 1,
        "parallel.sequence_parallel=true needs parallel.tp > 1",
    )
    return world // model_parallel


def _check_model(cfg: DictConfig) -> None:
    m, p = cfg.model, cfg.parallel
    if m.mla is not None:
        rope = m.mla.get("rope_type", "rope")
        _require(rope in ROPE_TYPES, f"model.mla.rope_type={rope!r}: expected one of {ROPE_TYPES}")
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    _require(m.num_layers % p.pp == 0, f"model.num_layers={m.num_layers} not divisible by parallel.pp={p.pp}")
    _require(heads % p.tp == 0, f"model.num_attention_heads={heads} not divisible by parallel.tp={p.tp}")
    _require(groups % p.tp == 0, f"model.num_query_groups={groups} not divisible by parallel.tp={p.tp}")
    _require(
        heads % groups == 0, f"model.num_attention_heads={heads} not a multiple of num_query_groups={groups}"
    )
    if m.kv_channels is None and m.mla is None:
        _require(
            m.hidden_size % heads == 0,
            f"model.hidden_size={m.hidden_size} not divisible by num_attention_heads={heads}",
        )
    _require(m.ffn_hidden_size % p.tp == 0, f"model.ffn_hidden_size={m.ffn_hidden_size} % tp={p.tp} != 0")
    if p.sequence_parallel:
        _require(m.seq_length % p.tp == 0, f"model.seq_length={m.seq_length} % tp={p.tp} != 0")
    if m.moe is None:
        _require(p.ep == 1, f"parallel.ep={p.ep} needs an MoE model (model.moe is null): use parallel.ep=1")
        return
    moe = m.moe
    _require(moe.num_experts % p.ep == 0, f"model.moe.num_experts={moe.num_experts} % ep={p.ep} != 0")
    _require(1 <= moe.topk <= moe.num_experts, f"model.moe.topk={moe.topk}: expected 1..{moe.num_experts}")
    _require(
        moe.get("dispatcher", "alltoall") in DISPATCHERS,
        f"model.moe.dispatcher={moe.get('dispatcher')!r}: expected one of {DISPATCHERS}",
    )
    score = moe.get("score_function", "softmax")
    _require(
        score in SCORE_FUNCTIONS, f"model.moe.score_function={score!r}: expected one of {SCORE_FUNCTIONS}"
    )
    if moe.get("num_groups"):
        _require(
            moe.num_experts % moe.num_groups == 0,
            f"model.moe.num_groups={moe.num_groups} does not divide num_experts={moe.num_experts}",
        )
        _require(
            moe.group_topk and moe.group_topk <= moe.num_groups and moe.topk % moe.group_topk == 0,
            f"model.moe.group_topk={moe.group_topk}: expected 1..{moe.num_groups} dividing topk={moe.topk}",
        )
    first_dense = moe.get("first_k_dense", 0) or 0
    _require(
        0 <= first_dense < m.num_layers,
        f"model.moe.first_k_dense={first_dense}: expected 0..num_layers-1={m.num_layers - 1}",
    )


def _check_precision(cfg: DictConfig) -> None:
    _require(cfg.train.dtype in DTYPES, f"train.dtype={cfg.train.dtype!r}: expected one of {DTYPES}")
    _require(cfg.fp8.recipe in FP8_RECIPES, f"fp8.recipe={cfg.fp8.recipe!r}: expected one of {FP8_RECIPES}")
    emulate = cfg.fp8.get("emulate", False)
    _require(isinstance(emulate, bool), f"fp8.emulate={emulate!r}: expected true or false")
    wgrad = cfg.fp8.get("wgrad", "bf16")
    _require(wgrad in FP8_WGRAD, f"fp8.wgrad={wgrad!r}: expected one of {FP8_WGRAD}")
    fmt = cfg.fp8.get("format", "auto")
    _require(fmt in FP8_FORMATS, f"fp8.format={fmt!r}: expected one of {FP8_FORMATS}")
    experts = cfg.fp8.get("expert_recipe", "same")
    _require(
        experts in FP8_EXPERT_RECIPES, f"fp8.expert_recipe={experts!r}: expected one of {FP8_EXPERT_RECIPES}"
    )
    _require(isinstance(cfg.fp8.enabled, bool), f"fp8.enabled={cfg.fp8.enabled!r}: expected true or false")
    if not cfg.fp8.enabled:
        return
    # Megatron-Core without TE and TorchTitan without torchao have no FP8 path of their own: with turbo off,
    # turbo.strict=false would have trained in bf16 under precision=fp8 (and its FP8 MFU)
    _require(
        cfg.turbo.enabled is True,
        "precision=fp8 runs the turbo FP8 ops: it needs turbo.enabled=true (the stock frameworks here have "
        "no FP8 path); use precision=bf16 for the stock baseline",
    )
    if not torch.cuda.is_available():
        _require(
            emulate,
            "precision=fp8 needs an FP8-capable GPU (sm_89+: H100/H200/L40/RTX 40xx); this machine has no "
            "CUDA device: use precision=bf16, or fp8.emulate=true for FP8 numerics on the CPU (slow)",
        )
        return
    _require(
        not emulate,
        "fp8.emulate=true is for CPU-only machines (FP8 numerics through the TORCH reference backends); "
        "this machine has a GPU: drop it to run the FP8 kernels",
    )
    major, minor = torch.cuda.get_device_capability()
    _require(
        (major, minor) >= (8, 9),
        f"precision=fp8 needs sm_89+; {torch.cuda.get_device_name()} is sm_{major}{minor}: use bf16",
    )
    _require(
        cfg.train.dtype != "fp32", "precision=fp8 runs bf16 outside the GEMMs: set train.dtype=auto|bf16"
    )


def _check_data_and_schedule(cfg: DictConfig, dp: int) -> None:
    d, t = cfg.data, cfg.train
    _require(d.kind in DATA_KINDS, f"data.kind={d.kind!r}: expected one of {DATA_KINDS}")
    if d.kind == "text":
        _require(os.path.isfile(d.path), f"data.path={d.path!r} does not exist (data.kind=text)")
    _require(d.micro_batch_size >= 1, f"data.micro_batch_size={d.micro_batch_size}: expected >= 1")
    _require(
        d.global_batch_size % (d.micro_batch_size * dp) == 0,
        f"data.global_batch_size={d.global_batch_size} is not a multiple of micro_batch_size*dp = "
        f"{d.micro_batch_size}*{dp}",
    )
    _require(isinstance(t.steps, int) and t.steps >= 1, f"train.steps={t.steps!r}: expected an integer >= 1")
    _require(t.lr > 0 and 0 <= t.min_lr <= t.lr, f"train.lr={t.lr}, min_lr={t.min_lr}: need 0<=min_lr<=lr")
    _require(not cfg.resume or t.ckpt_dir, "resume=true needs train.ckpt_dir")
    _require(t.clip_grad >= 0, f"train.clip_grad={t.clip_grad!r}: expected >= 0 (0 = no clipping)")
    threads = t.get("autograd_threads", False)
    _require(isinstance(threads, bool), f"train.autograd_threads={threads!r}: expected true or false")
    gc_interval = t.get("gc_interval", 0)
    _require(
        isinstance(gc_interval, int) and not isinstance(gc_interval, bool) and gc_interval >= 0,
        f"train.gc_interval={gc_interval!r}: expected an integer >= 0 (0 = Python's automatic collection)",
    )


def _check_framework(cfg: DictConfig) -> None:
    name = cfg.framework.get("name")
    _require(name in FRAMEWORKS, f"framework.name={name!r}: expected one of {FRAMEWORKS}")
    compile_ = cfg.framework.get("compile", False)  # a string such as "no" would be truthy
    _require(isinstance(compile_, bool), f"framework.compile={compile_!r}: expected true or false")


def _check_turbo(cfg: DictConfig) -> None:
    _require(
        cfg.framework.name != "megatron"  # TorchTitan's TP plans shard the norms (SequenceParallel)
        or not cfg.parallel.sequence_parallel
        or (cfg.turbo.enabled and cfg.turbo.rmsnorm),
        "parallel.sequence_parallel=true needs turbo.enabled=true and turbo.rmsnorm=true: stock "
        "Megatron-Core without apex/TE has no sequence-parallel norm",
    )
    moe = cfg.model.get("moe")
    if cfg.framework.name == "megatron" and moe is not None and moe.get("dispatcher", "alltoall") == "flex":
        import importlib.util

        _require(  # else Megatron's "DeepEP is not installed" traceback at model build
            (cfg.turbo.enabled and cfg.turbo.dispatch) or importlib.util.find_spec("deep_ep") is not None,
            "model.moe.dispatcher=flex runs on DeepEP: turbo.enabled=true and turbo.dispatch=true provide "
            "turbo's DeepEP-compatible Buffer (deep_ep is not installed); or model.moe.dispatcher=alltoall",
        )
    _check_context_parallel(cfg)


def _check_context_parallel(cfg: DictConfig) -> None:
    cp = cfg.parallel.cp
    if cp == 1:
        return
    framework = cfg.framework.name
    _require(
        framework == "megatron",
        f"parallel.cp={cp}: context parallelism is wired for framework=megatron only (got {framework})",
    )
    _require(
        cfg.turbo.enabled and cfg.turbo.attention,
        f"parallel.cp={cp} needs turbo.enabled=true and turbo.attention=true: stock Megatron-Core core "
        "attention without Transformer Engine has no context parallelism",
    )
    seq = cfg.model.seq_length
    _require(
        seq % (2 * cp) == 0,
        f"model.seq_length={seq} must be divisible by 2*parallel.cp={2 * cp} (zigzag split of the sequence)",
    )


def validate_config(cfg: DictConfig, world_size: int | None = None) -> None:
    """Raise ConfigError for the first value that cannot run on ``world_size`` ranks ($WORLD_SIZE)."""
    world = world_size_from_env() if world_size is None else world_size
    _require(cfg.get("recipe_name") not in (None, "???"), "no recipe selected: pass recipe=<name>")
    _check_known_keys(cfg)
    _check_types(cfg)
    _check_framework(cfg)
    for key in ("enabled", "strict", *TURBO_FEATURES):  # before the checks that read them
        _require(isinstance(cfg.turbo[key], bool), f"turbo.{key}={cfg.turbo[key]!r}: expected true or false")
    _check_backend_env(os.environ)
    dp = _check_parallel(cfg, world)
    _check_model(cfg)
    _check_precision(cfg)
    _check_data_and_schedule(cfg, dp)
    _check_turbo(cfg)


def fp8_expert_recipe(fp8_cfg) -> str:
    """The scaling recipe of the experts' grouped GEMMs: ``fp8.expert_recipe``, or for ``same`` the linears'
    ``fp8.recipe`` (``delayed`` runs the experts with current tensorwise scaling: grouped FP8 has no amax
    history)."""
    experts = fp8_cfg.get("expert_recipe", "same")
    if experts not in FP8_EXPERT_RECIPES:
        raise ValueError(f"fp8.expert_recipe={experts!r}: expected one of {FP8_EXPERT_RECIPES}")
    if experts != "same":
        return experts
    return "tensorwise" if fp8_cfg.recipe == "delayed" else fp8_cfg.recipe


def fp8_current_config(recipe: str, fmt: str = "auto", high_precision_wgrad: bool = True):
    """The current-scaling ``Float8QuantConfig`` of an FP8 recipe name (tensorwise | rowwise | blockwise) with
    ``fp8.format`` ``fmt`` (see ``fp8_format_name``): what both frameworks' turbo linears and experts run."""
    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig, Format, ScalingGranularity

    if recipe not in ("tensorwise", "rowwise", "blockwise"):
        raise ValueError(f"fp8 recipe {recipe!r}: current scaling takes tensorwise, rowwise or blockwise")
    return Float8QuantConfig(
        format=Format[fp8_format_name(recipe, fmt)],
        granularity=ScalingGranularity[recipe.upper()],
        high_precision_wgrad=high_precision_wgrad,
    )


def fp8_format_name(recipe: str, fmt: str = "auto") -> str:
    """The ``primus_turbo`` ``Format`` member an FP8 recipe runs: ``fp8.format`` (hybrid: E4M3 forward
    operands, E5M2 gradients; e4m3: E4M3 everywhere), or for ``auto`` E4M3 with blockwise scaling and
    HYBRID otherwise."""
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8.format={fmt!r}: expected one of {FP8_FORMATS}")
    if fmt == "auto":
        return "E4M3" if recipe == "blockwise" else "HYBRID"
    return fmt.upper()
