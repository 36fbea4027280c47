"""The compile step: install a resolved spec on one (submodule, method), and take it back.

Every target is compiled *in place* by replacing the method on the instance with a
tracked wrapper around `torch.compile(bound_method, **spec)`. That one mechanism covers:

- per-method compile (`forward`, `decode`, `forward_batched`, ...);
- regional compile: a key that matches N instances of a block class installs N
  wrappers; dynamo caches compiled code on the method's code object and (with
  inlined nn.Modules, torch's default) guards on the block's type and tensor metadata,
  not its identity, so block 1..N-1 reuse block 0's code: compile cost does not grow
  with depth (tests assert 1 compiled frame for N blocks);
- one block class at several call sites (Z-Image's refiners and main layers): each region
  compiles a copy of the method with a code object of its own (`region_method`), so
  dynamo keeps one cache per region, and a region keyed by path compiles once for its own
  inputs instead of recompiling the class's shared code for each site;
- whole-graph compile: the key "" (root) with `fullgraph=True`;
- `enabled=False`: `torch.compiler.disable` on the method (an outer compiled region
  then graph-breaks around it, as the old decorator did).

Module hooks stay outside the compiled method, as with `torch.compile(module.forward)`.
"""

from __future__ import annotations

import types
from typing import Callable

import torch
import torch.nn as nn

from ..compat import torch as tc
from ..custom_ops import list_custom_ops
from ..observe.accounting import RegionStats, tracked
from ..steps import StepContext, StepRecord

_ORIGINALS = "_magi_zoo_originals"  # instance attr: method name -> prior instance attr or None


def install(module: nn.Module, method: str, stats: RegionStats) -> None:
    """Compile `module.<method>` in place according to `stats.spec`."""
    originals: dict[str, Callable | None] = module.__dict__.setdefault(_ORIGINALS, {})
    if method in originals:
        raise RuntimeError(
            f"{type(module).__name__}.{method} already has a plan applied; "
            "call magi_zoo.remove(module) before applying another"
        )
    originals[method] = module.__dict__.get(method)
    bound = getattr(module, method)
    spec = stats.spec
    fn = torch.compile(region_method(bound, stats),
                       **partition_at_boundaries(spec.compile_kwargs(), boundary_ops_for(module))) \
        if spec.enabled else torch.compiler.disable(bound)
    # nn.Module.__setattr__ stores plain callables in the instance __dict__, which
    # shadows the class method: module(...) -> _call_impl -> self.forward -> wrapper.
    object.__setattr__(module, method, tracked(fn, stats))


# (the method's code, region key, method name) -> the copy of that code the region runs. Kept
# for the process, as the class's own code is: a second load of the same model reuses what
# the first compiled.
_REGION_CODES: dict[tuple[types.CodeType, str, str], types.CodeType] = {}


def region_method(bound: Callable, stats: RegionStats) -> Callable:
    """`bound` with a code object of `stats`'s region's own, when it is a class's method.

    Why: dynamo keeps compiled code (its guards, its recompile limit) on the code object it
    runs. Compiling `block.forward` itself puts every region of one class on one cache: a class
    called at several sites with other inputs (Z-Image's context refiner without modulation,
    its noise refiner on image tokens, its main layers on both) recompiles that shared code at
    each site, and each recompile is booked to whichever region called second. A copy of the
    method's function per region (same code, globals, defaults and closure; its own code
    object) gives each region its own cache; the N blocks of one region share it (dynamo
    guards on the block's type and tensors, not on which block), so a region keyed by path
    compiles once for its own inputs. The copy is the method itself, not a wrapper around it,
    so a graph break inside costs the frames plain `torch.compile` pays.

    A method installed on the instance (a preparation's or recompute's wrapper, whose code
    recompute may swap later) is compiled as it is."""
    func, owner = getattr(bound, "__func__", None), getattr(bound, "__self__", None)
    if not isinstance(func, types.FunctionType) or getattr(type(owner), stats.method, None) is not func:
        return bound
    key = (func.__code__, stats.name, stats.method)
    code = _REGION_CODES.get(key)
    if code is None:
        code = func.__code__.replace(co_qualname=f"{func.__qualname__} [{stats.label}]")
        _REGION_CODES[key] = code
    copy = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = func.__kwdefaults__, func.__qualname__
    copy.__dict__.update(func.__dict__)
    return types.MethodType(copy, owner)


def _family(module_name: str) -> str:
    """The package a Python module belongs to for boundary ops: magi_zoo.adapters.<family>,
    else its top-level package (a third-party adapter's own)."""
    parts = module_name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["magi_zoo", "adapters"] else parts[0]


def boundary_ops_for(module: nn.Module) -> list[str]:
    """The registered custom ops flagged `is_subgraph_boundary` by the family that defines
    `module`'s class (the ops its forward can call): a family's flag never changes how another
    family's regions compile."""
    family = _family(type(module).__module__)
    return sorted(i.name for i in list_custom_ops(is_subgraph_boundary=True)
                  if _family(tc.custom_op_module(i.op) or "") == family)


def partition_at_boundaries(kw: dict, ops: list[str]) -> dict:
    """The compile kwargs, with inductor's graph partition split at the custom ops `ops`
    (those flagged `is_subgraph_boundary`: the flag's reader) when the region captures CUDA
    graphs: such an op (varlen attention: lengths read on the host, data-dependent shapes)
    runs between the captured pieces instead of forcing the whole region out of CUDA graphs.
    Unchanged without cudagraphs, without such ops, or on a torch whose inductor lacks
    `custom_should_partition_ops`. torch.compile takes a mode or options, not both, so a
    mode becomes the options it stands for."""
    if not ops or kw.get("backend", "inductor") != "inductor" or \
            not tc.inductor_has_option("custom_should_partition_ops"):
        return kw
    options = dict(kw.get("options") or {})
    if kw.get("mode") is not None:
        base = tc.inductor_mode_options(kw["mode"], kw.get("dynamic"))
        if base is None:  # pragma: no cover - a torch that cannot expand a mode: leave it
            return kw
        options = {**base, **options}
    if not options.get("triton.cudagraphs"):  # the mode's own options say whether it captures
        return kw
    kw = {k: v for k, v in kw.items() if k != "mode"}
    options["graph_partition"] = True
    options["custom_should_partition_ops"] = sorted({*options.get("custom_should_partition_ops", ()), *ops})
    kw["options"] = options
    return kw


def _restore(mod: nn.Module) -> int:
    """Put back the methods `install` replaced on one module; returns how many."""
    originals = mod.__dict__.pop(_ORIGINALS, None) or {}
    for method, prior in originals.items():
        if prior is None:
            mod.__dict__.pop(method, None)
        else:
            object.__setattr__(mod, method, prior)
    return len(originals)


def uninstall_all(root: nn.Module) -> int:
    """Undo every compile install under `root`, whoever made it; returns how many methods."""
    return sum(_restore(mod) for mod in root.modules())


def installed(root: nn.Module) -> list[tuple[str, str]]:
    """(path, method) pairs that currently carry a compiled wrapper."""
    return [(path, m) for path, mod in root.named_modules() for m in compiled_methods(mod)]


def compiled_methods(module: nn.Module) -> list[str]:
    """The methods of this one module (not its children) that carry a compiled (or
    `enabled=False`) wrapper installed by the compile step."""
    return list(module.__dict__.get(_ORIGINALS, {}))


def cuda_graphs_by(spec) -> str | None:
    """What in a compile spec makes inductor capture CUDA graphs ("mode='reduce-overhead'",
    "options triton.cudagraphs"), or None when nothing does. The mode is expanded the way
    torch.compile expands it (`partition_at_boundaries` reads it the same way); an explicit
    option overrides the mode's."""
    options = spec.options or {}
    if "triton.cudagraphs" in options:
        return "options triton.cudagraphs" if options["triton.cudagraphs"] else None
    if spec.mode is None:
        return None
    expanded = tc.inductor_mode_options(spec.mode, spec.dynamic)
    captures = (expanded.get("triton.cudagraphs") if expanded is not None
                else spec.mode in ("reduce-overhead", "max-autotune"))  # a torch that cannot say
    return f"mode={spec.mode!r}" if captures else None


def _check_cuda_graphs(key: str, method: str, targets) -> None:
    """Refuse CUDA graphs on a region of several instances (repeated blocks). They share one
    compiled graph, and CUDA graph trees treat each call of it as a new replay that reuses
    the previous call's output memory: block i+1 then reads block i's output after block
    i+1's own replay overwrote it (measured on Flux.1-dev, H100, torch 2.11: "accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run" on the second block)."""
    spec = targets[0].spec
    by = cuda_graphs_by(spec) if len(targets) > 1 and spec.enabled and spec.backend == "inductor" else None
    if by:
        raise ValueError(
            f"compile region {key!r} ({method}, {len(targets)} instances) asks for CUDA graphs ({by}): "
            "repeated blocks share one graph and each replay overwrites the previous block's output. "
            "Use mode='default' or 'max-autotune-no-cudagraphs' on the blocks, or capture the whole "
            "model (a region of one instance, e.g. the transformer's forward or a step method)")


def compile_step(ctx: StepContext) -> StepRecord:
    """Install every compile region of the plan; regions are booked for the report."""
    installed_on: list[nn.Module] = []
    try:
        for (key, method), targets in ctx.plan.regions().items():
            _check_cuda_graphs(key, method, targets)
            t0 = targets[0]
            stats = RegionStats(name=key, method=method, spec=t0.spec, modules=[t.path for t in targets],
                                cls_name=t0.cls_name, layers=t0.layers)
            for t in targets:  # one spec per region: the resolver splits groups that differ
                install(t.module, method, stats)
                installed_on.append(t.module)
            ctx.regions.append(stats)
    except BaseException:
        for m in installed_on:
            _restore(m)
        raise
    n_on = sum(len(r.modules) for r in ctx.regions if r.spec.enabled)
    n_off = sum(len(r.modules) for r in ctx.regions if not r.spec.enabled)

    def undo() -> None:
        for m in installed_on:
            _restore(m)

    return StepRecord("compile", f"{n_on} method(s) compiled, {n_off} fenced off (enabled=False)", undo,
                      {"compiled": n_on, "disabled": n_off})
