"""The one place that touches torch-private APIs (`torch._dynamo`, `torch._inductor`).

Each use says why no public API does the job. Everything here must work on torch 2.11
(the GPU image) and 2.13 (the CPU machines); where a private name may be missing the
code degrades to a smaller report rather than failing.
"""

from __future__ import annotations

import dataclasses
from typing import Any


# Why private: dynamo's counters are the only record of graphs, graph breaks and their
# reasons; torch's own tests read them the same way. There is no public equivalent.
from torch._dynamo.utils import counters as _counters

try:  # Why private: per-frame compile records (recompile reason, compile time, frame name).
    from torch._dynamo import utils as _dynamo_utils

    _get_metrics = _dynamo_utils.get_compilation_metrics
except (ImportError, AttributeError):  # pragma: no cover - older torch
    _dynamo_utils = None
    _get_metrics = None

# The records live in a deque of 64 by default; a pipeline with many regions compiles more
# frames than that between two snapshots, so keep more (a record is a few hundred bytes).
_METRICS_LIMIT = 100_000
if _dynamo_utils is not None and hasattr(_dynamo_utils, "set_compilation_metrics_limit"):
    _dynamo_utils.set_compilation_metrics_limit(_METRICS_LIMIT)


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
    # Read the newest record straight from dynamo's deque: copying the list on every
    # region call would cost O(records) on the hot path.
    records = getattr(_dynamo_utils, "_compilation_metrics", None)
    return CounterSnapshot(
        frames=int(_counters["frames"]["ok"]),
        graphs=int(_counters["stats"]["unique_graphs"]),
        graph_breaks=dict(_counters["graph_break"]),
        last_metric=records[-1] if records else None,
    )


def _metrics_since(last: Any) -> list[Any]:
    metrics = _get_metrics() if _get_metrics else []
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
    if _get_metrics is not None:
        # torch 2.13 no longer bumps counters["frames"] for fullgraph=True compiles, while
        # the compile records still say how many frames compiled successfully: count
        # from the records wherever they exist, so every region counts the same way.
        out.frames = ok_records
    return out


def reset_counters() -> None:
    """Zero dynamo's counters (torch's tests do this between cases)."""
    _counters.clear()
