"""`GraphedCall`: a method served from CUDA graphs, one per input signature, and its
install / uninstall on a module instance (the cuda_graphs step decides where).

Per input signature (the tree of arguments; shape, dtype and device of each tensor; the
value of each plain argument; grad and inference mode) a `GraphedCall` runs `warmup` calls
uncaptured on a side stream (compilation, autotuning and cuBLAS/cuDNN workspaces happen
there, never during capture), captures one call into a `torch.cuda.CUDAGraph` reading
static input buffers, and from then on serves each call by copying the tensor arguments
into those buffers, replaying, and returning clones of the outputs. Clones, because a
caller may keep an output while calling again (classifier-free guidance calls the denoiser
twice before combining) and the next replay rewrites the graph's own output memory.

The graphs of one module share one memory pool: replays run one at a time on one stream and
outputs are cloned before the next replay, so one graph's scratch memory may be another's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ...specs.cuda_graph_spec import CudaGraphSpec
from ..compat import torch as pytree

_GRAPHED = "_magi_zoo_graphed"  # instance attr: method name -> (GraphedCall, prior instance attr or None)
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclasses.dataclass
class _Graph:
    """One captured call: its graph, the static input leaves it reads, its outputs."""

    graph: Any
    inputs: list  # flattened (args, kwargs); tensors are the graph's input buffers
    outputs: list  # flattened outputs (tensors live in the graph's pool)
    out_spec: Any
    capture_s: float


class GraphedCall:
    """A method served from CUDA graphs, one per input signature (module docstring).

    `stats()` says what happened: graphs captured, replays, calls that ran uncaptured and
    why. `reset()` drops every graph (after the weights were replaced in place, say), so the
    next call captures again.
    """

    def __init__(self, fn: Callable, spec: CudaGraphSpec, where: str):
        self.fn = fn
        self.spec = spec
        self.where = where
        self.graphs: dict[Any, _Graph] = {}
        self.replays = 0
        self.uncaptured: dict[str, int] = {}
        self.refused: dict[Any, str] = {}  # signatures whose outputs a graph cannot serve
        self._pool = None
        self._warned: set[str] = set()
        self._bypass = 0  # > 0 inside bypassed(): calls run the method itself, uncounted

    # -- the call ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._bypass or torch.compiler.is_compiling():  # bypassed, or traced by an outer region
            return self.fn(*args, **kwargs)
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        key, why = self._signature(leaves, in_spec)
        if why is None:
            why = self.refused.get(key)
        if why is None and key not in self.graphs and len(self.graphs) >= self.spec.max_graphs:
            why = (f"more input signatures than max_graphs={self.spec.max_graphs} (raise max_graphs, "
                   "or keep shapes and plain arguments fixed between calls)")
        if why is not None:
            return self._uncaptured(why, args, kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, leaves, in_spec)
            if entry is None:  # the outputs cannot be served from a graph
                return self._uncaptured(self.refused[key], args, kwargs)
        for static, new in zip(entry.inputs, leaves):
            if isinstance(static, torch.Tensor) and static is not new:
                static.copy_(new)
        entry.graph.replay()
        self.replays += 1
        outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in entry.outputs]
        return pytree.tree_unflatten(outs, entry.out_spec)

    def _signature(self, leaves: list, in_spec: Any) -> tuple[Any, str | None]:
        """The graph key of a call, or (None, why it cannot be captured)."""
        if torch.is_grad_enabled():
            return None, "autograd is on (call under torch.no_grad() or torch.inference_mode())"
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None, "called inside another CUDA graph capture"
        parts: list = []
        cuda = False
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.device.type != "cuda":
                    return None, f"a tensor argument is on {leaf.device.type} (graphs capture CUDA work)"
                cuda = True
                parts.append((tuple(leaf.shape), leaf.dtype, leaf.device.index))
            elif isinstance(leaf, _PLAIN):
                parts.append((type(leaf).__name__, leaf))
            else:
                return None, (f"an argument of type {type(leaf).__name__} (only tensors and plain values "
                              "can be keyed and copied)")
        if not cuda:
            return None, "no CUDA tensor argument"
        return (str(in_spec), tuple(parts), torch.is_inference_mode_enabled()), None

    def _uncaptured(self, why: str, args: tuple, kwargs: dict) -> Any:
        self.uncaptured[why] = self.uncaptured.get(why, 0) + 1
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"magi_zoo cuda_graphs on {self.where}: a call ran uncaptured: {why}",
                          RuntimeWarning, stacklevel=3)
        return self.fn(*args, **kwargs)

    # -- capture ----------------------------------------------------------------------
    def _capture(self, key: Any, leaves: list, in_spec: Any) -> _Graph | None:
        t0 = time.perf_counter()
        # Input buffers laid out like the first call's tensors (clone keeps dense strides,
        # which the compiled code inside sees at warm-up); later calls are copied into them.
        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(static, in_spec)
        device = next(x.device for x in static if isinstance(x, torch.Tensor))
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.spec.warmup):
                self.fn(*args, **kwargs)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self.fn(*args, **kwargs)
        except Exception as e:
            raise RuntimeError(
                f"magi_zoo cuda_graphs on {self.where}: capturing a call failed ({type(e).__name__}: {e}). "
                "The method does something a CUDA graph cannot record (a host sync such as .item() or "
                ".cpu(), a data-dependent shape, a collective); drop its cuda_graphs entry") from e
        outputs, out_spec = pytree.tree_flatten(out)
        odd = [type(o).__name__ for o in outputs if not isinstance(o, (torch.Tensor, *_PLAIN))]
        if odd:  # an output object pytree cannot open would hand out the graph's own memory
            self.refused[key] = (f"an output of type {odd[0]} (outputs must be tensors in tuples, lists, "
                                 "dicts or registered output classes)")
            return None
        entry = _Graph(graph, static, outputs, out_spec, time.perf_counter() - t0)
        self.graphs[key] = entry
        return entry

    # -- bookkeeping --------------------------------------------------------------------
    def reset(self) -> None:
        """Drop every captured graph (and its memory); the next call captures again."""
        self.graphs.clear()
        self.refused.clear()
        self._pool = None

    def stats(self) -> dict[str, Any]:
        return {
            "graphs": len(self.graphs),
            "replays": self.replays,
            "uncaptured": dict(self.uncaptured),  # reason -> calls
            "capture_s": round(sum(g.capture_s for g in self.graphs.values()), 3),  # warm-up calls included
        }

    def __repr__(self) -> str:
        return f"GraphedCall({self.where}: {self.stats()})"


def graphed(module: nn.Module, method: str = "forward") -> GraphedCall | None:
    """The `GraphedCall` serving `module.<method>`, if a plan installed one."""
    entry = module.__dict__.get(_GRAPHED, {}).get(method)
    return entry[0] if entry else None


@contextlib.contextmanager
def bypassed(root: nn.Module) -> Iterator[list[GraphedCall]]:
    """Within the block, every method a plan serves from CUDA graphs under `root` runs the
    method itself: Python runs, so forward hooks fire and per-module timings mean something
    (a replay runs none of it). Graphs stay captured and the calls are not counted as
    uncaptured; on exit replays resume. Yields the calls it bypassed."""
    calls = [c for m in root.modules() for c, _ in m.__dict__.get(_GRAPHED, {}).values()]
    for c in calls:
        c._bypass += 1
    try:
        yield calls
    finally:
        for c in calls:
            c._bypass -= 1


def install(module: nn.Module, method: str, call: GraphedCall) -> None:
    """Serve `module.<method>` from `call` (an instance attribute; the prior one is kept for
    `uninstall`)."""
    table = module.__dict__.setdefault(_GRAPHED, {})
    if method in table:
        raise RuntimeError(f"{type(module).__name__}.{method} already has a CUDA graph installed; "
                           "call magi_zoo.remove(module) first")
    table[method] = (call, module.__dict__.get(method))
    object.__setattr__(module, method, call)


def uninstall(module: nn.Module, method: str) -> None:
    """Put back what `install` replaced, dropping the graphs."""
    table = module.__dict__.get(_GRAPHED, {})
    call, prior = table.pop(method)
    call.reset()
    if prior is None:
        module.__dict__.pop(method, None)
    else:
        object.__setattr__(module, method, prior)
    if not table:
        module.__dict__.pop(_GRAPHED, None)
