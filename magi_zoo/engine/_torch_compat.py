"""The one place that touches torch-private APIs (`torch._dynamo`, `torch._inductor`).

Each use says why no public API does the job. Everything here must work on torch 2.11
(the GPU image) and 2.13 (the CPU machines); where a private name may be missing the
code degrades to a smaller report rather than failing.
"""

from __future__ import annotations

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



def raw_counters() -> tuple[int, int, dict[str, int]]:
    """(frames compiled ok, unique graphs, graph-break reason -> count) as dynamo counts them."""
    return (int(_counters["frames"]["ok"]), int(_counters["stats"]["unique_graphs"]),
            dict(_counters["graph_break"]))


def newest_metric() -> Any:
    """The newest per-frame compile record (identity only), read from dynamo's deque
    directly: copying the list on every region call would cost O(records) on the hot path."""
    records = getattr(_dynamo_utils, "_compilation_metrics", None)
    return records[-1] if records else None


def metrics() -> list[Any]:
    """Every per-frame compile record dynamo still holds, oldest first."""
    return _get_metrics() if _get_metrics else []


HAS_METRICS = _get_metrics is not None


def clear_counters() -> None:
    """Zero dynamo's counters (torch's tests do this between cases)."""
    _counters.clear()
