"""`apply`: the one function that applies a plan to a module tree, in a fixed order."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..specs.plan import as_layers, attention_backend as layers_attention
from .accounting import RegionStats
from .compile import install, remove
from .custom_ops import list_custom_ops
from .report import Report
from .resolve import ResolvedPlan, resolve


def _attention_step(root: nn.Module, backend: str | None) -> str:
    ops = ", ".join(i.name for i in list_custom_ops()) or "none"
    if backend is None:
        return f"attention backend unchanged; custom ops registered: {ops}"
    done = []
    for path, mod in root.named_modules():
        setter = getattr(mod, "set_attention_backend", None)  # diffusers ModelMixin
        if callable(setter) and not any(path.startswith(p + ".") for p in done if p):
            setter(backend)
            done.append(path)
    if not done:
        raise ValueError(
            f"attention_backend={backend!r}: no submodule supports set_attention_backend "
            "(a diffusers model); leave attention_backend=None for this module"
        )
    return f"attention backend {backend!r} on {', '.join(p or '<root>' for p in done)}; custom ops: {ops}"


def apply(module: nn.Module, plan: Any = None, *, gpu: str | None = None, layers=None) -> Report:
    """Apply a plan in place to any `nn.Module` tree and return a live `Report`.

    `plan` is a dict (key -> spec or {method: spec}), a `PlanLayer`, a `SpecFile`, or a
    path to a TOML spec file (its `[default]` plus `[gpu.<gpu>]` sections). `layers`
    instead takes pre-stacked ``[(layer name, PlanLayer), ...]`` (what `magi_zoo.load`
    passes). An empty plan means the engine default: `torch.compile(module)`.

    The order is fixed, and this is the only place that encodes it:

    1. attention / custom ops -- they change which ops the graphs contain, so they must
       be in place before anything is traced;
    2. activation recompute -- wraps blocks in checkpointing, which must sit *inside* the
       compiled regions so the compiler sees the recompute (no plan field yet: no-op);
    3. compile -- installs the compiled methods (compilation itself happens lazily, on
       the first call, and is booked to each region's counters);
    4. weight offload -- hooks that move weights must wrap the compiled regions, never be
       traced into them (no plan field yet: no-op).

    Applying twice first removes the earlier plan, so the result never stacks wrappers.
    """
    if layers is None:
        layers = as_layers(plan if plan is not None else {}, gpu=gpu)
    elif plan is not None:
        raise TypeError("pass either plan= or layers=, not both")
    resolved: ResolvedPlan = resolve(module, layers)
    steps = [("attention/custom ops", _attention_step(module, layers_attention(layers))),
             ("recompute", "none requested")]
    removed = remove(module)
    regions: list[RegionStats] = []
    for (key, method), targets in resolved.regions().items():
        t0 = targets[0]
        stats = RegionStats(name=key, method=method, spec=t0.spec, modules=[t.path for t in targets],
                            cls_name=t0.cls_name, layers=t0.layers)
        for t in targets:  # one spec per region: the resolver splits groups that differ
            install(t.module, method, stats)
        regions.append(stats)
    n_on = sum(len(r.modules) for r in regions if r.spec.enabled)
    n_off = sum(len(r.modules) for r in regions if not r.spec.enabled)
    steps.append(("compile", f"{n_on} method(s) compiled, {n_off} fenced off (enabled=False)"
                  + (f"; replaced an earlier plan on {removed}" if removed else "")))
    steps.append(("offload", "none requested"))
    return Report(steps=steps, regions=regions, plan=resolved)
