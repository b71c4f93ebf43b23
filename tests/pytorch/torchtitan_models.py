"""Tiny TorchTitan models from the recipes for the CPU converter tests: the same model unconverted and
converted, with the same weights (fp32 on CPU)."""

import os

import torch
from hydra import compose, initialize_config_dir
from primus_turbo.integrations.torchtitan import converter as conv
from primus_turbo.integrations.torchtitan.job_config import build_job_config, build_model_args

RECIPES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "recipes"))
TINY_MLA = [
    "recipe=deepseek_moe_bf16", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
    "model.num_attention_heads=2", "model.vocab_size=128", "model.seq_length=32", "model.mla.kv_lora_rank=32",
    "model.mla.qk_head_dim=32", "model.mla.qk_pos_emb_head_dim=16", "model.mla.v_head_dim=32",
    "model.moe.num_experts=8", "model.moe.topk=4", "model.moe.num_groups=4", "model.moe.group_topk=2",
    "model.moe.ffn_hidden_size=32", "model.moe.shared_expert_ffn_hidden_size=64",
]  # fmt: skip
TINY_GQA_MOE = ["recipe=tiny_moe", "model.seq_length=32", "model.vocab_size=128"]
TINY_DENSE = ["recipe=tiny_dense", "model.seq_length=32"]


def cfg_of(*overrides):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        return compose(config_name="config", overrides=["framework=torchtitan", *overrides])


def build(cfg, seed=0):
    import torchtitan.protocols.train_spec as ts

    family, args = build_model_args(cfg)
    args.update_from_config(build_job_config(cfg, family, cfg.recipe_name))
    if getattr(args, "moe_args", None) is not None:
        # built on CPU: the stock experts' grouped_mm path (and its Triton index kernel) needs CUDA tensors;
        # update_from_config keeps it on a machine with an SM90 GPU, so the CPU tests failed there
        args.moe_args.use_grouped_mm = False
    model_cls = ts.get_train_spec(family).model_cls
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return family, model


def options(cfg, **overrides):
    options = conv.options_from_cfg(cfg)
    options.ep = 1  # in-process: no expert-parallel world
    for key, value in overrides.items():
        setattr(options, key, value)
    return options
