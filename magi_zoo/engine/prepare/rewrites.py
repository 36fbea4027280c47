"""The tree rewrites adapters' preparations are made of: an instance `forward` per module (a method
dynamo traces in place of the class's), and a processor class swapped in for another (the same
state, a forward that fuses more). Each returns the undo that restores the tree exactly."""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..steps import chain_undo
from .step import Preparation


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


def processor_preparation(name: str, why: str, transformers,
                          processor_class: Callable[[], type | tuple[type, ...]]) -> Preparation:
    """A preparation that swaps processor classes in (`swap_processors`): `processor_class()`, called
    at install (so a diffusers module the class subclasses is imported only when a plan installs
    it), returns a subclass of exactly one diffusers processor class -- or a tuple of them, one per
    processor class the model has (FLUX.2: its double- and single-stream blocks') -- each of which
    replaces its base under `transformers`; the undo restores the original processors."""

    def install(root: nn.Module):
        made = processor_class()
        classes = made if isinstance(made, tuple) else (made,)
        return chain_undo([swap_processors(transformers, cls.__base__, cls) for cls in classes])

    return Preparation(name, why, install)
