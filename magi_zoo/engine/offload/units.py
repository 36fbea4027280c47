"""Offload units in a module tree: which modules the plan lets stream, the tensors each
owns, their sizes and groups, and the planner run on them (`plan_units`).

A unit is a module the `offload` section names (a repeated block class, a whole
component); it owns its parameters and buffers except those under a nested unit. Units of
one component (phase), class and layout form a group that shares device buffers. Works on
meta-device trees: only sizes are read, so `load` can plan before building on the card.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from .plan import GIB, OffloadPlan, Unit
from .planner import plan_offload


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # works on meta tensors too


def resident_bytes(root: nn.Module, device_type: str) -> int:
    """Bytes of parameters and buffers on `device_type` under `root` (shared tensors once)."""
    seen, total = set(), 0
    for t in [*root.parameters(), *root.buffers()]:
        if t.device.type == device_type and id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


# -- which tensors belong to which unit -------------------------------------------------------

@dataclasses.dataclass
class UnitSpec:
    """A unit found in the tree: its module and the tensors it owns (not a nested unit's)."""

    path: str
    module: nn.Module
    mode: str
    once: bool
    tensors: list[torch.Tensor]  # parameters and buffers, each once
    layout: tuple  # ((shape, dtype) per tensor): units with one layout share buffers
    phase_activation_gib: float | None = None  # its phase's activation peak, when above the plan-wide reserve

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for t in self.tensors)


def owned_tensors(module: nn.Module, path: str, unit_paths: set[str]) -> list[torch.Tensor]:
    """Tensors under `module` not under a nested unit (each once, in registration order)."""
    out, seen = [], set()
    for sub_path, sub in module.named_modules(prefix=path):
        owner = sub_path
        while owner != path and owner not in unit_paths:  # the nearest unit at or above sub
            owner = owner.rpartition(".")[0]
        if owner != path:
            continue
        # Its own tensors only (recurse=False): those of its children are theirs, checked
        # against the units in turn.
        for t in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def find_units(ctx_plan, root: nn.Module) -> tuple[list[UnitSpec], dict[str, Any]]:
    """The units the resolved offload section names, in execution (tree) order, and the
    plan-wide settings of the root key. Errors: a unit field on the root, a plan-wide field
    on a unit, a unit with no weights."""
    section = ctx_plan.section("offload")
    settings: dict[str, Any] = {}
    chosen = []
    for t in section.targets:
        spec = t.spec
        if t.path == "":
            if "mode" in spec.model_fields_set:
                raise ValueError("offload key '' (the root): the root is never a unit; set mode on the blocks "
                                 "or components that may stream (e.g. WanTransformerBlock = 'auto')")
            settings = spec.root_fields()
            if spec.phase_activation_gib is not None:
                raise ValueError("offload key '' (the root): phase_activation_gib belongs to a unit (the peak "
                                 "while its component runs); the plan-wide reserve is activation_gib")
            continue
        wrong = spec.root_fields()
        if wrong:
            raise ValueError(f"offload key {t.key!r}: {', '.join(wrong)} apply to the whole plan; set them on "
                             "the root key '' (e.g. load(..., memory_budget_gib=24) or [default.offload] \"\" = "
                             "{ memory_budget_gib = 24 })")
        chosen.append(t)
    paths = {t.path for t in chosen}
    units = []
    for t in chosen:
        tensors = owned_tensors(t.module, t.path, paths)
        if not tensors:
            continue  # a component whose weights all sit in nested units
        units.append(UnitSpec(t.path, t.module, t.spec.mode, t.spec.once, tensors,
                              tuple((tuple(x.shape), x.dtype) for x in tensors), t.spec.phase_activation_gib))
    return units, settings


def group_labels(units: list[UnitSpec]) -> dict[str, str]:
    """unit path -> group label: units of one component (phase), class and layout share
    buffers. The label is the class name, suffixed '#k' when one class has several layouts,
    and prefixed 'component/' when the class appears in several components (Wan2.2's two
    experts each get their own buffers: they run in different phases)."""
    keys: dict[str, tuple] = {}
    layouts: dict[str, list[tuple]] = {}
    phases: dict[str, set[str]] = {}
    for u in units:
        cls = type(u.module).__name__
        seen = layouts.setdefault(cls, [])
        if u.layout not in seen:
            seen.append(u.layout)
        phases.setdefault(cls, set()).add(phase_of(u.path))
        keys[u.path] = (cls, seen.index(u.layout))
    out = {}
    for u in units:
        cls, i = keys[u.path]
        label = cls if i == 0 else f"{cls}#{i}"
        out[u.path] = f"{phase_of(u.path)}/{label}" if len(phases[cls]) > 1 else label
    return out


def phase_of(path: str) -> str:
    """The component a unit runs in (its first path segment): units of different components
    never run interleaved."""
    return path.split(".")[0]


def plan_units(root: nn.Module, resolved_plan, profile, *, budget_gib: float | None = None,
               times_s: dict[str, float] | None = None) -> tuple[OffloadPlan | None, list[UnitSpec], list[Unit], dict]:
    """Measure the units and run the planner. Returns (plan or None when the section names no
    unit, unit specs, planner units, settings). Works on meta-device trees (sizes only)."""
    specs, settings = find_units(resolved_plan, root)
    if not specs:
        return None, [], [], settings
    budget = budget_gib if budget_gib is not None else settings.get("memory_budget_gib") or profile.memory_gib
    activation = settings.get("activation_gib")
    activation = 0.1 * budget if activation is None else activation
    groups = group_labels(specs)
    owned = {id(t) for u in specs for t in u.tensors}
    fixed, seen = 0, set()
    for t in [*root.parameters(), *root.buffers()]:
        if id(t) not in owned and id(t) not in seen:
            seen.add(id(t))
            fixed += tensor_bytes(t)
    units = [Unit(u.path, u.nbytes, groups[u.path], phase_of(u.path), u.mode, (times_s or {}).get(u.path), u.once,
                  None if u.phase_activation_gib is None else int(u.phase_activation_gib * GIB))
             for u in specs]
    plan = plan_offload(units, fixed_bytes=fixed, activation_bytes=int(activation * GIB),
                        budget_bytes=int(budget * GIB), **planner_settings(settings))
    return plan, specs, units, {**settings, "memory_budget_gib": budget, "activation_gib": activation}


def planner_settings(settings: dict) -> dict[str, Any]:
    """The offload root's settings `plan_offload` takes (copy rate, prefetch depth, phase
    residency), defaults filled in: one reading for the first plan and every refit."""
    return {"bandwidth_bytes_s": settings.get("host_bandwidth_gbs", 55.0) * 1e9,
            "prefetch": settings.get("prefetch", 1), "phase_residency": settings.get("phase_residency", False)}


def streaming_plan(root: nn.Module, resolved_plan, profile) -> OffloadPlan | None:
    """The offload plan of a resolved plan on a tree (typically built on the meta device:
    sizes only) when it streams anything, else None."""
    plan, _, _, _ = plan_units(root, resolved_plan, profile)
    return plan if plan is not None and plan.streams else None
