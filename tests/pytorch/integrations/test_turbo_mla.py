"""turbo.mla_qkv's TurboMLASelfAttention against Megatron's MLASelfAttention, in process on CPU (the turbo
kernels under the Triton interpreter): the same weights give the same query, key and value, and the same
gradients for the input and every weight, with q projected directly and through q_lora_rank; configurations it
does not serve run Megatron's method."""

from __future__ import annotations

import pytest
import torch
from test_utils import assert_close

pytest.importorskip("megatron.core")


def _modules(q_lora_rank, monkeypatch):
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    from omegaconf import OmegaConf
    from primus_turbo.integrations.megatron.model import _attention_spec
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider
    from primus_turbo.integrations.megatron.stock_attention import MLADotProductAttention

    config = MLATransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, add_bias_linear=False, gradient_accumulation_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, normalization="RMSNorm",
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=24,
        rope_type="rope", rotary_base=10000, apply_rope_fusion=False,
    )  # fmt: skip
    monkeypatch.setattr(multi_latent_attention, "HAVE_TE", False)  # as fix.mla_have_te
    built = []
    for turbo in (False, True):
        spec = TurboSpecProvider(OmegaConf.create({"model": {"mla": {}, "moe": None}}))
        spec.stock_core_attention = MLADotProductAttention
        spec.mla_qkv = turbo
        attention = _attention_spec(spec, mla=True)
        torch.manual_seed(0)
        built.append(build_module(attention, config=config, layer_number=1))
    built[1].load_state_dict(built[0].state_dict())
    return built


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_query_key_value_and_gradients_match_megatron(megatron_world, q_lora_rank, monkeypatch):
    from primus_turbo.integrations.megatron.turbo_mla import TurboMLASelfAttention

    stock, turbo = _modules(q_lora_rank, monkeypatch)
    assert type(turbo) is TurboMLASelfAttention and type(stock) is not TurboMLASelfAttention
    torch.manual_seed(1)
    hidden = torch.randn(10, 2, 64)
    grads = None
    results = []
    for module in (stock, turbo):
        x = hidden.clone().requires_grad_(True)
        query, key, value, q_compressed, kv_compressed = module.get_query_key_value_tensors(x)
        assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
        if grads is None:
            grads = [torch.randn_like(t) for t in (query, key, value)]
        torch.autograd.backward([query, key, value], grads)
        params = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        results.append(((query, key, value, q_compressed, kv_compressed), x.grad, params))
    (want, want_dx, want_dw), (got, got_dx, got_dw) = results
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
    for name, a, b in zip(("query", "key", "value", "q_compressed", "kv_compressed"), got, want):
        assert_close(a, b, torch.float32, msg=name)
    assert_close(got_dx, want_dx, torch.float32, msg="d hidden")
    assert set(got_dw) == set(want_dw) and len(got_dw) >= 4
    for name in want_dw:
        assert_close(got_dw[name], want_dw[name], torch.float32, msg=f"d {name}")


def test_unserved_configurations_run_megatrons_method(megatron_world, monkeypatch):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    _, turbo = _modules(None, monkeypatch)
    calls = []
    stock = MLASelfAttention.get_query_key_value_tensors
    monkeypatch.setattr(MLASelfAttention, "get_query_key_value_tensors",
                        lambda self, *a, **k: calls.append(1) or stock(self, *a, **k))  # fmt: skip
    hidden = torch.randn(10, 2, 64)
    turbo.get_query_key_value_tensors(hidden)
    assert calls == []
    assert not turbo._turbo_serves(hidden, None, object(), None)  # packed sequences
    assert not turbo._turbo_serves(hidden, None, None, object())  # an inference context
    turbo.recompute_up_proj = True  # any condition it does not serve: Megatron's method, unchanged
    turbo.get_query_key_value_tensors(hidden)
    assert calls == [1]
