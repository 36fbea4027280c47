"""Compile strategies: install a resolved spec on one (submodule, method).

Every target is compiled *in place* by replacing the method on the instance with a
tracked wrapper around `torch.compile(bound_method, **spec)`. That one mechanism covers:

- per-method compile (`forward`, `decode`, `forward_batched`, ...);
- regional compile: a key that matches N instances of a block class installs N
  wrappers; dynamo caches compiled code on the method's code object and (with
  inlined nn.Modules, torch's default) guards on the block's type and tensor metadata,
  not its identity, so block 1..N-1 reuse block 0's code: compile cost does not grow
  with depth (tests assert 1 compiled frame for N blocks);
- whole-graph compile: the key "" (root) with `fullgraph=True`;
- `enabled=False`: `torch.compiler.disable` on the method (an outer compiled region
  then graph-breaks around it, as the old decorator did).

Module hooks stay outside the compiled method, as with `torch.compile(module.forward)`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .accounting import RegionStats, tracked
from .steps import StepContext, StepRecord, register_step

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
    fn = torch.compile(bound, **spec.compile_kwargs()) if spec.enabled else torch.compiler.disable(bound)
    # nn.Module.__setattr__ stores plain callables in the instance __dict__, which
    # shadows the class method: module(...) -> _call_impl -> self.forward -> wrapper.
    object.__setattr__(module, method, tracked(fn, stats))


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
    return [(path, m) for path, mod in root.named_modules() for m in mod.__dict__.get(_ORIGINALS, {})]


@register_step("compile")
def compile_step(ctx: StepContext) -> StepRecord:
    """Install every compile region of the plan; regions are booked for the report."""
    installed_on: list[nn.Module] = []
    try:
        for (key, method), targets in ctx.plan.regions().items():
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
