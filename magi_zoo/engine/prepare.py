"""Adapter graph preparation: model-specific changes that make a module tree compile well
(same values, better graphs), declared by the adapter and applied as the first step.

Examples: giving the first of a stack of repeated blocks the same input layout as the
others (one compile instead of two), or splitting one `forward` into named methods that
the plan can compile differently (a prompt-length prefill and a fixed-shape decode step).
They run before the plan is resolved, because a plan key may name a method they add.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch.nn as nn

from .steps import StepRecord, chain_undo


@dataclasses.dataclass(frozen=True)
class Preparation:
    """One declared preparation. `install(root)` changes the tree and returns its undo."""

    name: str
    why: str
    install: Callable[[nn.Module], Callable[[], None]]


def instance_forwards(modules, make: Callable[[nn.Module], Callable]) -> Callable[[], None]:
    """Give each module an instance `forward` (`make(module)`), which shadows its class's (nn.Module
    calls `self.forward`, and dynamo traces what it finds there). Returns the undo: each instance
    `forward` deleted, or the one a module had before put back."""
    priors = []
    for m in modules:
        priors.append((m, m.__dict__.get("forward")))
        object.__setattr__(m, "forward", make(m))

    def undo() -> None:
        for m, prior in reversed(priors):
            if prior is None:
                m.__dict__.pop("forward", None)
            else:
                object.__setattr__(m, "forward", prior)

    return undo


def swap_processors(transformers, base: type, cls: type) -> Callable[[], None]:
    """Put a `cls` processor (a subclass of `base`) in place of every processor of exactly type
    `base` under `transformers` -- one a user or another library installed (an IP-adapter's, say)
    is left alone -- carrying over its state (attention backend, parallel config, as set so far).
    Returns the undo: the original processors back, as they were."""
    swapped: list[tuple[nn.Module, object]] = []
    for tr in transformers:
        for m in tr.modules():
            proc = getattr(m, "processor", None)
            if type(proc) is not base:
                continue
            new = cls.__new__(cls)
            new.__dict__.update(proc.__dict__)
            m.processor = new
            swapped.append((m, proc))

    def undo() -> None:
        # what later steps set on the new processors (backend, parallel config) was undone by
        # their own undos first
        for m, proc in reversed(swapped):
            m.processor = proc

    return undo


def prepare(root: nn.Module, preparations: list[Preparation]) -> StepRecord:
    """Install every preparation (the `prepare` step); the record's undo removes them."""
    undos, done = [], []
    try:
        for p in preparations:
            undos.append(p.install(root))
            done.append(p.name)
    except BaseException:
        chain_undo(undos)()
        raise
    did = "; ".join(f"{p.name}: {p.why}" for p in preparations) if preparations else "none declared"
    return StepRecord("prepare", did, chain_undo(undos), {"preparations": done})
