"""Resolve plan layers against a real module tree, section by section.

Every section (compile, attention, ...) resolves by the same rules. Key kinds, from most to least specific: an exact dotted path (or "" for the root), a
path glob (``*`` = one segment, ``**`` = any number), a class name. For every
(submodule, method) that some key matches, the matching specs are folded in order of
(layer precedence, key specificity): each contributes the fields it set explicitly, so a
user override ``{"dynamic": True}`` changes only `dynamic` and keeps the rest. A section
that no layer mentions gets its engine default (for compile: the root, as
`torch.compile(root)`; for the others: nothing).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Iterable

import torch.nn as nn

from ..specs.plan import LAYER_ORDER, PlanLayer
from ..specs.section import SECTIONS, SectionSpec, section_class
from .observe.table import format_table


class PlanError(ValueError):
    """A plan key or method that matches nothing in the module tree. `layer` and `section`
    say where the key was written (the layer's name, e.g. "model default", and the section),
    when the resolver knows; `magi_zoo.overrides.name_plan_source` turns them into the spec
    file's table."""

    def __init__(self, message: str, *, layer: str | None = None, section: str | None = None):
        super().__init__(message)
        self.layer = layer
        self.section = section


@dataclasses.dataclass
class Target:
    """One (submodule, method) of one section, with its resolved spec. `method` is None
    for sections that apply to a module as a whole."""

    path: str
    method: str | None
    module: nn.Module
    spec: SectionSpec
    key: str  # the winning (most specific, highest layer) key
    layers: list[str]  # every layer that contributed, lowest first

    @property
    def cls_name(self) -> str:
        return type(self.module).__name__


@dataclasses.dataclass
class ResolvedSection:
    """One section after resolution: an ordered list of targets, outermost first."""

    section: str
    targets: list[Target]

    def regions(self) -> dict[tuple[str, str | None], list[Target]]:
        """Group targets into regions: one per (winning key, method, spec).

        Targets under one key can end with different specs when a more specific key of a
        lower layer set other fields for some of them; those become a region of their own,
        named ``key@first_path``.
        """
        groups: dict[tuple[str, str | None, SectionSpec], list[Target]] = {}
        for t in self.targets:
            groups.setdefault((t.key, t.method, t.spec), []).append(t)
        largest: dict[tuple[str, str | None], int] = {}
        for (key, method, _), ts in groups.items():
            largest[(key, method)] = max(largest.get((key, method), 0), len(ts))
        out: dict[tuple[str, str | None], list[Target]] = {}
        for (key, method, _), ts in groups.items():
            plain = (key, method) not in out and len(ts) == largest[(key, method)]
            out[(key if plain else f"{key}@{ts[0].path}", method)] = ts
        return out

    def table(self) -> list[dict[str, str]]:
        """Rows for display: section, key, method, matched modules, spec, source layers."""
        rows = []
        for (key, method), ts in self.regions().items():
            paths = [t.path or "<root>" for t in ts]
            where = paths[0] if len(paths) == 1 else f"{len(paths)} x {ts[0].cls_name}"
            rows.append({
                "section": self.section,
                "region": key or "<root>",
                "method": method or "-",
                "modules": where,
                "spec": ts[0].spec.short(),
                "from": " > ".join(reversed(ts[0].layers)),
            })
        return rows


@dataclasses.dataclass
class ResolvedPlan:
    """Every registered section after resolution."""

    sections: dict[str, ResolvedSection]

    def section(self, name: str) -> ResolvedSection:
        section_class(name)  # unknown names: did-you-mean
        return self.sections.get(name) or ResolvedSection(name, [])

    @property
    def targets(self) -> list[Target]:
        """The compile section's targets."""
        return self.section("compile").targets

    def regions(self) -> dict[tuple[str, str | None], list[Target]]:
        """The compile section's regions."""
        return self.section("compile").regions()

    def table(self) -> list[dict[str, str]]:
        """Rows of every section that has targets, in section order."""
        return [row for s in self.sections.values() for row in s.table()]

    def __repr__(self) -> str:
        """The resolved table (one row per region and section), not every target's spec:
        a published Wan has ~600 targets, which is what `print(plan)` used to dump."""
        rows = self.table()
        n = sum(len(s.targets) for s in self.sections.values())
        head = f"ResolvedPlan: {len(rows)} region(s) over {n} target(s)"
        return head + ("\n" + format_table(rows) if rows else " (nothing set: library defaults)")

    __str__ = __repr__

    def digests(self) -> list[tuple[str, str, str | None, str]]:
        """(section, path, method, spec digest) for every target: what a cache key needs."""
        return [(s.section, t.path, t.method, t.spec.digest()) for s in self.sections.values() for t in s.targets]


def path_within(path: str, outer: str) -> bool:
    """Whether the module at dotted `path` is the one at `outer` or under it ("" is the root,
    which holds every path)."""
    return path == outer or not outer or path.startswith(outer + ".")


def paths_related(a: str, b: str) -> bool:
    """Whether module paths `a` and `b` are the same, or one holds the other."""
    return path_within(a, b) or path_within(b, a)


def _glob_to_regex(pattern: str) -> re.Pattern:
    """'*' matches one path segment (or part of one), '**' one or more whole segments."""
    parts = []
    for seg in pattern.split("."):
        if seg == "**":
            parts.append(r"[^.]+(?:\.[^.]+)*")
        else:
            parts.append(re.escape(seg).replace(r"\*", r"[^.]*"))
    return re.compile("^" + r"\.".join(parts) + "$")


def _specificity(key: str, matched_by_path: bool) -> tuple[int, int]:
    if not matched_by_path:
        return (0, 0)  # class name: least specific
    wild = key.count("*")
    if wild == 0:
        return (2, 0)  # exact path
    return (1, -wild)  # glob: fewer wildcards = more specific


def match_key(root: nn.Module, key: str, modules: dict[str, nn.Module] | None = None) -> tuple[list[str], bool]:
    """Paths of the submodules a key matches, and whether it matched as a path."""
    modules = modules if modules is not None else dict(root.named_modules())
    if key in ("", "."):
        return [""], True
    if "*" in key:
        rx = _glob_to_regex(key)
        return [p for p in modules if p and rx.match(p)], True
    if key in modules:
        return [key], True
    by_class = [p for p, m in modules.items() if type(m).__name__ == key]
    return by_class, False


def _closest(key: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    candidates = list(dict.fromkeys(candidates))
    close = difflib.get_close_matches(key, candidates, n=n, cutoff=0.5)
    if not close:  # fall back to the top-level names so the user sees what exists
        close = [c for c in candidates if c and "." not in c][:n]
    return close


def _no_match_error(root: nn.Module, key: str, modules: dict[str, nn.Module], layer: str) -> PlanError:
    names = list(modules) + sorted({type(m).__name__ for m in modules.values()})
    close = _closest(key.replace("*", ""), [n for n in names if n])
    # a misspelled section name ({"compiel": {...}}) makes the whole dict read as compile regions
    # (PlanLayer.coerce): say so, where the key names no module but is near a section
    section = difflib.get_close_matches(key, list(SECTIONS), n=1, cutoff=0.75)
    hint = (f" {key!r} is close to the plan section {section[0]!r}: a plan with sections is "
            f"{{section: {{key: spec}}}} with section names from {', '.join(SECTIONS)}; a dict of other "
            "names is read as compile regions." if section else "")
    return PlanError(
        f"plan key {key!r} ({layer}) matches no submodule of {type(root).__name__}. "
        f"Closest submodules / classes: {', '.join(close) or '(none)'}. "
        "Keys are dotted paths ('*' = one segment, '**' = one or more), '' for the root, or class names." + hint
    )


def _method_error(key: str, path: str, module: nn.Module, method: str) -> PlanError:
    methods = [m for m in dir(type(module)) if not m.startswith("_") and callable(getattr(type(module), m, None))
               and not hasattr(nn.Module, m)]
    close = difflib.get_close_matches(method, methods + ["forward"], n=5, cutoff=0.4)
    return PlanError(
        f"plan key {key!r}: {type(module).__name__} at {path or '<root>'!r} has no method {method!r}. "
        f"Closest methods: {', '.join(close) or ', '.join(sorted(methods)[:8]) or 'forward'}."
    )


def resolve_section(root: nn.Module, layers: list[tuple[str, PlanLayer]], section: str,
                    modules: dict[str, nn.Module] | None = None) -> ResolvedSection:
    """Resolve one section of stacked plan layers against `root` (rules: module docstring)."""
    cls = section_class(section)
    unknown = [name for name, _ in layers if name not in LAYER_ORDER]
    if unknown:
        raise ValueError(f"unknown plan layer {unknown}; valid: {LAYER_ORDER}")
    stack = [(name, list(layer.items(section))) for name, layer in layers]
    if not any(items for _, items in stack):
        default = cls.engine_default()
        if not default:
            return ResolvedSection(section, [])
        stack = [("engine default", list(PlanLayer(sections={section: default}).items(section)))]
    modules = modules if modules is not None else dict(root.named_modules())
    # (path, method) -> list of (rank tuple, layer name, key, spec)
    found: dict[tuple[str, str | None], list[tuple[tuple, str, str, SectionSpec]]] = {}
    for layer_name, items in stack:
        rank = LAYER_ORDER.index(layer_name)
        for key, method, spec in items:
            paths, by_path = match_key(root, key, modules)
            if not paths:
                err = _no_match_error(root, key, modules, f"{layer_name}, {section}")
                err.layer, err.section = layer_name, section
                raise err
            for path in paths:
                mod = modules[path]
                if method is not None and not callable(getattr(mod, method, None)):
                    err = _method_error(key, path, mod, method)
                    err.layer, err.section = layer_name, section
                    raise err
                found.setdefault((path, method), []).append(
                    ((rank, *_specificity(key, by_path)), layer_name, key, spec)
                )
    targets = []
    order = {p: i for i, p in enumerate(modules)}
    for (path, method), cands in sorted(found.items(), key=lambda kv: (order[kv[0][0]], kv[0][1] or "")):
        cands.sort(key=lambda c: c[0])
        fields: dict = {}
        for _, _, _, spec in cands:
            fields.update(spec.explicit())
        layers_used = list(dict.fromkeys(c[1] for c in cands))
        targets.append(Target(path=path, method=method, module=modules[path],
                              spec=cls(**fields), key=cands[-1][2], layers=layers_used))
    return ResolvedSection(section, targets)


def resolve(root: nn.Module, layers: list[tuple[str, PlanLayer]]) -> ResolvedPlan:
    """Resolve every registered section of stacked plan layers against `root`.

    Every key of every section is checked before anything is changed, so a plan with a bad
    key leaves the module untouched.
    """
    modules = dict(root.named_modules())
    return ResolvedPlan({name: resolve_section(root, layers, name, modules) for name in SECTIONS})
