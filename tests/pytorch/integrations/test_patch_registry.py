"""Patch registry: fail-closed under strict, stock fallback otherwise, off / n/a rows, version notes."""

import pytest
from omegaconf import OmegaConf
from primus_turbo.integrations.common.patch_registry import (
    ACTIVE,
    FALLBACK,
    NOT_APPLICABLE,
    OFF,
    PatchError,
    PatchRegistry,
    apply_patches,
    format_report,
    target_exists,
)


def _turbo(**flags):
    base = {"enabled": True, "strict": True, "gemm": True, "router": True}
    base.update(flags)
    return OmegaConf.create(base)


def _registry(probe_result=None, condition_result=None, fail_apply=False):
    registry = PatchRegistry(framework="demo")
    applied = []

    def apply(ctx):
        if fail_apply:
            raise RuntimeError("boom")
        applied.append("gemm")
        return "swapped"

    register = registry.register(
        "turbo.gemm", "os.path.join", ("1.0",), feature="gemm",
        condition=lambda ctx: condition_result, probe=lambda ctx: probe_result,
    )  # fmt: skip
    register(apply)
    return registry, applied


def test_active_patch_applies_and_reports():
    registry, applied = _registry()
    rows = apply_patches(registry, None, _turbo(), "1.0")
    assert applied == ["gemm"]
    assert [(r.name, r.status, r.detail) for r in rows] == [("turbo.gemm", ACTIVE, "swapped")]


def test_untested_version_is_annotated():
    registry, _ = _registry()
    (row,) = apply_patches(registry, None, _turbo(), "2.0")
    assert row.status == ACTIVE and "untested on demo 2.0" in row.detail


@pytest.mark.parametrize("flags", [{"gemm": False}, {"enabled": False}])
def test_feature_off_or_turbo_disabled_does_not_apply(flags):
    registry, applied = _registry()
    (row,) = apply_patches(registry, None, _turbo(**flags), "1.0")
    assert applied == [] and row.status == OFF


def test_condition_marks_not_applicable():
    registry, applied = _registry(condition_result="dense model")
    (row,) = apply_patches(registry, None, _turbo(), "1.0")
    assert applied == [] and row.status == NOT_APPLICABLE and row.detail == "dense model"


def test_strict_unavailable_feature_stops_with_the_flag_name():
    registry, applied = _registry(probe_result="turbo op(s) ops.gemm not found")
    with pytest.raises(
        PatchError, match=r"turbo\.gemm cannot serve this run: turbo op\(s\) ops\.gemm not found"
    ):
        apply_patches(registry, None, _turbo(), "1.0")
    assert applied == []


def test_non_strict_falls_back_to_stock_and_says_why():
    registry, applied = _registry(probe_result="missing op")
    (row,) = apply_patches(registry, None, _turbo(strict=False), "1.0")
    assert applied == [] and row.status == FALLBACK and row.detail == "missing op"


def test_apply_exception_is_fail_closed():
    registry, _ = _registry(fail_apply=True)
    with pytest.raises(PatchError, match="apply failed: RuntimeError: boom"):
        apply_patches(registry, None, _turbo(), "1.0")


def test_missing_target_is_fail_closed():
    registry = PatchRegistry(framework="demo")
    registry.register("fix.x", "os.path.no_such_function", ("1.0",))(lambda ctx: "x")
    with pytest.raises(PatchError, match="target os.path.no_such_function not found"):
        apply_patches(registry, None, _turbo(), "1.0")


def test_duplicate_registration_rejected():
    registry, _ = _registry()
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("turbo.gemm", "os.path.join", ("1.0",))(lambda ctx: "")


def test_target_exists_and_report_format():
    assert target_exists("os.path.join") and not target_exists("os.path.nope") and not target_exists("nope.x")
    registry, _ = _registry()
    text = format_report("demo", apply_patches(registry, None, _turbo(), "1.0"))
    assert "turbo report: demo" in text and "turbo.gemm" in text and "active" in text and "swapped" in text


def test_patch_attr_is_undone_by_restore_patched_attrs():
    import types

    from primus_turbo.integrations.common import patch_registry
    from primus_turbo.integrations.common.patch_registry import patch_attr, restore_patched_attrs

    earlier = list(patch_registry._ORIGINALS)  # an earlier test's Megatron patches in this worker: kept
    patch_registry._ORIGINALS.clear()
    try:
        mod = types.SimpleNamespace(f="stock")
        patch_attr(mod, "f", "turbo")
        patch_attr(mod, "f", "turbo again")  # the first original is the one kept
        patch_attr(mod, "g", "new")
        assert (mod.f, mod.g) == ("turbo again", "new")
        assert restore_patched_attrs() == 2
        assert mod.f == "stock" and not hasattr(mod, "g")
    finally:
        patch_registry._ORIGINALS[:] = earlier


def test_megatron_turbo_entries_are_undone_when_a_later_run_turns_them_off():
    """Two runs in one process (hydra_main.run from find_syncs.py, profile_entry.py): the second, with
    turbo.enabled=false, runs stock Megatron, as its report says, not the first run's turbo functions."""
    pytest.importorskip("megatron.core")
    from hydra import compose, initialize_config_dir
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import optimizer
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import attention
    from megatron.core.transformer.moe import moe_layer, router, token_dispatcher
    from primus_turbo.integrations.common.patch_registry import restore_patched_attrs
    from primus_turbo.integrations.hydra_main import RECIPES_DIR
    from primus_turbo.integrations.megatron.patches import apply_megatron_patches
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider

    places = [(router, "topk_routing_with_score_function"), (token_dispatcher, "permute"),
              (moe_layer, "MoEAlltoAllTokenDispatcher"), (LanguageModule, "compute_language_model_loss"),
              (layers, "F"), (attention, "apply_rotary_pos_emb"),
              (optimizer, "get_grad_norm_fp32")]  # fmt: skip
    restore_patched_attrs()  # an earlier test in this process may have left turbo entries applied
    stock = [getattr(obj, name) for obj, name in places]
    with initialize_config_dir(config_dir=RECIPES_DIR, version_base="1.3"):
        on = compose(config_name="config", overrides=["parallel.ep=1"])
        off = compose(config_name="config", overrides=["parallel.ep=1", "turbo.enabled=false"])
    try:
        apply_megatron_patches(on, TurboSpecProvider(on))
        patched = [name for (obj, name), was in zip(places, stock) if getattr(obj, name) is not was]
        assert len(patched) >= 6, patched  # the entries this recipe turns on
        apply_megatron_patches(off, TurboSpecProvider(off))
        assert [getattr(obj, name) for obj, name in places] == stock
    finally:
        restore_patched_attrs()


def test_megatron_router_patch_keeps_megatron_s_scaling_factor_rule():
    """Megatron scales the probs only when ``scaling_factor`` is truthy (``if scaling_factor:``): 0.0 leaves
    them as they are. The turbo router patch follows it (the op itself multiplies by any number given)."""
    pytest.importorskip("megatron.core")
    import torch
    from hydra import compose, initialize_config_dir
    from megatron.core.transformer.moe import router
    from primus_turbo.integrations.common.patch_registry import restore_patched_attrs
    from primus_turbo.integrations.hydra_main import RECIPES_DIR
    from primus_turbo.integrations.megatron.patches import apply_megatron_patches
    from primus_turbo.integrations.megatron.spec_provider import TurboSpecProvider

    restore_patched_attrs()
    stock = router.topk_routing_with_score_function
    with initialize_config_dir(config_dir=RECIPES_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["parallel.ep=1"])
    logits = torch.randn(16, 8)
    try:
        apply_megatron_patches(cfg, TurboSpecProvider(cfg))
        assert router.topk_routing_with_score_function is not stock
        for factor in (0.0, None, 2.5):
            ref_probs, ref_map = stock(logits, 2, scaling_factor=factor)
            probs, routing_map = router.topk_routing_with_score_function(logits, 2, scaling_factor=factor)
            assert torch.equal(routing_map, ref_map), factor
            torch.testing.assert_close(probs, ref_probs, rtol=1e-5, atol=1e-6, msg=f"scaling_factor={factor}")
    finally:
        restore_patched_attrs()
