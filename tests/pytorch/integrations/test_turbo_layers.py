"""Turbo leaf modules against the stock Megatron-Core modules they replace (fp32, CPU, one gloo rank).

The stock module is the reference here: a turbo module must be a drop-in (same constructor, parameter
names, outputs and gradients within fp32 tolerance). The grouped experts' weight cache and main_grad fusion:
test_turbo_layers_experts.py.
"""

import pytest
import torch
from megatron_utils import transformer_config as _config
from test_utils import assert_close

megatron = pytest.importorskip("megatron.core")


def _forward_backward(module, *inputs):
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = module(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out).to(out.dtype))
    return out.detach(), [x.grad for x in inputs]


@pytest.mark.parametrize("kind", ["column", "row"])
def test_parallel_linear_matches_stock(megatron_world, kind):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from primus_turbo.integrations.megatron.turbo_layers import (
        TurboColumnParallelLinear,
        TurboRowParallelLinear,
    )

    config = _config()
    stock_cls, turbo_cls = {
        "column": (ColumnParallelLinear, TurboColumnParallelLinear),
        "row": (RowParallelLinear, TurboRowParallelLinear),
    }[kind]
    extra = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
    init = torch.nn.init.normal_
    stock = stock_cls(64, 96, config=config, init_method=init, bias=False, skip_bias_add=False, **extra)
    turbo = turbo_cls(64, 96, config=config, init_method=init, bias=False, skip_bias_add=False, **extra)
    assert set(turbo.state_dict()) == set(stock.state_dict())
    turbo.load_state_dict(stock.state_dict())
    x = torch.randn(7, 3, 64)
    out_s, (dx_s,) = _forward_backward(stock, x)
    out_t, (dx_t,) = _forward_backward(turbo, x)
    assert_close(out_t, out_s, msg="linear out")
    assert_close(dx_t, dx_s, msg="linear dgrad")
    assert_close(turbo.weight.grad, stock.weight.grad, msg="linear wgrad")


def test_rmsnorm_matches_stock(megatron_world):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from primus_turbo.integrations.megatron.turbo_layers import TurboRMSNorm

    config = _config(normalization="RMSNorm")
    stock = WrappedTorchNorm(config=config, hidden_size=64, eps=1e-5)
    turbo = TurboRMSNorm(config=config, hidden_size=64, eps=1e-5)
    assert set(turbo.state_dict()) == set(stock.state_dict()) == {"weight"}
    with torch.no_grad():
        stock.weight.uniform_(0.5, 1.5)
    turbo.load_state_dict(stock.state_dict())
    x = torch.randn(5, 2, 64)
    out_s, (dx_s,) = _forward_backward(stock, x)
    out_t, (dx_t,) = _forward_backward(turbo, x)
    assert_close(out_t, out_s, msg="rmsnorm out")
    assert_close(dx_t, dx_s, msg="rmsnorm dx")
    assert_close(turbo.weight.grad, stock.weight.grad, msg="rmsnorm dweight")


def _reference_causal_attention(q, k, v, scale):
    """fp64 causal attention on Megatron layouts: q [s, b, hq, d], k/v [s, b, hk, d|dv] -> [s, b, hq*dv]."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v  # [b, h, s, dv]
    return out.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], -1)


@pytest.mark.parametrize("heads, groups, d_qk, d_v", [(4, 4, 16, 16), (4, 2, 16, 16), (4, 4, 24, 16)])
def test_core_attention_matches_reference(megatron_world, heads, groups, d_qk, d_v):
    from megatron.core.transformer.enums import AttnMaskType
    from primus_turbo.integrations.megatron.turbo_layers import TurboCoreAttention

    config = _config(num_attention_heads=heads, num_query_groups=groups, kv_channels=d_qk)
    attention = TurboCoreAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (
        torch.randn(12, 2, heads, d_qk),
        torch.randn(12, 2, groups, d_qk),
        torch.randn(12, 2, groups, d_v),
    )
    out, grads = _forward_backward(lambda *t: attention(*t, None), q, k, v)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _reference_causal_attention(qr, kr, vr, d_qk**-0.5)
    ref.backward(torch.linspace(-1, 1, ref.numel()).view_as(ref).double())
    assert out.shape == (12, 2, heads * d_v)
    assert_close(out, ref.float(), torch.float32, msg="attention out")
    for got, want, name in zip(grads, (qr.grad, kr.grad, vr.grad), "qkv"):
        assert_close(got, want.float(), torch.float32, msg=f"attention d{name}")


@pytest.mark.parametrize("heads, groups, d_qk, d_v", [(4, 4, 24, 16), (4, 2, 24, 16), (2, 2, 16, 16)])
def test_stock_mla_attention_matches_reference(megatron_world, heads, groups, d_qk, d_v):
    """fix.mla_core_attention's MLADotProductAttention (torch SDPA): k_channels != v_channels, GQA, causal."""
    from megatron.core.transformer.enums import AttnMaskType
    from primus_turbo.integrations.megatron.stock_attention import MLADotProductAttention

    config = _config(num_attention_heads=heads, num_query_groups=groups)  # kv_channels 64/heads: unused
    scale = 0.7 * d_qk**-0.5  # MLA passes its own (mscale) softmax_scale
    attention = MLADotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale,
                                       k_channels=d_qk, v_channels=d_v)  # fmt: skip
    q, k, v = (
        torch.randn(12, 2, heads, d_qk),
        torch.randn(12, 2, groups, d_qk),
        torch.randn(12, 2, groups, d_v),
    )
    out, grads = _forward_backward(
        lambda *t: attention(*t, None, attn_mask_type=AttnMaskType.causal), q, k, v
    )
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _reference_causal_attention(qr, kr, vr, scale)
    ref.backward(torch.linspace(-1, 1, ref.numel()).view_as(ref).double())
    assert out.shape == (12, 2, heads * d_v)
    assert_close(out, ref.float(), torch.float32, msg="stock MLA attention out")
    for got, want, name in zip(grads, (qr.grad, kr.grad, vr.grad), "qkv"):
        assert_close(got, want.float(), torch.float32, msg=f"stock MLA attention d{name}")
    # An explicit Megatron mask (bool, True = masked out) gives the same causal result.
    causal_mask = torch.ones(12, 12, dtype=torch.bool).triu(1).view(1, 1, 12, 12)
    assert_close(attention(q, k, v, causal_mask), out, torch.float32, msg="explicit mask")


def test_stock_mla_attention_matches_megatron_when_head_dims_agree(megatron_world):
    """With k_channels == v_channels == kv_channels it is a drop-in for Megatron's own DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from primus_turbo.integrations.megatron.stock_attention import MLADotProductAttention

    config = _config(num_attention_heads=4, num_query_groups=2)
    stock = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    sdpa = MLADotProductAttention(config, 1, AttnMaskType.causal, "self", k_channels=16, v_channels=16)
    q, k, v = torch.randn(10, 2, 4, 16), torch.randn(10, 2, 2, 16), torch.randn(10, 2, 2, 16)
    out_s, grads_s = _forward_backward(lambda *t: stock(*t, None), q, k, v)
    out_t, grads_t = _forward_backward(lambda *t: sdpa(*t, None), q, k, v)
    assert_close(out_t, out_s, torch.float32, msg="vs DotProductAttention out")
    for got, want, name in zip(grads_t, grads_s, "qkv"):
        assert_close(got, want, torch.float32, msg=f"vs DotProductAttention d{name}")


@pytest.mark.parametrize("enabled, attention, expected", [(False, True, "active"), (True, False, "active"),
                                                         (True, True, "n/a")])  # fmt: skip
def test_mla_core_attention_fix_applies_only_with_the_stock_attention(enabled, attention, expected):
    from omegaconf import OmegaConf
    from primus_turbo.integrations.megatron.patches import REGISTRY, MegatronPatchContext
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider
    from primus_turbo.integrations.megatron.stock_attention import MLADotProductAttention

    mla = {"qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128}
    cfg = OmegaConf.create({"model": {"moe": None, "mla": mla},
                            "turbo": {"enabled": enabled, "attention": attention}})  # fmt: skip
    spec = TurboSpecProvider(cfg)
    ctx = MegatronPatchContext(cfg=cfg, spec=spec)
    (patch,) = [p for p in REGISTRY.patches if p.name == "fix.mla_core_attention"]
    assert patch.feature is None and "0.16.1" in patch.tested_versions
    reason = patch.condition(ctx)
    assert ("active" if reason is None else "n/a") == expected, reason
    if reason is None:
        assert "qk 192 / v 128" in patch.apply(ctx)
        assert spec.core_attention() is MLADotProductAttention
        spec.attention = True  # a turbo attention always wins over the stock replacement
        assert spec.core_attention() is not MLADotProductAttention
    cfg.model.mla = None
    assert patch.condition(ctx) == "no MLA"


@pytest.mark.gpu
def test_stock_mla_attention_runs_memory_efficient_sdpa_at_deepseek_shape(monkeypatch):
    """On GPU, MLA's 192/128 head dims must run SDPA's memory-efficient kernel (flash refuses d_qk != d_v; a
    silent math fallback would materialize s x s scores): pin that backend alone and check bf16 accuracy."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from primus_turbo.integrations.megatron import stock_attention
    from test_utils import SNR_ATTENTION_BF16_DB, assert_snr
    from torch.nn.attention import SDPBackend

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(stock_attention, "_SDPA_BACKENDS", [SDPBackend.EFFICIENT_ATTENTION])
    config = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=16, bf16=True,
                               params_dtype=torch.bfloat16, attention_dropout=0.0, hidden_dropout=0.0,
                               masked_softmax_fusion=False)  # fmt: skip
    single_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    attention = stock_attention.MLADotProductAttention(
        config, 1, AttnMaskType.causal, "self", softmax_scale=192**-0.5, k_channels=192, v_channels=128,
        pg_collection=single_rank,
    )  # fmt: skip
    torch.manual_seed(0)
    s, b, h = 4096, 1, 16
    q, k, v = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16) for d in (192, 192, 128))
    out, grads = _forward_backward(lambda *t: attention(*t, None), q, k, v)
    qr, kr, vr = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref = _reference_causal_attention(qr, kr, vr, 192**-0.5)
    ref.backward(torch.linspace(-1, 1, ref.numel(), device="cuda").view_as(ref).bfloat16().double())
    assert out.shape == (s, b, h * 128)
    assert_snr(out, ref, SNR_ATTENTION_BF16_DB, "stock MLA attention out")
    for got, want, name in zip(grads, (qr.grad, kr.grad, vr.grad), "qkv"):
        assert_snr(got, want, SNR_ATTENTION_BF16_DB, f"stock MLA attention d{name}")


def test_grouped_linear_matches_per_expert_matmul(megatron_world):
    from primus_turbo.integrations.megatron.turbo_layers import TurboColumnParallelGroupedLinear

    config = _config()
    layer = TurboColumnParallelGroupedLinear(3, 64, 32, config=config, init_method=torch.nn.init.normal_,
                                             bias=False, skip_bias_add=False, is_expert=True)  # fmt: skip
    assert sorted(layer.state_dict()) == ["weight0", "weight1", "weight2"]
    assert all(getattr(layer, f"weight{i}").allreduce is False for i in range(3))
    splits = [5, 0, 7]
    x = torch.randn(sum(splits), 64)
    out, (dx,) = _forward_backward(lambda t: layer(t, splits), x)
    xr = x.clone().requires_grad_(True)
    ref = torch.cat([c @ getattr(layer, f"weight{i}").detach().t() for i, c in enumerate(xr.split(splits))])
    ref.backward(torch.linspace(-1, 1, ref.numel()).view_as(ref))
    assert_close(out, ref, msg="grouped out")
    assert_close(dx, xr.grad, msg="grouped dgrad")
    assert torch.count_nonzero(layer.weight1.grad) == 0  # an expert with no tokens gets a zero gradient


def test_spec_provider_switches_per_feature(megatron_world):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from omegaconf import OmegaConf
    from primus_turbo.integrations.megatron import turbo_layers as tl
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider

    spec = TurboSpecProvider(OmegaConf.create({"model": {"moe": None}}))
    assert spec.column_parallel_linear() is ColumnParallelLinear
    assert spec.core_attention() is DotProductAttention
    assert spec.layer_norm(rms_norm=True) is WrappedTorchNorm
    assert spec.grouped_mlp_modules(False, False)[0] is SequentialMLP
    spec.linear = spec.attention = spec.norm = spec.grouped_mlp = True
    assert spec.column_parallel_linear() is tl.TurboColumnParallelLinear
    assert spec.row_parallel_linear() is tl.TurboRowParallelLinear
    assert spec.core_attention() is tl.TurboCoreAttention
    assert spec.layer_norm(rms_norm=True) is tl.TurboRMSNorm
    experts, subs = spec.grouped_mlp_modules(True, False)
    assert issubclass(experts, TEGroupedMLP) and experts.__name__ == "TurboGroupedMLP"
    assert subs.linear_fc1 is tl.TurboColumnParallelGroupedLinear


@pytest.mark.parametrize(
    "recipe, experts",
    [("tensorwise", "same"), ("rowwise", "same"), ("blockwise", "same"), ("delayed", "same"),
     ("rowwise", "blockwise"), ("blockwise", "rowwise"), ("delayed", "rowwise")],
)  # fmt: skip
def test_fp8_recipe_drives_turbo_linears_and_experts(megatron_world, recipe, experts):
    """The plugin-owned FP8 recipe: the registry entry sets the config, the turbo layers run FP8 GEMMs; the
    experts take fp8.expert_recipe when it is not ``same``."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from omegaconf import OmegaConf
    from primus_turbo.integrations.megatron import turbo_layers as tl
    from primus_turbo.integrations.megatron.patches import MegatronPatchContext
    from primus_turbo.integrations.megatron.turbo_patches import _fp8, _fp8_probe
    from test_utils import assert_snr, fp8_snr_gate

    cfg = OmegaConf.create({"fp8": {"enabled": True, "recipe": recipe, "expert_recipe": experts},
                            "model": {"moe": {}},
                            "turbo": {"enabled": True, "gemm": True, "grouped_gemm": True}})  # fmt: skip
    ctx = MegatronPatchContext(cfg=cfg, spec=None)
    assert _fp8_probe(ctx) is None
    detail = _fp8(ctx)
    fp8_config, expert_config = tl.FP8_CONFIG, tl.FP8_GROUPED_CONFIG
    if recipe == "delayed":  # linears: delayed tensorwise; experts: current (tensorwise unless given)
        assert fp8_config.strategy.name == "DELAYED" and expert_config.strategy.name == "CURRENT"
        assert expert_config.granularity.name == ("TENSORWISE" if experts == "same" else experts.upper())
    elif experts == "same":
        assert fp8_config.granularity.value == recipe.upper() and expert_config is fp8_config
        assert detail.startswith("turbo linears/experts run FP8 GEMMs")
    else:
        assert fp8_config.granularity.name == recipe.upper()
        assert expert_config.granularity.name == experts.upper()
        # fp8.format=auto per recipe: E4M3 with blockwise scaling, HYBRID otherwise
        assert expert_config.format.name == ("E4M3" if experts == "blockwise" else "HYBRID")
        assert f"experts: FP8 {expert_config.format.value} {experts.upper()}" in detail, detail
    try:
        config = _config()
        init = torch.nn.init.normal_
        stock = ColumnParallelLinear(
            128, 256, config=config, init_method=init, bias=False, gather_output=False
        )
        turbo = tl.TurboColumnParallelLinear(128, 256, config=config, init_method=init, bias=False,
                                             gather_output=False)  # fmt: skip
        turbo.load_state_dict(stock.state_dict())
        x = torch.randn(128, 1, 128)
        out_s, (dx_s,) = _forward_backward(stock, x)
        out_t, (dx_t,) = _forward_backward(turbo, x)
        gate = fp8_snr_gate(fp8_config.format)
        expert_gate = fp8_snr_gate(expert_config.format)
        assert_snr(out_t, out_s, gate, "fp8 linear out")
        assert_snr(dx_t, dx_s, gate, "fp8 linear dgrad")
        assert_snr(turbo.weight.grad, stock.weight.grad, gate, "fp8 linear wgrad")
        experts = tl.TurboColumnParallelGroupedLinear(2, 128, 64, config=config, init_method=init, bias=False,
                                                      skip_bias_add=False, is_expert=True)  # fmt: skip
        x = torch.randn(96, 128)
        out, _ = experts(x, [32, 64])
        ref = torch.cat([x[:32] @ experts.weight0.t(), x[32:] @ experts.weight1.t()])
        assert_snr(out.detach(), ref.detach(), expert_gate, "fp8 experts out")
        if recipe == "delayed":
            assert (
                turbo.fp8_delayed_state is not None and stock.state_dict().keys() <= turbo.state_dict().keys()
            )
    finally:
        tl.FP8_CONFIG = tl.FP8_GROUPED_CONFIG = None


def test_fp8_without_turbo_is_refused(megatron_world):
    from omegaconf import OmegaConf
    from primus_turbo.integrations.megatron.patches import MegatronPatchContext
    from primus_turbo.integrations.megatron.turbo_patches import _fp8_probe

    cfg = OmegaConf.create({"fp8": {"enabled": True, "recipe": "tensorwise"}, "model": {"moe": None},
                            "turbo": {"enabled": False, "gemm": True, "grouped_gemm": True}})  # fmt: skip
    assert "needs turbo.enabled=true" in _fp8_probe(MegatronPatchContext(cfg=cfg, spec=None))
    cfg.turbo.enabled, cfg.turbo.gemm, cfg.turbo.grouped_gemm = True, False, False
    assert "needs turbo.gemm or turbo.grouped_gemm" in _fp8_probe(MegatronPatchContext(cfg=cfg, spec=None))


def test_fp8_weight_cache_quantizes_once_per_step(megatron_world, monkeypatch):
    """Microbatches of one optimizer step reuse one FP8 weight; a new step or an in-place write requantizes,
    and without announced steps (a loop that is not our trainer) every call quantizes."""
    from primus_turbo.integrations.megatron import turbo_layers as tl

    from primus_turbo.pytorch.core.low_precision import Float8QuantConfig
    from primus_turbo.pytorch.modules import float8_linear

    calls = []
    real = float8_linear.quantize_weight
    monkeypatch.setattr(float8_linear, "quantize_weight", lambda w, c: calls.append(1) or real(w, c))
    tl.FP8_CONFIG = Float8QuantConfig()
    try:
        turbo = tl.TurboColumnParallelLinear(64, 96, config=_config(), init_method=torch.nn.init.normal_,
                                             bias=False, gather_output=False)  # fmt: skip
        x = torch.randn(32, 1, 64)
        tl.disable_weight_cache()
        out_ref, (dx_ref,) = _forward_backward(turbo, x)
        wgrad_ref = turbo.weight.grad.clone()
        turbo.weight.grad = None
        assert calls == []  # uncached: gemm_fp8 quantizes the weight itself
        tl.new_weight_step()
        for microbatch in range(2):
            out, (dx,) = _forward_backward(turbo, x)
            assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)
            assert_close(turbo.weight.grad, wgrad_ref * (microbatch + 1), torch.float32, "accumulated wgrad")
        assert len(calls) == 1
        with torch.no_grad():
            turbo.weight.mul_(0.5)  # bumps weight._version
        out_half, _ = _forward_backward(turbo, x)
        assert len(calls) == 2 and not torch.equal(out_half, out_ref)
        tl.new_weight_step()
        _forward_backward(turbo, x)
        assert len(calls) == 3
    finally:
        tl.FP8_CONFIG = None
        tl.disable_weight_cache()


@pytest.mark.parametrize("mla", [True, False])
def test_rope_patch_serves_full_dim_bshd_and_keeps_megatron_for_the_rest(megatron_world, monkeypatch, mla):
    """turbo.rope's wrapper: MLA (interleaved input) and standard attention match Megatron's eager RoPE; a
    partial rotary dim goes to Megatron's function, bit for bit."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention
    from megatron.core.transformer import multi_latent_attention as mla_module
    from primus_turbo.integrations.megatron.turbo_patches import _rope

    for module in (attention, mla_module):  # restored after the test
        monkeypatch.setattr(module, "apply_rotary_pos_emb", module.apply_rotary_pos_emb)
    assert "turbo.ops.apply_rotary_pos_emb" in _rope(None)
    assert attention.apply_rotary_pos_emb is mla_module.apply_rotary_pos_emb
    config = _config(multi_latent_attention=mla)
    wrapper = mla_module.apply_rotary_pos_emb
    freqs = torch.randn(9, 1, 1, 16)
    t = torch.randn(9, 2, 3, 16)
    stock = rope_utils.apply_rotary_pos_emb
    assert_close(wrapper(t, freqs, config), stock(t, freqs, config), torch.float32)
    partial = torch.randn(9, 2, 3, 24)  # rotary dim 16 of 24: Megatron's path
    assert torch.equal(wrapper(partial, freqs, config), stock(partial, freqs, config))
