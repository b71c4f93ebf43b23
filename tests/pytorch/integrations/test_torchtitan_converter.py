"""The "primus_turbo" TorchTitan converter on CPU: what it swaps, that parameter names/shapes are unchanged,
forward/backward numerics vs the stock TorchTitan model, fail-closed rules, and recipe -> TorchTitan errors.

Models are TorchTitan's own (deepseek_v3 MLA+MoE, qwen3 GQA MoE, llama3 dense) at tiny sizes from the
recipes; the reference is the same model unconverted with the same weights (fp32 on CPU, tolerances from
test_utils). The converted model runs the turbo ops' TORCH backends here; GPU kernels are covered by the
op tests and the GPU training runs.
"""

import pytest
import torch
from test_utils import assert_close

pytest.importorskip("torchtitan")
pytest.importorskip("hydra")

from primus_turbo.integrations.common.config import ConfigError  # noqa: E402
from primus_turbo.integrations.common.patch_registry import FALLBACK, PatchError  # noqa: E402
from primus_turbo.integrations.torchtitan import converter as conv  # noqa: E402
from primus_turbo.integrations.torchtitan import turbo_modules as tm  # noqa: E402
from primus_turbo.integrations.torchtitan.job_config import (  # noqa: E402
    build_job_config,
    build_model_args,
    check_expressible,
)
from torchtitan.distributed.expert_parallel import ExpertParallel  # noqa: E402
from torchtitan.models.moe.moe import MoE  # noqa: E402
from torchtitan_models import TINY_DENSE, TINY_GQA_MOE, TINY_MLA, build, cfg_of, options  # noqa: E402


@pytest.fixture(autouse=True)
def _histc_on_cpu(monkeypatch):
    """The stock router calls torch.histc on int64 indices, which has no CPU kernel (see cpu_shims)."""
    from primus_turbo.integrations.torchtitan.cpu_shims import _histc_accepting_integers

    monkeypatch.setattr(torch, "histc", _histc_accepting_integers(torch.histc))


def _shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _fwd_bwd(model, tokens):
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_matches_stock(stock, turbo, cfg, seed):
    """Same batch through both models: logits and every parameter's gradient agree (fp32 tolerances)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=gen)
    ref_logits, ref_grads = _fwd_bwd(stock, tokens)
    out_logits, out_grads = _fwd_bwd(turbo, tokens)
    assert_close(out_logits, ref_logits, msg="logits")
    assert out_grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_close(out_grads[name], grad, msg=name)


@pytest.mark.parametrize(
    "overrides, family, expected",
    [
        (TINY_MLA, "deepseek_v3", {tm.TitanLinear: 15, tm.TitanInnerAttention: 2, tm.TitanRMSNorm: 7,
                                   tm.TurboGroupedExperts: 1, tm.TurboTopKRouter: 1, tm.TurboMLA: 2}),
        (TINY_GQA_MOE, "qwen3", {tm.TitanLinear: 15, tm.TitanInnerAttention: 2, tm.TitanRMSNorm: 5,
                                 tm.TurboGroupedExperts: 2, tm.TurboTopKRouter: 2}),
        (TINY_DENSE, "llama3", {tm.TitanLinear: 15, tm.TitanInnerAttention: 2, tm.TitanRMSNorm: 5}),
    ],
    ids=["deepseek_v3_mla_moe", "qwen3_gqa_moe", "llama3_dense"],
)  # fmt: skip
def test_converter_swaps_modules_keeps_names_and_matches_stock(overrides, family, expected):
    cfg = cfg_of(*overrides)
    built_family, stock = build(cfg)
    assert built_family == family
    _, turbo = build(cfg)
    turbo.load_state_dict(stock.state_dict())
    names_before = _shapes(turbo)
    rows = conv.convert_model(turbo, options(cfg))
    assert _shapes(turbo) == names_before  # checkpoints load either way
    counts = {cls: sum(type(m) is cls for m in turbo.modules()) for cls in expected}
    assert counts == expected
    stock_linears = [n for n, m in turbo.named_modules() if type(m) is torch.nn.Linear]
    assert all(n.endswith("router.gate") for n in stock_linears), stock_linears
    status = {r.name: r.status for r in rows}
    assert status["turbo.gemm"] == "active"
    assert status["turbo.rope"] == ("active" if family == "deepseek_v3" else "n/a")
    _assert_matches_stock(stock, turbo, cfg, seed=1)


def test_mla_rope_flag_off_keeps_the_stock_attention():
    cfg = cfg_of(*TINY_MLA, "turbo.rope=false")
    _, model = build(cfg)
    rows = {r.name: r for r in conv.convert_model(model, options(cfg))}
    assert rows["turbo.rope"].status != "active"
    assert not any(type(m) is tm.TurboMLA for m in model.modules())


def test_turbo_mla_traces_with_fullgraph_like_torchtitans_per_block_compile():
    """TorchTitan compiles each block with fullgraph=True: TurboMLA's two custom ops must trace (fake kernels)
    and give the eager outputs and gradients."""
    cfg = cfg_of(*TINY_MLA)
    _, model = build(cfg)
    conv.convert_model(model, options(cfg))
    attn = model.layers["0"].attention
    assert type(attn) is tm.TurboMLA
    x = torch.randn(2, cfg.model.seq_length, cfg.model.hidden_size, requires_grad=True)

    def run(fn):
        out = fn(x, model.freqs_cis, None)
        return (out, *torch.autograd.grad(out.square().sum(), (x, attn.wkv_a.weight)))

    eager = run(attn)
    compiled = run(torch.compile(attn, fullgraph=True, backend="eager"))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fp8_recipe_swaps_float8_linears_and_fp8_experts_keeping_head_bf16():
    cfg = cfg_of(*TINY_MLA)
    _, model = build(cfg)
    rows = conv.convert_model(model, options(cfg, fp8_recipe="rowwise", fp8_wgrad="fp8"))
    status = {r.name: r.status for r in rows}
    assert status["turbo.fp8"] == "active" and status["turbo.grouped_gemm"] == "active"
    assert type(model.output) is tm.TitanLinear  # LM head stays bf16
    assert sum(type(m) is tm.TitanFloat8Linear for m in model.modules()) == 14
    assert tm.EXPERTS_FP8_CONFIG is not None and tm.EXPERTS_FP8_CONFIG.granularity.name == "ROWWISE"
    assert not tm.EXPERTS_FP8_CONFIG.high_precision_wgrad
    conv.convert_model(torch.nn.Sequential(), options(cfg))  # resets the expert FP8 config
    assert tm.EXPERTS_FP8_CONFIG is None
    _, model = build(cfg)
    rows = conv.convert_model(model, options(cfg, fp8_recipe="rowwise", fp8_wgrad="bf16"))  # fp8.wgrad=bf16
    assert "weight gradients in bf16" in {r.name: r.detail for r in rows}["turbo.fp8"]
    assert tm.EXPERTS_FP8_CONFIG.high_precision_wgrad
    linears = [m for m in model.modules() if type(m) is tm.TitanFloat8Linear]
    assert linears and all(m.config.high_precision_wgrad for m in linears)
    assert tm.EXPERTS_FP8_CONFIG.format.name == "HYBRID"  # fp8.format=auto with rowwise
    _, model = build(cfg)
    rows = conv.convert_model(model, options(cfg, fp8_recipe="rowwise", fp8_format="e4m3"))  # fp8.format=e4m3
    assert "E4M3 ROWWISE" in {r.name: r.detail for r in rows}["turbo.fp8"]
    assert tm.EXPERTS_FP8_CONFIG.format.name == "E4M3"
    assert all(m.config.format.name == "E4M3" for m in model.modules() if type(m) is tm.TitanFloat8Linear)
    _, model = build(cfg)  # fp8.expert_recipe=blockwise: the experts' own recipe, the linears keep rowwise
    rows = conv.convert_model(model, options(cfg, fp8_recipe="rowwise", fp8_expert_recipe="blockwise"))
    assert "experts: FP8 E4M3 BLOCKWISE" in {r.name: r.detail for r in rows}["turbo.fp8"]
    experts = tm.EXPERTS_FP8_CONFIG
    assert experts.granularity.name == "BLOCKWISE" and experts.format.name == "E4M3"
    linears = [m for m in model.modules() if type(m) is tm.TitanFloat8Linear]
    assert linears and all(m.config.granularity.name == "ROWWISE" for m in linears)


def test_fp8_delayed_is_refused_under_strict():
    cfg = cfg_of(*TINY_DENSE)
    _, model = build(cfg)
    with pytest.raises(PatchError, match="fp8.recipe=delayed"):
        conv.convert_model(model, options(cfg, fp8_recipe="delayed"))


def test_strict_stops_on_a_feature_that_cannot_serve_and_non_strict_falls_back():
    cfg = cfg_of(*TINY_GQA_MOE)
    _, model = build(cfg)
    with pytest.raises(PatchError, match=r"turbo\.dispatch cannot serve this run.*turbo\.strict=false"):
        conv.convert_model(model, options(cfg, dispatch=True, ep=2, grouped_gemm=False))
    _, model = build(cfg)
    rows = conv.convert_model(model, options(cfg, dispatch=True, ep=2, grouped_gemm=False, strict=False))
    row = {r.name: r for r in rows}["turbo.dispatch"]
    assert row.status == FALLBACK and "needs turbo.grouped_gemm" in row.detail
    assert not any(type(m) is tm.TurboEPMoE for m in model.modules())


@pytest.mark.parametrize("permute", [True, False])
def test_turbo_dispatch_with_ep_moves_the_token_exchange_into_moe_forward(permute):
    """ep > 1: every MoE becomes TurboEPMoE (moe_dispatch / token_permute / moe_combine, also with
    turbo.permute=false), its experts are marked for ExpertParallel to shard without its all-to-all hooks, the
    report row says so, and parameter names/shapes are unchanged (EP numerics: test_torchtitan_dispatch)."""
    cfg = cfg_of(*TINY_GQA_MOE)
    _, model = build(cfg)
    before = _shapes(model)
    rows = {r.name: r for r in conv.convert_model(model, options(cfg, dispatch=True, ep=2, permute=permute))}
    row = rows["turbo.dispatch"]
    assert row.status == "active", row
    assert row.target == "torchtitan.distributed.expert_parallel.ExpertParallel._apply"
    assert "2 MoE" in row.detail and "moe_dispatch" in row.detail and "moe_combine" in row.detail
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 2 and all(type(m) is tm.TurboEPMoE for m in layers)
    assert all(m.experts.turbo_dispatch and type(m.experts) is tm.TurboGroupedExperts for m in layers)
    assert ExpertParallel._apply is tm._expert_parallel_apply
    assert _shapes(model) == before
    with pytest.raises(RuntimeError, match="no EP group"):  # never a silent rank-local MoE
        layers[0](torch.randn(1, 4, cfg.model.hidden_size))


@pytest.mark.parametrize(
    "ep, tp, reason", [(1, 1, "ep=1"), (2, 2, "tp > 1 with ep > 1")], ids=["ep1", "tp2_ep2"]
)  # fmt: skip
def test_turbo_dispatch_is_not_applicable_without_ep_or_with_tp(ep, tp, reason):
    cfg = cfg_of(*TINY_GQA_MOE)
    _, model = build(cfg)
    row = {r.name: r for r in conv.convert_model(model, options(cfg, dispatch=True, ep=ep, tp=tp))}[
        "turbo.dispatch"
    ]
    assert row.status == "n/a" and reason in row.detail, row
    assert not any(type(m) is tm.TurboEPMoE for m in model.modules())


def test_router_with_semantics_the_fused_kernel_lacks_is_refused_under_strict():
    cfg = cfg_of(*TINY_GQA_MOE)
    _, model = build(cfg)
    for module in model.modules():
        if hasattr(module, "route_norm"):
            module._debug_force_load_balance = True  # round-robin routing, not a top-k of scores
    with pytest.raises(PatchError, match=r"turbo\.router.*moe_force_load_balance"):
        conv.convert_model(model, options(cfg))


def _stock_and_turbo(cfg, attribute, value):
    """Two same-weight builds of ``cfg`` with ``attribute`` set to ``value`` on every module that has it."""
    _, stock = build(cfg)
    _, turbo = build(cfg)
    turbo.load_state_dict(stock.state_dict())
    for model in (stock, turbo):
        for module in model.modules():
            if hasattr(module, attribute):
                setattr(module, attribute, value)
    return stock, turbo


@pytest.mark.parametrize("score_func, route_norm", [("softmax", True), ("sigmoid", False), ("sigmoid", True)])
def test_router_score_function_and_route_norm_match_stock(score_func, route_norm):
    """route_norm maps to fused_topk_routing(norm_topk=...): softmax + route_norm (Qwen3-MoE) and sigmoid
    without it route like the stock router, forward and backward."""
    cfg = cfg_of(*TINY_GQA_MOE)
    stock, turbo = _stock_and_turbo(cfg, "route_norm", route_norm)
    for model in (stock, turbo):
        for module in model.modules():
            if hasattr(module, "route_norm"):
                module.score_func = score_func
    rows = conv.convert_model(turbo, options(cfg))
    assert {r.name: r.status for r in rows}["turbo.router"] == "active"
    _assert_matches_stock(stock, turbo, cfg, seed=2)


@pytest.mark.parametrize("overrides", [TINY_GQA_MOE, TINY_MLA], ids=["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("score_before_experts", [False, True])
def test_turbo_permute_matches_the_stock_moe_forward_and_backward(overrides, score_before_experts):
    """turbo.permute swaps MoE.forward's argsort / gather / zero-filled scatter + bmm for token_permute and
    token_unpermute: same logits and gradients as the stock MoE, with the scores applied after the experts
    (merged in the unpermute) or before them (carried with the permuted rows)."""
    cfg = cfg_of(*overrides)
    stock, turbo = _stock_and_turbo(cfg, "score_before_experts", score_before_experts)
    rows = conv.convert_model(turbo, options(cfg, permute=True))
    assert {r.name: r.status for r in rows}["turbo.permute"] == "active"
    assert sum(type(m) is tm.TurboMoE for m in turbo.modules()) >= 1
    _assert_matches_stock(stock, turbo, cfg, seed=3)


def test_turbo_permute_leaves_the_tp_split_reorder_of_tp_with_ep_to_torchtitan():
    """With tp > 1 and ep > 1 TorchTitan's plan shards the reorderer over TP ranks
    (ReordererSequenceParallel), which TurboMoE.forward would bypass: n/a with the reason, stock MoE stays."""
    cfg = cfg_of(*TINY_GQA_MOE)
    _, model = build(cfg)
    rows = {r.name: r for r in conv.convert_model(model, options(cfg, permute=True, tp=2, ep=2))}
    row = rows["turbo.permute"]
    assert row.status == "n/a" and "splits the token reorder" in row.detail
    assert not any(type(m) is tm.TurboMoE for m in model.modules())


def test_turbo_disabled_converts_nothing():
    cfg = cfg_of(*TINY_DENSE)
    _, model = build(cfg)
    rows = conv.convert_model(model, options(cfg, enabled=False))
    assert all(r.status in ("off", "n/a") for r in rows)
    assert not any(type(m).__module__.endswith("turbo_modules") for m in model.modules())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["recipe=tiny_dense", "parallel.tp=2"], "sequence_parallel=true"),
        (["model.moe.dispatcher=flex"], "dispatcher=flex"),
        (["recipe=deepseek_moe_bf16", "precision=fp8", "turbo.enabled=false"], "torchao"),
        (["model.moe.first_k_dense=1"], "first_k_dense=1"),
        (["parallel.pp=2"], "no pipelining"),
        (["parallel.ep=2", "turbo.dispatch=true", "turbo.grouped_gemm=false"], "conflicting converter flags"),
        (["precision=fp8", "turbo.gemm=false", "turbo.grouped_gemm=false"], "no GEMM would run in FP8"),
    ],
    ids=[
        "tp_without_sp",
        "flex_dispatcher",
        "fp8_stock",
        "qwen3_first_dense",
        "qwen3_pp",
        "flag_conflict",
        "fp8_nothing",
    ],
)
def test_recipes_torchtitan_cannot_express_fail_before_any_work(overrides, message):
    cfg = cfg_of(*overrides)
    with pytest.raises(ConfigError, match=message):
        check_expressible(cfg)
        build_model_args(cfg)


def test_shared_experts_must_be_whole_experts():
    with pytest.raises(ConfigError, match="shared_expert_ffn_hidden_size=96"):
        build_model_args(cfg_of("model.moe.shared_expert_ffn_hidden_size=96"))


@pytest.mark.parametrize(
    "recipe, family", [("deepseek_moe_fp8", "deepseek_v3"), ("deepseek_moe_bf16", "deepseek_v3"),
                       ("llama3_8b_fp8", "llama3"), ("tiny_moe", "qwen3")],
)  # fmt: skip
def test_recipes_translate_to_torchtitan_flavors_and_job_config(recipe, family):
    cfg = cfg_of(f"recipe={recipe}")
    check_expressible(cfg)
    got_family, args = build_model_args(cfg)
    assert got_family == family
    if recipe == "llama3_8b_fp8":
        from torchtitan.models.llama3.model.model import FeedForward

        assert args.n_kv_heads == 8 and args.rope_theta == 500000.0
        with torch.device("meta"):
            ffn = FeedForward(args.dim, 4 * args.dim, args.multiple_of, args.ffn_dim_multiplier)
        assert ffn.w1.out_features == 14336
    if family == "deepseek_v3":
        assert (args.n_dense_layers, args.moe_args.num_shared_experts, args.moe_args.top_k) == (1, 2, 6)
        assert (args.moe_args.num_expert_groups, args.moe_args.num_limited_groups) == (8, 3)
        assert args.qk_nope_head_dim + args.qk_rope_head_dim == 192 and args.v_head_dim == 128
    job = build_job_config(cfg, f"primus_turbo_{family}", recipe)
    assert job.model.converters == ["primus_turbo"]
    assert job.training.seq_len == cfg.model.seq_length and job.training.steps == cfg.train.steps
    assert job.training.global_batch_size == cfg.data.global_batch_size
    assert job.parallelism.expert_parallel_degree == cfg.parallel.ep
    assert job.lr_scheduler.decay_type == "cosine" and job.optimizer.lr == cfg.train.lr
    off = build_job_config(cfg_of(f"recipe={recipe}", "turbo.enabled=false"), "x", recipe)
    assert off.model.converters == []
