"""Resolve plan layers against a real module tree.

Key kinds, from most to least specific: an exact dotted path (or "" for the root), a
path glob (``*`` = one segment, ``**`` = any number), a class name. For every
(submodule, method) that some key matches, the matching specs are folded in order of
(layer precedence, key specificity): each contributes the fields it set explicitly, so a
user override ``{"dynamic": True}`` changes only `dynamic` and keeps the rest.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Iterable

import torch.nn as nn

from ..specs.compile_spec import TorchCompileSpec
from ..specs.plan import LAYER_ORDER, PlanLayer


class PlanError(ValueError):
    """A plan key or method that matches nothing in the module tree."""


@dataclasses.dataclass
class Target:
    """One (submodule, method) to compile, with its resolved spec."""

    path: str
    method: str
    module: nn.Module
    spec: TorchCompileSpec
    key: str  # the winning (most specific, highest layer) key
    layers: list[str]  # every layer that contributed, lowest first

    @property
    def cls_name(self) -> str:
        return type(self.module).__name__


@dataclasses.dataclass
class ResolvedPlan:
    """The plan after resolution: an ordered list of targets, outermost first."""

    targets: list[Target]

    def regions(self) -> dict[tuple[str, str], list[Target]]:
        """Group targets into regions: one per (winning key, method, spec).

        Targets under one key can end with different specs when a more specific key of a
        lower layer set other fields for some of them; those become a region of their own,
        named ``key@first_path``.
        """
        groups: dict[tuple[str, str, TorchCompileSpec], list[Target]] = {}
        for t in self.targets:
            groups.setdefault((t.key, t.method, t.spec), []).append(t)
        largest: dict[tuple[str, str], int] = {}
        for (key, method, _), ts in groups.items():
            largest[(key, method)] = max(largest.get((key, method), 0), len(ts))
        out: dict[tuple[str, str], list[Target]] = {}
        for (key, method, _), ts in groups.items():
            plain = (key, method) not in out and len(ts) == largest[(key, method)]
            out[(key if plain else f"{key}@{ts[0].path}", method)] = ts
        return out

    def table(self) -> list[dict[str, str]]:
        """Rows for display: key, method, matched modules, spec, source layers."""
        rows = []
        for (key, method), ts in self.regions().items():
            paths = [t.path or "<root>" for t in ts]
            where = paths[0] if len(paths) == 1 else f"{len(paths)} x {ts[0].cls_name}"
            rows.append({
                "region": key or "<root>",
                "method": method,
                "modules": where,
                "spec": ts[0].spec.short(),
                "from": " > ".join(reversed(ts[0].layers)),
            })
        return rows


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
    return PlanError(
        f"plan key {key!r} ({layer}) matches no submodule of {type(root).__name__}. "
        f"Closest submodules / classes: {', '.join(close) or '(none)'}. "
        "Keys are dotted paths ('*' = one segment, '**' = one or more), '' for the root, or class names."
    )


def _method_error(key: str, path: str, module: nn.Module, method: str) -> PlanError:
    methods = [m for m in dir(type(module)) if not m.startswith("_") and callable(getattr(type(module), m, None))
               and not hasattr(nn.Module, m)]
    close = difflib.get_close_matches(method, methods + ["forward"], n=5, cutoff=0.4)
    return PlanError(
        f"plan key {key!r}: {type(module).__name__} at {path or '<root>'!r} has no method {method!r}. "
        f"Closest methods: {', '.join(close) or ', '.join(sorted(methods)[:8]) or 'forward'}."
    )


def resolve(root: nn.Module, layers: list[tuple[str, PlanLayer]]) -> ResolvedPlan:
    """Resolve stacked plan layers against `root` (see module docstring for the rules).

    If no layer has any entry, the engine default applies: the root module compiled with
    `TorchCompileSpec()` -- exactly `torch.compile(root)`.
    """
    unknown = [name for name, _ in layers if name not in LAYER_ORDER]
    if unknown:
        raise ValueError(f"unknown plan layer {unknown}; valid: {LAYER_ORDER}")
    if not any(layer for _, layer in layers):
        layers = [("engine default", PlanLayer(regions={"": TorchCompileSpec()}))]
    modules = dict(root.named_modules())
    # (path, method) -> list of (rank tuple, layer name, key, spec)
    found: dict[tuple[str, str], list[tuple[tuple, str, str, TorchCompileSpec]]] = {}
    for layer_name, layer in layers:
        rank = LAYER_ORDER.index(layer_name)
        for key, method, spec in layer.items_by_method():
            paths, by_path = match_key(root, key, modules)
            if not paths:
                raise _no_match_error(root, key, modules, layer_name)
            for path in paths:
                mod = modules[path]
                if not callable(getattr(mod, method, None)):
                    raise _method_error(key, path, mod, method)
                found.setdefault((path, method), []).append(
                    ((rank, *_specificity(key, by_path)), layer_name, key, spec)
                )
    targets = []
    order = {p: i for i, p in enumerate(modules)}
    for (path, method), cands in sorted(found.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
        cands.sort(key=lambda c: c[0])
        fields: dict = {}
        for _, _, _, spec in cands:
            fields.update(spec.explicit())
        layers_used = list(dict.fromkeys(c[1] for c in cands))
        targets.append(Target(path=path, method=method, module=modules[path],
                              spec=TorchCompileSpec(**fields), key=cands[-1][2], layers=layers_used))
    return ResolvedPlan(targets=targets)
