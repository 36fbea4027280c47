"""Compile counters: the test oracle and the report's source.

`snapshot()` reads dynamo's global counters; `delta(before)` says what happened since:
frames compiled, FX graphs, graph breaks with reasons, recompiles with reasons, compile
seconds split into dynamo / AOTAutograd / inductor. `expect(delta, frames=..., ...)`
asserts exact numbers. The raw private reads live in `compat.torch`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..compat import torch as compat


@dataclasses.dataclass(frozen=True)
class CounterSnapshot:
    """Dynamo's global counters at one instant."""

    frames: int
    graphs: int
    graph_breaks: dict[str, int]
    last_metric: Any  # identity of the newest compile record, to diff the record list


@dataclasses.dataclass
class CounterDelta:
    """What happened between two snapshots."""

    frames: int = 0  # frames dynamo compiled (1 per compile or recompile)
    graphs: int = 0  # FX graphs produced (a frame with graph breaks yields several)
    graph_breaks: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count
    recompiles: list[str] = dataclasses.field(default_factory=list)  # guard failure reasons
    compile_s: float = 0.0  # dynamo + backend wall time, from torch's compile records
    backend_s: float = 0.0  # of which AOTAutograd + inductor (the rest is dynamo tracing)
    inductor_s: float = 0.0  # of which inductor (code generation or its cache lookup)

    def __iadd__(self, other: "CounterDelta") -> "CounterDelta":
        self.frames += other.frames
        self.graphs += other.graphs
        for k, v in other.graph_breaks.items():
            self.graph_breaks[k] = self.graph_breaks.get(k, 0) + v
        self.recompiles += other.recompiles
        self.compile_s += other.compile_s
        self.backend_s += other.backend_s
        self.inductor_s += other.inductor_s
        return self

    def __sub__(self, other: "CounterDelta") -> "CounterDelta":
        breaks = {k: v - other.graph_breaks.get(k, 0) for k, v in self.graph_breaks.items()}
        rec = list(self.recompiles)
        for r in other.recompiles:
            if r in rec:
                rec.remove(r)
        return CounterDelta(
            frames=self.frames - other.frames,
            graphs=self.graphs - other.graphs,
            graph_breaks={k: v for k, v in breaks.items() if v > 0},
            recompiles=rec,
            compile_s=max(0.0, self.compile_s - other.compile_s),
            backend_s=max(0.0, self.backend_s - other.backend_s),
            inductor_s=max(0.0, self.inductor_s - other.inductor_s),
        )

    def breakdown(self) -> dict[str, float]:
        """Compile seconds split into dynamo tracing, AOTAutograd and inductor."""
        return {"dynamo": round(self.compile_s - self.backend_s, 3),
                "aot_autograd": round(self.backend_s - self.inductor_s, 3),
                "inductor": round(self.inductor_s, 3)}

    @property
    def n_graph_breaks(self) -> int:
        return sum(self.graph_breaks.values())


def snapshot() -> CounterSnapshot:
    """Read dynamo's counters now."""
    frames, graphs, breaks = compat.raw_counters()
    return CounterSnapshot(frames=frames, graphs=graphs, graph_breaks=breaks, last_metric=compat.newest_metric())


def _metrics_since(last: Any) -> list[Any]:
    metrics = compat.metrics()
    if last is None:
        return metrics
    for i in range(len(metrics) - 1, -1, -1):
        if metrics[i] is last:
            return metrics[i + 1 :]
    return metrics  # the record list was cleared (torch.compiler.reset) in between


def delta(before: CounterSnapshot, after: CounterSnapshot | None = None) -> CounterDelta:
    """Counters accumulated since `before`."""
    after = after or snapshot()
    if (after.frames, after.graphs, after.last_metric) == (before.frames, before.graphs, before.last_metric) \
            and after.graph_breaks == before.graph_breaks:
        return CounterDelta()  # nothing compiled: the common, hot case
    breaks = {
        k: v - before.graph_breaks.get(k, 0)
        for k, v in after.graph_breaks.items()
        if v - before.graph_breaks.get(k, 0) > 0
    }
    out = CounterDelta(
        frames=after.frames - before.frames,
        graphs=after.graphs - before.graphs,
        graph_breaks=breaks,
    )
    ok_records = 0
    for m in _metrics_since(before.last_metric):
        # Runtime and backward records are not frame compiles.
        if getattr(m, "is_runtime", False) or getattr(m, "is_forward", True) is False:
            continue
        if getattr(m, "co_name", None) is None:
            continue
        ok_records += getattr(m, "fail_type", None) is None
        out.compile_s += float(getattr(m, "entire_frame_compile_time_s", None) or 0.0)
        out.backend_s += float(getattr(m, "backend_compile_time_s", None) or 0.0)
        out.inductor_s += float(getattr(m, "inductor_compile_time_s", None) or 0.0)
        reason = getattr(m, "recompile_reason", None)
        if reason:
            out.recompiles.append(f"{m.co_name}: {reason.strip()}")
    if compat.HAS_METRICS:
        # torch 2.13 no longer bumps counters["frames"] for fullgraph=True compiles, while
        # the compile records still say how many frames compiled successfully: count
        # from the records wherever they exist, so every region counts the same way.
        out.frames = ok_records
    return out


def reset() -> None:
    """Zero dynamo's counters (torch's tests do this between cases)."""
    compat.clear_counters()


reset_counters = reset  # older name


def expect(d: CounterDelta, *, frames: int | None = None, graphs: int | None = None,
           breaks: int | None = None, recompiles: int | None = None) -> CounterDelta:
    """Assert exact counts on a delta (None = not checked); the error lists every
    mismatch with the break and recompile reasons, so a failing test says why."""
    got = {"frames": d.frames, "graphs": d.graphs, "breaks": d.n_graph_breaks, "recompiles": len(d.recompiles)}
    want = {"frames": frames, "graphs": graphs, "breaks": breaks, "recompiles": recompiles}
    bad = {k: (want[k], got[k]) for k in got if want[k] is not None and want[k] != got[k]}
    if bad:
        lines = [f"{k}: expected {w}, got {g}" for k, (w, g) in bad.items()]
        lines += [f"  break x{n}: {r}" for r, n in d.graph_breaks.items()]
        lines += [f"  recompile: {r}" for r in d.recompiles]
        raise AssertionError("compile counters differ:\n" + "\n".join(lines))
    return d
