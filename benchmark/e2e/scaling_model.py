"""Step-time projection for DeepSeek-V3-sized MoE training at scale: compute vs expert-parallel all-to-all.

    python benchmark/e2e/scaling_model.py                       # the tables in docs/scaling.md
    python benchmark/e2e/scaling_model.py --achieved-tflops 520 --a2a-intra-gbps 310 --a2a-inter-gbps 42

The model (docs/scaling.md explains each term):
  per MoE layer and micro-batch of T tokens per GPU
    compute  = 3 * F_layer * T / achieved      F_layer: forward model FLOPs per token (metrics.py formulas)
    a2a      = 4 all-to-alls (dispatch, combine; their two backward twins) moving T * topk token rows of h
               elements: rows for an expert on another GPU of the node go over NVLink, rows for another node
               over the NIC; the slower of the two bounds each all-to-all
  stage time per micro-batch = (3 * F_model * T / achieved + moe_layers * (1 - overlap) * a2a) / PP
                               F_model: all layers + LM head (metrics.model_flops_per_token)
  step time = (microbatches + PP - 1) * stage time,  microbatches = global batch / (GPUs / PP)  (1F1B)
``DEFAULTS`` says where each input comes from (target, measured, or assumption).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from omegaconf import OmegaConf

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, REPO)

from primus_turbo.integrations.common.metrics import (  # noqa: E402
    _attention_flops_per_token,
    _mlp_flops_per_token,
    model_flops_per_token,
)

# DeepSeek-V3 (arXiv 2412.19437): 61 layers (3 dense + 58 MoE), h 7168, MLA, 256 experts top-8 + 1 shared.
DEEPSEEK_V3 = OmegaConf.create({
    "num_layers": 61, "hidden_size": 7168, "ffn_hidden_size": 18432, "num_attention_heads": 128,
    "num_query_groups": None, "kv_channels": None, "vocab_size": 129280, "seq_length": 4096,
    "mla": {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
            "v_head_dim": 128},
    "moe": {"num_experts": 256, "topk": 8, "ffn_hidden_size": 2048, "shared_expert_ffn_hidden_size": 2048,
            "first_k_dense": 3},
})  # fmt: skip

DEFAULTS = {
    # TARGET: 45% of the bf16 dense peak, between cuBLAS bf16 (~700) and the grouped GEMM rate (550-670)
    # derated for attention, router, permute and norms. Measured 2026-11-23 (model FLOPs, all ops, 1 H200,
    # `compare.py recipe=deepseek_moe_fp8`): turbo fp8 128, turbo bf16 195 TFLOP/s/GPU (--achieved-tflops).
    "achieved_tflops": 450.0,
    # MEASURED: NCCL all_to_all per-GPU bandwidth inside a node, 2x H200 NVLink ~268 GB/s; an 8-GPU NVSwitch
    # node is assumed to keep that per GPU.
    "a2a_intra_gbps": 268.0,
    # ASSUMPTION: one 400 Gb/s NIC per GPU (HGX + NDR InfiniBand), ~80% of 50 GB/s reached by all_to_all.
    "a2a_inter_gbps": 40.0,
}


@dataclasses.dataclass
class Layout:
    name: str
    gpus: int
    ep: int  # expert parallel size (EP <= GPUs per PP stage)
    pp: int
    global_batch: int  # sequences per step
    gpus_per_node: int = 8
    tokens_per_microbatch: int = 4096  # micro-batch 1 x sequence 4096 per GPU

    @property
    def microbatches(self) -> int:  # per data-parallel rank (TP = 1, DP = GPUs / PP as in V3)
        return self.global_batch // (self.gpus // self.pp)


# Global batch: 1024 GPUs use V3's final 15360 sequences; 64 GPUs keep 240 micro-batches per PP8 stage.
LAYOUTS = [
    Layout("64 GPUs: PP8 x EP8 (EP inside a node)", 64, ep=8, pp=8, global_batch=1920),
    Layout("64 GPUs: PP1 x EP64 (EP over 8 nodes)", 64, ep=64, pp=1, global_batch=1920),
    Layout("1024 GPUs: PP16 x EP64 (EP over 8 nodes; V3's layout)", 1024, ep=64, pp=16, global_batch=15360),
    Layout(
        "1024 GPUs: same, node-limited routing (<= 4 nodes/token)", 1024, ep=64, pp=16, global_batch=15360
    ),
]


def moe_layer_forward_flops(model) -> float:
    return _attention_flops_per_token(model) + _mlp_flops_per_token(model, True)


def a2a_bytes_per_token(hidden: int, fp8_dispatch: bool) -> float:
    """Bytes per routed token row over the 4 all-to-alls of one MoE layer (forward + backward)."""
    dispatch = hidden * (1 + 4 / 128) if fp8_dispatch else 2 * hidden  # FP8 rows + one fp32 scale per 128
    return dispatch + 3 * 2 * hidden  # combine (bf16) and both backward all-to-alls (bf16 gradients)


def a2a_ms_per_moe_layer(
    layout: Layout, model, intra_gbps: float, inter_gbps: float, fp8_dispatch: bool = True,
    max_nodes_per_token: int | None = None,
) -> float:  # fmt: skip
    """The 4 all-to-alls of one MoE layer for one micro-batch; the slower link (NVLink or NIC) bounds each."""
    t, topk = layout.tokens_per_microbatch, model.moe.topk
    in_node = min(layout.ep, layout.gpus_per_node)
    intra_rows = t * topk * (in_node - 1) / layout.ep  # rows to an expert on the same GPU move nothing
    inter_rows = t * topk * (layout.ep - in_node) / layout.ep
    if max_nodes_per_token is not None:  # one copy per destination node, forwarded there over NVLink
        inter_rows = min(inter_rows, t * max_nodes_per_token * (layout.ep - in_node) / layout.ep)
    row_bytes = a2a_bytes_per_token(model.hidden_size, fp8_dispatch)
    return max(intra_rows * row_bytes / intra_gbps, inter_rows * row_bytes / inter_gbps) / 1e6


def project(layout: Layout, model, achieved_tflops: float, intra_gbps: float, inter_gbps: float,
            overlap: float, max_nodes: int | None = None) -> dict:  # fmt: skip
    t = layout.tokens_per_microbatch
    layer_ms = 3 * moe_layer_forward_flops(model) * t / (achieved_tflops * 1e9)
    model_ms = model_flops_per_token(model) * t / (achieved_tflops * 1e9)
    a2a_ms = a2a_ms_per_moe_layer(layout, model, intra_gbps, inter_gbps, max_nodes_per_token=max_nodes)
    exposed_ms = (model.num_layers - model.moe.first_k_dense) * (1 - overlap) * a2a_ms
    stage_ms = (model_ms + exposed_ms) / layout.pp
    step_s = (layout.microbatches + layout.pp - 1) * stage_ms / 1e3
    return {
        "layout": layout.name,
        "layer_ms": layer_ms,
        "a2a_ms": a2a_ms,
        "a2a_share": exposed_ms / (model_ms + exposed_ms),
        "step_s": step_s,
        "tokens_per_s_per_gpu": layout.global_batch * t / layout.gpus / step_s,
        "bubble": (layout.pp - 1) / (layout.microbatches + layout.pp - 1),
    }


def table(args, overlap: float) -> str:
    lines = [
        "| layout | compute / MoE layer (ms) | all-to-all / MoE layer (ms) | exposed all-to-all share | "
        "step (s) | tokens/s/GPU | PP bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        nodes = 4 if "node-limited" in layout.name else None
        r = project(layout, DEEPSEEK_V3, args.achieved_tflops, args.a2a_intra_gbps, args.a2a_inter_gbps,
                    overlap, max_nodes=nodes)  # fmt: skip
        lines.append(
            f"| {r['layout']} | {r['layer_ms']:.1f} | {r['a2a_ms']:.1f} | {100 * r['a2a_share']:.0f}% | "
            f"{r['step_s']:.1f} | {r['tokens_per_s_per_gpu']:.0f} | {100 * r['bubble']:.1f}% |"
        )
    return "\n".join(lines)


def recipe_model(name: str):
    """The model section of recipes/recipe/<name>.yaml over the defaults of recipes/config.yaml."""
    base = OmegaConf.load(os.path.join(REPO, "recipes", "config.yaml")).model
    return OmegaConf.merge(
        base, OmegaConf.load(os.path.join(REPO, "recipes", "recipe", f"{name}.yaml")).model
    )


def two_gpu_check(args) -> str:
    """The model's numbers for the measurable 2x H200 run: deepseek_moe_fp8 with EP=2 (bf16 dispatch)."""
    model = recipe_model("deepseek_moe_fp8")
    layout = Layout("2 GPUs: EP2", 2, ep=2, pp=1, global_batch=8)
    layer_ms = (
        3 * moe_layer_forward_flops(model) * layout.tokens_per_microbatch / (args.achieved_tflops * 1e9)
    )
    a2a_ms = a2a_ms_per_moe_layer(layout, model, args.a2a_intra_gbps, args.a2a_inter_gbps, fp8_dispatch=False)
    return (
        f"2x H200 check (deepseek_moe_fp8 shape, EP=2, 4096 tokens/GPU/micro-batch): compute "
        f"{layer_ms:.2f} ms and all-to-all {a2a_ms:.2f} ms per MoE layer "
        f"({100 * a2a_ms / layer_ms:.0f}% of compute)"
    )


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    for key, value in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=float, default=value)
    parser.add_argument("--overlap", type=float, nargs="*", default=[0.0, 0.5],
                        help="all-to-all fraction hidden under compute (0 = none, 1 = all)")  # fmt: skip
    args = parser.parse_args()
    flops = moe_layer_forward_flops(DEEPSEEK_V3)
    print(f"DeepSeek-V3 MoE layer: {flops / 1e9:.2f} GFLOP/token forward, {3 * flops / 1e9:.2f} training; "
          f"whole model {model_flops_per_token(DEEPSEEK_V3) / 1e9:.0f} GFLOP/token training; achieved "
          f"{args.achieved_tflops:.0f} TFLOP/s/GPU; all-to-all {args.a2a_intra_gbps:.0f} GB/s in a node, "
          f"{args.a2a_inter_gbps:.0f} GB/s across nodes (per GPU)")  # fmt: skip
    print(two_gpu_check(args))
    for overlap in args.overlap:
        print(f"\nall-to-all overlapped with compute: {100 * overlap:.0f}%\n")
        print(table(args, overlap))


if __name__ == "__main__":
    main()
