"""The report: what was applied where, and what torch did with it.

Live: it holds the regions' counters, which keep accumulating as the model runs, so
`report()` after a run shows compiles, graph breaks and recompiles of that run.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..resolve import ResolvedPlan
from .accounting import RegionStats
from .table import format_table


@dataclasses.dataclass
class Report:
    """Result of `magi_zoo.apply`: the steps taken, in order, and per-region counters."""

    steps: list  # StepRecords (step name, what it did, undo), in the fixed apply order
    regions: list[RegionStats]  # the compile section's regions, with live counters
    plan: ResolvedPlan | None = None  # what the resolver produced, every section
    profile: str | None = None  # the GPU profile the steps were told
    # What the model was built with before the steps, one line each, set by the caller (the
    # zoo: the LoRAs loaded, their scales and mode); the engine itself writes none.
    notes: list[str] = dataclasses.field(default_factory=list)

    def step(self, name: str):
        """The record of one step; unknown names list the steps that ran."""
        for s in self.steps:
            if s.step == name:
                return s
        raise KeyError(f"no step {name!r}; steps: {', '.join(s.step for s in self.steps)}")

    # -- totals ---------------------------------------------------------------------------
    @property
    def compile_s(self) -> float:
        return sum(r.counters.compile_s for r in self.regions)

    @property
    def graphs(self) -> int:
        return sum(r.counters.graphs for r in self.regions)

    @property
    def frames(self) -> int:
        return sum(r.counters.frames for r in self.regions)

    @property
    def graph_breaks(self) -> int:
        return sum(r.counters.n_graph_breaks for r in self.regions)

    @property
    def recompiles(self) -> int:
        return sum(len(r.counters.recompiles) for r in self.regions)

    def region(self, label: str) -> RegionStats:
        """The region with this label (key, or key.method); unknown labels list the real ones."""
        for r in self.regions:
            if label in (r.label, r.name):
                return r
        raise KeyError(f"no region {label!r}; regions: {', '.join(r.label for r in self.regions)}")

    # -- rendering ------------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        out = []
        for r in self.regions:
            c = r.counters
            n = len(r.modules)
            out.append({
                "region": r.label,
                "modules": r.modules[0] or "<root>" if n == 1 else f"{n} x {r.cls_name}",
                "spec": r.spec.short(),
                "calls": r.calls,
                "compile s": f"{c.compile_s:.2f}",
                "graphs": c.graphs,
                "breaks": c.n_graph_breaks,
                "recompiles": len(c.recompiles),
            })
        return out

    def table(self) -> str:
        return format_table(self.rows())

    def details(self) -> str:
        """Graph-break and recompile reasons, one per line."""
        lines = []
        for r in self.regions:
            for reason, n in r.counters.graph_breaks.items():
                lines.append(f"{r.label}: graph break x{n}: {reason}")
            for reason in r.counters.recompiles:
                lines.append(f"{r.label}: recompile: {reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "notes": list(self.notes),
            "steps": [s.to_dict() for s in self.steps],
            "regions": [r.to_dict() for r in self.regions],
            "totals": {"compile_s": round(self.compile_s, 3), "frames_compiled": self.frames,
                       "graphs": self.graphs, "graph_breaks": self.graph_breaks,
                       "recompiles": self.recompiles},
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str, **kw)

    def __str__(self) -> str:
        steps = "\n".join(f"  {i + 1}. {s.step}: {s.did}" for i, s in enumerate(self.steps))
        notes = "".join(f"{n}\n" for n in self.notes)
        text = f"{notes}apply steps (gpu profile {self.profile}):\n{steps}\n{self.table()}"
        details = self.details()
        return text + (f"\n{details}" if details else "")
