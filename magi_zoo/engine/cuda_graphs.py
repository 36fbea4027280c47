"""The cuda_graphs step: capture whole calls of a method in CUDA graphs, with an exact undo.

For each enabled target of the ``cuda_graphs`` section the step replaces the instance's
method (whatever it is by then: the plain forward, or a compiled one) with a `GraphedCall`.
Per input signature (the tree of arguments; shape, dtype and device of each tensor; the
value of each plain argument; grad and inference mode) it runs `warmup` calls uncaptured on
a side stream (compilation, autotuning and cuBLAS/cuDNN workspaces happen there, never
during capture), captures one call into a `torch.cuda.CUDAGraph` reading static input
buffers, and from then on serves each call by copying the tensor arguments into those
buffers, replaying, and returning clones of the outputs. Clones, because a caller may keep
an output while calling again (classifier-free guidance calls the denoiser twice before
combining) and the next replay rewrites the graph's own output memory.

Why at the end of the apply order: the graph records everything the call launches -- the
compiled blocks, the eager code between them, the custom attention ops -- so it must wrap
the finished module. What cannot be recorded is refused at apply (`conflict`): step
caching (hooks decide in Python per call whether to run a block), streamed offload units
(copies scheduled from Python hooks between buffers that change), sequence/CFG parallelism
(collectives with per-call Python state), and compile regions inside that capture CUDA
graphs themselves (inductor's CUDA graph trees cannot nest in an outer capture). A user's
entry that meets one of these is an error; an entry only the shipped spec set (e.g. Flux's
on an H100) yields instead -- to the memory budget, the step cache or the training the user
chose -- and the report says which call is not captured and why.

The graphs of one module share one memory pool: replays run one at a time on one stream and
outputs are cloned before the next replay, so one graph's scratch memory may be another's.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

from ..specs.cuda_graph_spec import CudaGraphSpec
from .compat import torch as pytree
from .compile import cuda_graphs_by
from .resolve import PlanError, path_within, paths_related
from .steps import StepContext, StepRecord

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

    # -- the call ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by an outer compiled region: be the method
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


# -- apply ---------------------------------------------------------------------------------
def conflict(ctx: StepContext, t) -> str | None:
    """Why target `t` cannot be captured in this apply (module docstring), or None."""
    if ctx.profile.device != "cuda":
        return (f"CUDA graphs need a CUDA card, and the plan is applied for profile {ctx.profile.name!r} "
                f"({ctx.profile.device}); pick the card's profile (gpu=...)")
    if ctx.train:
        return "CUDA graph capture is inference-only and this is a training apply (train=True)"
    for (ckey, _), targets in ctx.plan.regions().items():
        by = cuda_graphs_by(targets[0].spec) if targets[0].spec.enabled else None
        if by and any(path_within(c.path, t.path) for c in targets):
            return (f"the compile region {ckey or '<root>'!r} inside it captures CUDA graphs itself ({by}); "
                    "graphs do not nest: use mode='default' or 'max-autotune-no-cudagraphs' there")
    for s in ctx.plan.section("step_cache").targets:
        if s.spec.method != "none" and paths_related(s.path, t.path):
            return (f"step caching ({s.spec.method!r} on {s.path or '<root>'!r}) decides in Python at every call "
                    "whether to run each block, and a graph replays one fixed decision: use one or the other")
    for s in ctx.plan.section("parallel").targets:
        if s.spec.active and paths_related(s.path, t.path):
            return (f"the parallel split on {s.path or '<root>'!r} runs collectives with per-call Python state, "
                    "which a graph cannot record here")
    from .offload import _host_held_paths, runtime

    rt = runtime(ctx.root)
    moving = sorted(p for p in (_host_held_paths(rt.plan) if rt is not None else ()) if path_within(p, t.path))
    if moving:
        return (f"{len(moving)} offload unit(s) inside it stream or move (e.g. {moving[0]!r}), their copies "
                "scheduled by Python hooks between changing buffers; raise the memory budget until they stay "
                "resident")
    return None


def _install(module: nn.Module, method: str, call: GraphedCall) -> None:
    table = module.__dict__.setdefault(_GRAPHED, {})
    if method in table:
        raise RuntimeError(f"{type(module).__name__}.{method} already has a CUDA graph installed; "
                           "call magi_zoo.remove(module) first")
    table[method] = (call, module.__dict__.get(method))
    object.__setattr__(module, method, call)


def _uninstall(module: nn.Module, method: str) -> None:
    table = module.__dict__.get(_GRAPHED, {})
    call, prior = table.pop(method)
    call.reset()
    if prior is None:
        module.__dict__.pop(method, None)
    else:
        object.__setattr__(module, method, prior)
    if not table:
        module.__dict__.pop(_GRAPHED, None)


def cuda_graphs_step(ctx: StepContext) -> StepRecord:
    """Install a `GraphedCall` on every enabled target; undo puts the methods back."""
    section = ctx.plan.section("cuda_graphs")
    done: list[tuple[nn.Module, str]] = []
    calls: dict[str, GraphedCall] = {}
    lines: list[str] = []

    def undo() -> None:
        for m, method in reversed(done):
            _uninstall(m, method)

    skipped: list[str] = []
    try:
        for (key, method), targets in section.regions().items():
            spec: CudaGraphSpec = targets[0].spec
            if not spec.enabled:
                continue
            n = 0
            for t in targets:
                label = (t.path or "<root>") + ("" if method == "forward" else f".{method}")
                why = conflict(ctx, t)
                if why is None and "user" not in t.layers:
                    dev = next((x.device.type for x in t.module.parameters()), "cuda")
                    why = f"its weights are on {dev}" if dev != "cuda" else None
                if why is not None:
                    if "user" in t.layers:  # the user asked for both: say so, change nothing
                        raise PlanError(f"cuda_graphs key {key!r}: {t.cls_name} at {t.path or '<root>'!r}: {why}; "
                                        "or drop the cuda_graphs entry")
                    # The shipped spec's default yields to what the user chose (a memory budget
                    # that streams, step caching, training, another card): said in the report.
                    skipped.append(f"{label} not captured ({why})")
                    continue
                call = GraphedCall(getattr(t.module, method), spec, label)
                _install(t.module, method, call)
                done.append((t.module, method))
                calls[label] = call
                n += 1
            if n:
                lines.append(f"{key or '<root>'}.{method} on {n} module(s) ({spec.short()})")
    except BaseException:
        undo()
        raise
    did = ("captured per input signature: " + "; ".join(lines)) if lines else "none (every call launches its kernels)"
    if skipped:
        did += "; the spec's " + "; ".join(skipped)
    details: dict[str, Any] = {"graphed": calls} if calls else {}
    if skipped:
        details["not_captured"] = skipped
    return StepRecord("cuda_graphs", did, undo, details)
