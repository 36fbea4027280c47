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

_ORIGINALS = "_magi_zoo_originals"  # instance attr: method name -> prior instance attr or None


def install(module: nn.Module, method: str, stats: RegionStats) -> None:
    """Compile `module.<method>` in place according to `stats.spec`."""
    originals: dict[str, Callable | None] = module.__dict__.setdefault(_ORIGINALS, {})
    if method in originals:
        raise RuntimeError(
            f"{type(module).__name__}.{method} already has a plan applied; "
            "call magi_zoo.engine.remove(module) before applying another"
        )
    originals[method] = module.__dict__.get(method)
    bound = getattr(module, method)
    spec = stats.spec
    fn = torch.compile(bound, **spec.compile_kwargs()) if spec.enabled else torch.compiler.disable(bound)
    # nn.Module.__setattr__ stores plain callables in the instance __dict__, which
    # shadows the class method: module(...) -> _call_impl -> self.forward -> wrapper.
    object.__setattr__(module, method, tracked(fn, stats))


def remove(root: nn.Module) -> int:
    """Undo every install under `root`; returns how many methods were restored."""
    n = 0
    for mod in root.modules():
        originals = mod.__dict__.pop(_ORIGINALS, None)
        if not originals:
            continue
        for method, prior in originals.items():
            if prior is None:
                mod.__dict__.pop(method, None)
            else:
                object.__setattr__(mod, method, prior)
            n += 1
    return n


def installed(root: nn.Module) -> list[tuple[str, str]]:
    """(path, method) pairs that currently carry a compiled wrapper."""
    return [(path, m) for path, mod in root.named_modules() for m in mod.__dict__.get(_ORIGINALS, {})]
