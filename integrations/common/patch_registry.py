"""One registry for every framework patch: turbo feature swaps and fixes for gaps in the stock framework.

A patch is a small function plus metadata: the dotted ``target`` it changes, the framework versions it was
tested on, the turbo ``feature`` flag that requests it (None for always-on gap fixes), a ``condition`` saying
whether it is relevant to this run, and a ``probe`` saying whether the turbo side can serve it.

Fail-closed: a requested patch whose probe or apply fails stops the run with the reason (``PatchError``)
unless ``turbo.strict=false``, in which case the stock path runs and the report says so. Nothing is
patched silently: ``apply_patches`` returns report rows and ``format_report`` prints them at start-up.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

ACTIVE, OFF, NOT_APPLICABLE, FALLBACK = "active", "off", "n/a", "stock (unavailable)"


class PatchError(RuntimeError):
    """A requested patch cannot apply under turbo.strict=true."""


@dataclass
class Patch:
    name: str
    target: str
    tested_versions: tuple[str, ...]
    apply: Callable[[object], str]
    feature: str | None = None
    condition: Callable[[object], str | None] = lambda ctx: None
    probe: Callable[[object], str | None] = lambda ctx: None


@dataclass
class ReportRow:
    name: str
    status: str
    target: str
    detail: str = ""


@dataclass
class PatchRegistry:
    framework: str
    patches: list[Patch] = field(default_factory=list)

    def register(
        self,
        name: str,
        target: str,
        tested_versions: tuple[str, ...],
        feature: str | None = None,
        condition=None,
        probe=None,
    ):
        """Decorator: register ``fn(ctx) -> description`` as the apply step of a patch."""

        def wrap(fn):
            if any(p.name == name for p in self.patches):
                raise ValueError(f"patch {name!r} is registered twice")
            self.patches.append(
                Patch(
                    name,
                    target,
                    tested_versions,
                    fn,
                    feature,
                    condition or (lambda ctx: None),
                    probe or (lambda ctx: None),
                )
            )
            return fn

        return wrap


_MISSING = object()
_ORIGINALS: list[tuple[object, str, object]] = []  # (owner, attribute, value before the first patch_attr)


def patch_attr(obj, name: str, value) -> None:
    """``setattr(obj, name, value)`` for a turbo entry, remembering the attribute's original value (once), so
    ``restore_patched_attrs`` can undo it: a later run in the same process with a feature off gets stock."""
    if not any(owner is obj and attr == name for owner, attr, _ in _ORIGINALS):
        _ORIGINALS.append((obj, name, getattr(obj, name, _MISSING)))
    setattr(obj, name, value)


def replace_attr(obj, name: str, value) -> None:
    """``patch_attr`` for a name the framework must already define: a turbo entry that would otherwise add a
    dead attribute (the framework moved or renamed it, so nothing reads the new one) while the report says
    'active' fails instead, as an apply error the registry reports (strict: stops the run)."""
    if not hasattr(obj, name):
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise AttributeError(f"{owner} has no attribute {name!r} to replace in this framework version")
    patch_attr(obj, name, value)


def restore_patched_attrs(keep: int = 0) -> int:
    """Undo every ``patch_attr`` after the first ``keep`` (newest first); returns how many it restored."""
    count = max(len(_ORIGINALS) - keep, 0)
    while len(_ORIGINALS) > keep:
        obj, name, original = _ORIGINALS.pop()
        if original is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, original)
    return count


def target_exists(target: str) -> bool:
    """Whether ``pkg.module.attr[.attr]`` resolves (the longest importable module prefix, then getattr)."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return True
        except AttributeError:
            return False
    return False


def apply_patches(registry: PatchRegistry, ctx, turbo_cfg, framework_version: str) -> list[ReportRow]:
    """Apply every relevant patch in registration order; return one report row per patch.

    ``turbo_cfg`` has ``enabled``, ``strict`` and one bool per feature. Gap fixes (feature None) run even with
    turbo disabled: they make the stock path work at all.
    """
    rows = []
    for patch in registry.patches:
        requested = patch.feature is None or (turbo_cfg.enabled and bool(turbo_cfg.get(patch.feature, False)))
        if not requested:
            rows.append(ReportRow(patch.name, OFF, patch.target))
            continue
        problem = None
        try:  # condition and probe read framework attributes too: one that moved is a failure to report
            reason = patch.condition(ctx)
        except Exception as err:  # noqa: BLE001
            reason, problem = None, f"condition failed: {type(err).__name__}: {err}"
        if reason:
            rows.append(ReportRow(patch.name, NOT_APPLICABLE, patch.target, reason))
            continue
        if problem is None and not target_exists(patch.target):
            problem = f"target {patch.target} not found"
        if problem is None:
            try:
                problem = patch.probe(ctx)
            except Exception as err:  # noqa: BLE001
                problem = f"probe failed: {type(err).__name__}: {err}"
        detail = ""
        if problem is None:
            mark = len(_ORIGINALS)
            try:
                detail = patch.apply(ctx)
            except Exception as err:  # noqa: BLE001 - any failure is reported with the patch name
                problem = f"apply failed: {type(err).__name__}: {err}"
                restore_patched_attrs(keep=mark)  # no half-applied patch under a 'stock' row
        if problem is not None:
            flag = f"turbo.{patch.feature}" if patch.feature else "(framework gap fix)"
            if turbo_cfg.strict:
                raise PatchError(
                    f"{flag} cannot serve this run: {problem}. Set {flag}=false to use the "
                    "stock path for it, or turbo.strict=false to fall back automatically."
                    if patch.feature
                    else f"{patch.name} {flag} cannot apply: {problem}"
                )
            rows.append(ReportRow(patch.name, FALLBACK, patch.target, problem))
            continue
        if framework_version not in patch.tested_versions:
            detail = f"{detail} [untested on {registry.framework} {framework_version}]".strip()
        rows.append(ReportRow(patch.name, ACTIVE, patch.target, detail))
    return rows


def format_report(title: str, rows: list[ReportRow]) -> str:
    width = max(len(r.name) for r in rows) if rows else 10
    lines = [f"==== turbo report: {title} ===="]
    for r in rows:
        detail = f"  -- {r.detail}" if r.detail else ""
        lines.append(f"  {r.name:<{width}}  {r.status:<20} {r.target}{detail}")
    return "\n".join(lines)
