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
