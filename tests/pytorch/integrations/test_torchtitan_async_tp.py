"""turbo.async_tp on TorchTitan: TP=2 models parallelised by TorchTitan's own parallelize function, with and
without the fused all-gather / reduce-scatter GEMMs, give the same logits and the same gradient for every
parameter (names and DTensor placements unchanged), and the fused path really ran (one fused gather per
attention / dense feed-forward call).

Models: llama3 (GQA, dense), qwen3 (GQA, MoE: its MoE layers keep TorchTitan's TP), deepseek_v3 MLA with q
projected directly (wq column-parallel + wkv_a replicated) and through q_lora (wq_a + wkv_a, both replicated:
the gradient path that is whole on every rank). CPU: 2 gloo ranks, fp32. 2 GPUs (multigpu): NCCL, bf16.
"""

import pytest
import torch
from dist_utils import run_distributed
from test_utils import assert_close
from torch.distributed.tensor import Partial, Replicate

pytest.importorskip("torchtitan")
pytest.importorskip("hydra")

from torchtitan_models import TINY_DENSE, TINY_GQA_MOE, TINY_MLA, build, cfg_of, options  # noqa: E402

MODELS = {
    "llama3_dense": TINY_DENSE,
    "qwen3_gqa_moe": TINY_GQA_MOE,
    "deepseek_mla": TINY_MLA,
    "deepseek_mla_q_lora": [*TINY_MLA, "model.mla.q_lora_rank=48"],
}
TP = ["parallel.tp=2", "parallel.ep=1", "parallel.sequence_parallel=true"]


def _parallel_model(cfg, device, dtype, async_tp: bool):
    import torchtitan.protocols.train_spec as ts
    from primus_turbo.integrations.torchtitan import converter as conv
    from primus_turbo.integrations.torchtitan.cpu_shims import apply_cpu_shims
    from primus_turbo.integrations.torchtitan.job_config import build_job_config
    from torchtitan.distributed import ParallelDims

    if device.type == "cpu":
        apply_cpu_shims()  # TorchTitan's device mesh on "cpu", torch.histc on integers
    family, model = build(cfg)
    model.to(device=device, dtype=dtype)
    rows = {r.name: r for r in conv.convert_model(model, options(cfg, tp=2, async_tp=async_tp))}
    assert rows["turbo.async_tp"].status == ("active" if async_tp else "off"), rows["turbo.async_tp"]
    job = build_job_config(cfg, family, cfg.recipe_name)
    job.parallelism.disable_loss_parallel = True
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, etp=1, world_size=2)
    ts.get_train_spec(family).parallelize_fn(model, dims, job)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _fwd_bwd(model, tokens):
    logits = _full(model(tokens))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    grads = {n: (_full(p.grad).float(), p.grad.placements) for n, p in model.named_parameters()}
    return logits.detach().float(), grads


def _body(rank, world, device, overrides, dtype):
    from primus_turbo.integrations.torchtitan import async_tp

    cfg = cfg_of(*overrides, *TP)
    stock = _parallel_model(cfg, device, dtype, async_tp=False)
    turbo = _parallel_model(cfg, device, dtype, async_tp=True)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=gen).to(device)
    calls = []
    apply = async_tp._GatherMatmulsFn.apply
    async_tp._GatherMatmulsFn.apply = lambda *a: calls.append(a[2]) or apply(*a)
    try:
        ref_logits, ref_grads = _fwd_bwd(stock, tokens)
        assert not calls  # the stock model has no fused hooks
        out_logits, out_grads = _fwd_bwd(turbo, tokens)
    finally:
        async_tp._GatherMatmulsFn.apply = apply
    fused = [m for m in turbo.modules() if hasattr(m, async_tp._ATTR)]
    assert fused and len(calls) == len(fused), (len(calls), len(fused))
    if "deepseek" in overrides[0]:
        assert any(any(replicated) for replicated in calls)  # wkv_a / wq_a: the whole-gradient path ran
    assert_close(out_logits, ref_logits, dtype, msg="logits")
    assert out_grads.keys() == ref_grads.keys()
    for name, (grad, placements) in ref_grads.items():
        # stock DTensor leaves the replicated wkv_a / wq_a gradients Partial (reduced when read); the fused
        # backward returns them whole (its output gradients arrive all-reduced)
        expected = (
            (Replicate(),)
            if placements == (Partial(),) and name.endswith(("wkv_a.weight", "wq_a.weight"))
            else placements
        )
        assert out_grads[name][1] == expected, (name, out_grads[name][1], placements)
        assert_close(out_grads[name][0], grad, dtype, msg=name)


@pytest.mark.parametrize("model", MODELS)
def test_async_tp_matches_torchtitans_tp_on_cpu(model):
    run_distributed(_body, world_size=2, backend="gloo", args=(MODELS[model], torch.float32), timeout_s=240)


@pytest.mark.multigpu
@pytest.mark.parametrize("model", MODELS)
def test_async_tp_matches_torchtitans_tp_on_two_gpus(model):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run_distributed(_body, world_size=2, backend="nccl", args=(MODELS[model], torch.bfloat16), timeout_s=240)


def test_async_tp_is_refused_under_compile():
    from primus_turbo.integrations.common.patch_registry import PatchError
    from primus_turbo.integrations.torchtitan import converter as conv

    cfg = cfg_of(*TINY_DENSE, *TP)
    _, model = build(cfg)
    with pytest.raises(PatchError, match="framework.compile=true"):
        conv.convert_model(model, options(cfg, tp=2, async_tp=True, compile=True))


def test_modules_with_a_biased_linear_keep_torchtitans_plan():
    from primus_turbo.integrations.torchtitan import async_tp

    cfg = cfg_of(*TINY_DENSE, *TP)
    _, model = build(cfg)
    attention = model.layers["0"].attention
    assert async_tp.plan_for("attention", attention) == (("wq", "wk", "wv"), "wo")
    attention.wq.bias = torch.nn.Parameter(torch.zeros(attention.wq.out_features))
    assert async_tp.plan_for("attention", attention) is None
    marked = async_tp.mark_blocks(model)
    assert "layers.0.attention" not in marked and "layers.0.feed_forward" in marked
    assert "layers.1.attention" in marked
