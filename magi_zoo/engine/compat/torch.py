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


# -- explain: torch's structured compile trace, read in-process -------------------------------

def structured_trace(handler: "logging.Handler"):
    """Context manager: `handler` receives torch's structured compile records while open.

    Why private: `torch._logging.trace_structured` (what TORCH_TRACE / tlparse read) emits
    each record on the logger `torch._logging._internal.trace_log` ("torch.__trace"), with
    the event as `record.metadata` (a dict) and its text as `record.payload`; torch emits
    only while that logger has a handler. There is no public way to receive the records in
    process (TORCH_TRACE is read once at import), so we attach a handler for the call.
    Same logger and record shape on torch 2.11 and 2.13.
    """
    import contextlib
    import logging

    from torch._logging._internal import trace_log

    @contextlib.contextmanager
    def _cm():
        old_level = trace_log.level
        trace_log.setLevel(logging.DEBUG)
        trace_log.addHandler(handler)
        try:
            yield
        finally:
            trace_log.removeHandler(handler)
            trace_log.setLevel(old_level)

    return _cm()


def graph_break_in_flight() -> tuple[list[Any], BaseException | None]:
    """(user stack as FrameSummary list, the exception) of the graph break dynamo is logging
    right now (call from a structured-trace handler on a `dynamo_graph_break_reason` record).

    Why private: dynamo logs a graph break from inside the `except` of its
    `torch._dynamo.exc.Unsupported`, whose `real_stack` is the user's stack at the break
    (what its own message prints); otherwise `torch._guards.TracingContext.extract_stack()`
    is where dynamo itself reads it. Reading the structured stack avoids parsing the text.
    """
    import sys

    exc = sys.exc_info()[1]
    stack = getattr(exc, "real_stack", None)
    if not stack:
        try:
            from torch._guards import TracingContext

            stack = TracingContext.extract_stack()
        except Exception:  # pragma: no cover - no tracing context
            stack = []
    return list(stack or []), exc


def custom_op_module(op: Any) -> str | None:
    """The module that defined a `torch.library.custom_op`'s Python function (which family
    registered it), or None.

    Why private: `CustomOpDef` keeps the decorated function as `_init_fn` and has no
    public accessor (same attribute on torch 2.11 and 2.13).
    """
    fn = getattr(op, "_init_fn", None)
    return getattr(fn, "__module__", None)


def mark_static_address(tensor: Any) -> None:
    """Tell the compiler a tensor passed as an argument keeps its address across calls (a
    static KV cache). Why private: CUDA graphs (mode="reduce-overhead") allow in-place
    writes only to inputs with a static address -- parameters and buffers are marked by
    dynamo itself, a cache handed over as an argument needs `torch._dynamo.mark_static_address`,
    which has no public equivalent in torch.compiler (2.11-2.13). guard=False: no recompile
    if the address changes (CUDA graphs re-record instead)."""
    import torch._dynamo

    torch._dynamo.mark_static_address(tensor, guard=False)



def inductor_mode_options(mode: str, dynamic: bool | None) -> dict[str, Any] | None:
    """The inductor config a `torch.compile(mode=...)` stands for, or None when this torch
    cannot say. Why private: `torch._inductor.list_mode_options` is where torch.compile itself
    turns a mode into options; needed to add options to a mode (torch.compile forbids both)."""
    try:
        from torch._inductor import list_mode_options
    except ImportError:  # pragma: no cover - other torch
        return None
    return dict(list_mode_options(mode, dynamic))


def inductor_has_option(name: str) -> bool:
    """Whether this torch's inductor config has `name` (e.g. custom_should_partition_ops,
    added after graph partitioning). Why private: inductor's config module is its only record."""
    import torch._inductor.config as config

    return hasattr(config, name)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """torch's pytree flatten (leaves, spec): it opens tuples, lists, dicts and the output
    classes diffusers and transformers register (their outputs are pytree nodes)."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)
