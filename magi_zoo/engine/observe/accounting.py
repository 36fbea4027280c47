"""Per-region accounting of dynamo's counters.

Every compiled region is entered through a thin wrapper that snapshots dynamo's global
counters around the call and books the difference to the region. Regions nest (a whole
model compiled around regionally compiled blocks, or a block running eagerly after a
graph break of its parent): each region books only its *exclusive* share, so totals add
up. Inside a trace (`torch.compiler.is_compiling()`), the wrapper is a plain call, so
dynamo traces straight through it and no graph break is added.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

import torch

from ...specs.compile_spec import TorchCompileSpec
from . import counters as dynamo_counters  # the field `RegionStats.counters` keeps the short name


@dataclasses.dataclass
class RegionStats:
    """Everything the report says about one region."""

    name: str  # the plan key that won, "" = root
    method: str
    spec: TorchCompileSpec
    modules: list[str]
    cls_name: str
    layers: list[str]
    calls: int = 0
    counters: dynamo_counters.CounterDelta = dataclasses.field(default_factory=dynamo_counters.CounterDelta)

    @property
    def label(self) -> str:
        where = self.name or "<root>"
        return where if self.method == "forward" else f"{where}.{self.method}"

    def to_dict(self) -> dict[str, Any]:
        c = self.counters
        return {
            "region": self.label,
            "modules": list(self.modules),
            "class": self.cls_name,
            "spec": self.spec.model_dump(),
            "from": list(self.layers),
            "calls": self.calls,
            "compile_s": round(c.compile_s, 3),
            "compile_breakdown_s": c.breakdown(),
            "frames_compiled": c.frames,
            "graphs": c.graphs,
            "graph_breaks": c.n_graph_breaks,
            "graph_break_reasons": dict(c.graph_breaks),
            "recompiles": len(c.recompiles),
            "recompile_reasons": list(c.recompiles),
        }


class _Frame:
    __slots__ = ("before", "children")

    def __init__(self, before: dynamo_counters.CounterSnapshot):
        self.before = before
        self.children = dynamo_counters.CounterDelta()


_local = threading.local()


def _stack() -> list[_Frame]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def tracked(fn: Callable, stats: RegionStats) -> Callable:
    """Wrap `fn` so that each eager-level call books its counter deltas to `stats`."""

    def region_call(*args, **kwargs):
        if torch.compiler.is_compiling():  # constant-folded by dynamo: no graph break
            return fn(*args, **kwargs)
        stack = _stack()
        frame = _Frame(dynamo_counters.snapshot())
        stack.append(frame)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()
            stats.calls += 1
            total = dynamo_counters.delta(frame.before)
            stats.counters += total - frame.children
            if stack:
                stack[-1].children += total

    region_call.__wrapped__ = fn  # type: ignore[attr-defined]
    region_call.__name__ = getattr(fn, "__name__", "region_call")
    return region_call
