"""The one place that touches torch-private APIs (`torch._dynamo`, `torch._inductor`).

Each use says why no public API does the job. Everything here must work on torch 2.11
(the GPU image) and 2.13 (the CPU machines); where a private name may be missing the
code degrades to a smaller report rather than failing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import torch
import torch._dynamo
import torch._inductor.config as _inductor_config
from torch._guards import TracingContext
from torch._logging._internal import trace_log
from torch.utils import _pytree

try:  # Why private: the options a compile mode stands for (inductor_mode_options below).
    from torch._inductor import list_mode_options as _list_mode_options
except ImportError:  # pragma: no cover - other torch
    _list_mode_options = None

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
    exc = sys.exc_info()[1]
    stack = getattr(exc, "real_stack", None)
    if not stack:
        try:
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
    torch._dynamo.mark_static_address(tensor, guard=False)



def inductor_mode_options(mode: str, dynamic: bool | None) -> dict[str, Any] | None:
    """The inductor config a `torch.compile(mode=...)` stands for, or None when this torch
    cannot say. Why private: `torch._inductor.list_mode_options` is where torch.compile itself
    turns a mode into options; needed to add options to a mode (torch.compile forbids both)."""
    if _list_mode_options is None:  # pragma: no cover - other torch
        return None
    return dict(_list_mode_options(mode, dynamic))


def compile_backends() -> list[str]:
    """The names torch.compile's `backend=` takes here ('inductor', 'aot_eager', 'eager', ...).
    Why private: `torch._dynamo.list_backends` is where torch.compile's registry is listed."""
    import torch._dynamo  # lazy: dynamo's import is heavy, and only a plan check needs the list

    return list(torch._dynamo.list_backends(exclude_tags=()))


def inductor_has_option(name: str) -> bool:
    """Whether this torch's inductor config has `name` (e.g. custom_should_partition_ops,
    added after graph partitioning). Why private: inductor's config module is its only record."""
    return hasattr(_inductor_config, name)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """torch's pytree flatten (leaves, spec): it opens tuples, lists, dicts and the output
    classes diffusers and transformers register (their outputs are pytree nodes)."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


# -- kernels: fp8 matmul, GEMM epilogue, attention backward (engine/precision, engine/kernels) ----------

def scaled_mm(a: Any, b: Any, *, scale_a: Any, scale_b: Any, out_dtype: Any, use_fast_accum: bool = False) -> Any:
    """a @ b for float8 operands with fp32 scales (row-wise here: a's per row, b's per column),
    accumulated in fp32 and written in `out_dtype`. Why private: `torch._scaled_mm` is the fp8 GEMM
    torchao and inductor call; the public `torch.nn.functional.scaled_mm` (newer torch) spells its
    scaling recipe with `F._ScalingType`, itself private. checked on: torch 2.11, 2.13"""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def addmm_gelu(bias: Any, x: Any, weight_t: Any) -> Any:
    """gelu(x @ weight_t + bias) as one cuBLASLt GEMM with the bias and GELU in its epilogue (on CUDA
    the tanh GELU: engine/kernels/gelu_linear.py). Why private: `torch._addmm_activation` is the only
    entry to cuBLASLt's epilogue; inductor does not move a GELU there. checked on: torch 2.11, 2.13"""
    return torch._addmm_activation(bias, x, weight_t, use_gelu=True)


def cudnn_attention_backward(grad_out: Any, query: Any, key: Any, value: Any, out: Any, lse: Any, philox_seed: Any,
                             philox_offset: Any, max_q: int, max_k: int, causal: bool, scale: float) -> tuple:
    """(dq, dk, dv) from cuDNN's fused attention backward, all (B, H, S, D), given the forward's
    output and its log-sum-exp (B, H, S, 1); no mask, no dropout. Why private:
    `aten._scaled_dot_product_cudnn_attention_backward` is what SDPA's cuDNN backend runs for its
    backward; no public op takes an output and LSE computed by another kernel. checked on: torch 2.11, 2.13"""
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, query, key, value, out, lse, philox_seed, philox_offset, None, None, None, max_q, max_k, 0.0,
        causal, scale=scale)


# -- recompute: pytree leaves, the dispatch-mode base class, checkpoint's hooks flag ------------
# (imported here, with the section that uses them: torch has imported these modules itself)
import inspect  # noqa: E402
from typing import Callable  # noqa: E402

from torch.utils import _pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402, F401
from torch.utils.checkpoint import checkpoint as _checkpoint  # noqa: E402

# `TorchDispatchMode`: the base class of a mode that sees every aten op as it dispatches
# (subclass it, define `__torch_dispatch__`, enter it with `with`): recompute's op recorder
# measures each op, adapters/fast_init splits large random fills. Why private: torch documents
# dispatch modes but ships the class only in `torch.utils._python_dispatch`.
# checked on: torch 2.11, 2.13.


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a pytree, in order (tuples, lists, dicts and registered output classes
    opened). Why private: `torch.utils._pytree` is how torch walks op arguments and outputs
    (what a dispatch mode receives); no public module exports it. checked on: torch 2.11, 2.13."""
    return _pytree.tree_leaves(tree)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """`tree` with every leaf replaced by `fn(leaf)`, same structure. Why private: as
    `tree_leaves`. checked on: torch 2.11, 2.13."""
    return _pytree.tree_map(fn, tree)


def _names_parameter(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False


# Decided once, at import: a signature does not change while the process runs.
_CHECKPOINT_HOOKS_KWARGS: dict[str, bool] = (
    {"respect_saved_tensors_hooks": False}
    if _names_parameter(_checkpoint, "respect_saved_tensors_hooks") else {})


def checkpoint_hooks_kwargs() -> dict[str, bool]:
    """Keyword arguments for `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`
    that keep today's behaviour under a surrounding `saved_tensors_hooks`: the outputs a
    selective checkpoint keeps bypass the hooks (recompute's `measure_options` relies on it:
    its pack hook sees what autograd saves, and `options` adds the eager selective outputs
    from the profile).

    Why here (version compat, not a private name): torch 2.14 added the tri-state
    `respect_saved_tensors_hooks` to `checkpoint` -- None (its default) keeps that behaviour
    but warns (FutureWarning) whenever a hook is in scope, and later releases make None an
    error, then flip the default to True; False is the same behaviour, silently, and a
    no-op for a plain (non-selective) checkpoint and under torch.compile. Passed only where
    this torch's `checkpoint` names the parameter: before 2.14 its `**kwargs` would hand
    the flag to the checkpointed function. `create_selective_checkpoint_contexts` takes no
    such parameter. checked on: torch 2.11, 2.13 (absent: nothing passed); 2.14 from its
    release notes and pytorch#191236, the rollout's tracking issue (present: False passed)."""
    return dict(_CHECKPOINT_HOOKS_KWARGS)


# -- adapters: Flux ----------------------------------------------------------------------------

def module_has_forward_hooks(module: Any) -> bool:
    """Whether `module` has forward or forward-pre hooks of its own (an offload or a parallel hook
    wraps its call: its weight may then not be used directly). Why private: `nn.Module` keeps them
    in `_forward_hooks` / `_forward_pre_hooks` and has no public way to list them.
    checked on: torch 2.11, 2.13"""
    return bool(module._forward_pre_hooks or module._forward_hooks)
