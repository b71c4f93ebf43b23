"""Single-device TorchTitan AMP (fp32 parameters under bf16 autocast) with the turbo converter: each weight is
cast (quantized) once per optimizer step and its gradient is added into ``.grad`` in the backward
(``integrations/torchtitan/amp_weights.py``).

Over several micro-batches the parameter gradients are bitwise those of the plain path (a cast per call,
gradients through autograd), in bf16 and in FP8; the cached copy is reused within a step and rebuilt after
``new_step`` or an in-place write; weights with gradient hooks keep the plain path. CPU: the turbo ops'
TORCH backends and the accumulation kernel under the Triton interpreter.
"""

import pytest
import torch

pytest.importorskip("torchtitan")
pytest.importorskip("hydra")

from primus_turbo.integrations.torchtitan import amp_weights as amp  # noqa: E402
from primus_turbo.integrations.torchtitan import converter as conv  # noqa: E402
from primus_turbo.integrations.torchtitan import turbo_modules as tm  # noqa: E402
from test_utils import assert_snr  # noqa: E402
from torchtitan_models import TINY_MLA, build, cfg_of, options  # noqa: E402


@pytest.fixture(autouse=True)
def _step_counter():
    """A fresh step counter per test (the converter module keeps one per process)."""
    saved = amp._STEP[0]
    amp.new_step()
    yield
    amp._STEP[0] = saved


def _turbo_model(fp8_recipe=None):
    cfg = cfg_of(*TINY_MLA)
    _, model = build(cfg)
    conv.convert_model(model, options(cfg, fp8_recipe=fp8_recipe, fp8_wgrad="bf16"))
    return cfg, model


def _accumulate(model, cfg, micro_batches: int, seed: int) -> dict[str, torch.Tensor]:
    """TorchTitan's step without the optimizer: zero_grad(set_to_none), then forward under bf16 autocast
    and backward per micro-batch."""
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    for _ in range(micro_batches):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten()
            )
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got: dict, want: dict, exact: bool, snr_db: float | None = None) -> None:
    """Bitwise (exact), by SNR (two FP8 computations: the project's gate, 20 dB for HYBRID gradients, is
    tightened to ``snr_db``), else within bf16 tolerance."""
    assert got.keys() == want.keys()
    for name, grad in want.items():
        if exact:
            assert torch.equal(got[name], grad), name
        elif snr_db is not None:
            assert_snr(got[name], grad, snr_db, msg=name)
        else:
            torch.testing.assert_close(
                got[name], grad, rtol=2e-2, atol=2e-2 * grad.abs().max().item(), msg=name
            )
    assert all(g.abs().sum() > 0 for n, g in got.items() if "experts" in n)  # never compared zeros


@pytest.mark.parametrize("fp8_recipe", [None, "rowwise"], ids=["bf16", "fp8_rowwise"])
def test_step_cached_weights_give_the_plain_autocast_gradients(fp8_recipe, device, monkeypatch):
    """Gate/up kept apart: bitwise the plain path on CPU; on a GPU within bf16 noise (the attention
    backward need not be deterministic)."""
    monkeypatch.setattr(tm, "FUSE_GATE_UP", False)
    cfg, model = _turbo_model(fp8_recipe)
    model.to(device)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    fused = _accumulate(model, cfg, micro_batches=3, seed=5)
    cached = [m for m in model.modules() if m.__dict__.get("_turbo_amp_cache")]
    kinds = {type(m) for m in cached}
    expected = {tm.TitanLinear, tm.TurboGroupedExperts} | ({tm.TitanFloat8Linear} if fp8_recipe else set())
    assert kinds == expected, kinds  # the path was taken by every turbo linear and the experts
    experts = next(m for m in cached if type(m) is tm.TurboGroupedExperts)
    assert set(experts._turbo_amp_cache) == {"w1", "w2", "w3"}
    monkeypatch.setattr(amp, "applies", lambda weight, x: False)  # the plain path: cast per call, autograd
    plain = _accumulate(model, cfg, micro_batches=3, seed=5)
    _assert_same(fused, plain, exact=device.type == "cpu")


@pytest.mark.parametrize("fp8_recipe", [None, "rowwise", "blockwise"])
def test_gate_up_as_one_gemm_and_swiglu_matches_the_separate_gemms(fp8_recipe, device, monkeypatch):
    """[w1; w3] as one (grouped) GEMM + turbo swiglu (fp32 math, one rounding) for the experts and every
    bf16 FeedForward: the gradients of silu(x w1) * (x w3) within bf16 noise, each weight's own."""
    cfg, model = _turbo_model(fp8_recipe)
    model.to(device)
    fused = _accumulate(model, cfg, micro_batches=2, seed=7)
    experts = [m for m in model.modules() if type(m) is tm.TurboGroupedExperts]
    ffns = [m for m in model.modules() if isinstance(m, tm.GateUpFeedForward)]
    assert experts and ffns  # dense layer + shared experts
    # blockwise: F = 32 is not a multiple of the 128 blocks, so the experts keep two GEMMs (exactness)
    gate_up = fp8_recipe != "blockwise"
    assert all(("w13" in m._turbo_amp_cache) == gate_up for m in experts)
    fp8_linears = fp8_recipe is not None  # FP8 FeedForward linears keep their two FP8 GEMMs
    assert all(("w13" in m.__dict__.get("_turbo_amp_cache", {})) != fp8_linears for m in ffns)
    monkeypatch.setattr(tm, "FUSE_GATE_UP", False)
    apart = _accumulate(model, cfg, micro_batches=2, seed=7)
    # FP8: the fused weight's rowwise dgrad copy scales each column over both halves, so the two differ by
    # FP8 rounding (CPU, seed 7: >= 31 dB on every parameter; the most upstream norm weight 3.5% at worst)
    _assert_same(fused, apart, exact=False, snr_db=28.0 if fp8_recipe else None)


def test_one_cast_for_the_linears_sharing_an_input_gives_the_same_gradients(device, monkeypatch):
    """MLA's q and kv_a projections, and the MoE router gate and shared experts, each read one fp32 tensor:
    it is cast once (``autocast_inputs``) and the consumers' bf16 gradients are summed in fp32 as their own
    casts' backward did: bitwise the per-consumer casts on CPU (two consumers: the fp32 sum commutes)."""
    cfg, model = _turbo_model()
    model.to(device)
    calls = []
    apply = tm._CastOnce.apply
    monkeypatch.setattr(tm._CastOnce, "apply", lambda *a: calls.append(a[2]) or apply(*a))
    once = _accumulate(model, cfg, micro_batches=2, seed=3)
    n_mla = sum(type(m) is tm.TurboMLA for m in model.modules())
    n_moe = sum(type(m) is tm.TurboMoE and m.shared_experts is not None for m in model.modules())
    assert n_mla and n_moe and calls == [2] * (2 * (n_mla + n_moe))  # 2 micro-batches
    monkeypatch.setattr(tm, "autocast_inputs", lambda x, n: (x,) * n)  # each linear casts its own copy
    apart = _accumulate(model, cfg, micro_batches=2, seed=3)
    _assert_same(once, apart, exact=device.type == "cpu")


def test_the_cached_cast_is_reused_within_a_step_and_rebuilt_after_it_or_a_write():
    lin = tm.TitanLinear(32, 16, bias=False)
    x = torch.randn(4, 32)

    def cast_in_use():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x).sum().backward()
        return lin._turbo_amp_cache["weight"][1]

    first = cast_in_use()
    assert first.dtype == torch.bfloat16 and torch.equal(first, lin.weight.detach().bfloat16())
    assert cast_in_use() is first  # the second micro-batch reuses it
    assert torch.allclose(lin.weight.grad, 2 * (torch.ones(4, 16).t() @ x.bfloat16().float()), rtol=1e-2)
    with torch.no_grad():
        lin.weight.add_(1.0)  # a write between micro-batches (no new_step): the version key rebuilds it
    rebuilt = cast_in_use()
    assert rebuilt is not first and torch.equal(rebuilt, lin.weight.detach().bfloat16())
    amp.new_step()
    assert cast_in_use() is not rebuilt
    amp.disable_cache()  # no step announcements: a cast per call, nothing kept
    lin._turbo_amp_cache.clear()
    cast = amp.cast_weight(lin, "weight", lin.weight, torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and not lin._turbo_amp_cache


def test_weights_with_gradient_hooks_or_a_differentiable_gradient_keep_autograd():
    """A post-accumulate-grad hook (TorchTitan's optimizer-in-backward) must see every gradient: such a
    weight takes the plain path. ``create_graph`` gets a gradient through autograd."""
    lin = tm.TitanLinear(32, 16, bias=False)
    x = torch.randn(4, 32)
    calls = []
    lin.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    assert not amp.applies(lin.weight, x.bfloat16())
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x).sum().backward()
    assert len(calls) == 2 and "_turbo_amp_cache" not in lin.__dict__
    assert not amp.applies(lin.weight.view_as(lin.weight), x.bfloat16())  # a view (DTensor.to_local)
    plain = tm.TitanLinear(32, 16, bias=False)
    w16 = amp.cast_weight(plain, "weight", plain.weight, torch.bfloat16)
    (grad,) = torch.autograd.grad(w16.float().pow(2).sum(), plain.weight, create_graph=True)
    assert grad.requires_grad and torch.allclose(grad, 2 * plain.weight.detach().bfloat16().float())
    assert plain.weight.grad is None


def test_the_converter_announces_each_optimizer_step():
    step = amp._STEP[0]
    converter = conv.PrimusTurboConverter.__new__(conv.PrimusTurboConverter)
    converter.post_optimizer_hook([torch.nn.Linear(2, 2)])
    assert amp._STEP[0] == step + 1


def test_calls_inside_a_compiled_block_take_the_plain_path():
    """TorchTitan compiles each block with fullgraph=True: the cache (data_ptr, _version, a dict) must stay
    out of the trace, so a traced call casts per call and hands the gradient to autograd."""
    lin = tm.TitanLinear(32, 16, bias=False)
    x = torch.randn(4, 32)

    def block(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x)

    out = torch.compile(block, fullgraph=True, backend="eager")(x)
    out.float().sum().backward()
    assert "_turbo_amp_cache" not in lin.__dict__
    expected = torch.ones(4, 16).t() @ x.bfloat16().float()
    assert torch.allclose(lin.weight.grad, expected, rtol=1e-2, atol=1e-2)


def test_embedding_gradient_goes_into_grad_over_the_touched_rows(device, monkeypatch):
    """turbo.embedding: the token embedding's gradient is added into the fp32 .grad by turbo.ops.embedding
    (zero-filled on the step's first micro-batch): the stock gradient up to fp32 summation order, every
    other gradient unchanged."""
    cfg, model = _turbo_model()
    model.to(device)
    assert type(model.tok_embeddings) is tm.TitanEmbedding
    fused = _accumulate(model, cfg, micro_batches=3, seed=11)
    monkeypatch.setattr(tm.TitanEmbedding, "forward", torch.nn.Embedding.forward)
    plain = _accumulate(model, cfg, micro_batches=3, seed=11)
    name = "tok_embeddings.weight"
    torch.testing.assert_close(fused.pop(name), plain.pop(name), rtol=1e-5, atol=1e-7)
    _assert_same(fused, plain, exact=device.type == "cpu")


@pytest.mark.parametrize("overrides, reason", [({"tp": 2}, "tp > 1"), ({"fsdp": True}, "FSDP shards")])
def test_embedding_stays_stock_where_torchtitan_shards_it(overrides, reason):
    cfg = cfg_of(*TINY_MLA)
    _, model = build(cfg)
    rows = {r.name: r for r in conv.convert_model(model, options(cfg, **overrides))}
    assert rows["turbo.embedding"].status == "n/a" and reason in rows["turbo.embedding"].detail
    assert type(model.tok_embeddings) is torch.nn.Embedding
