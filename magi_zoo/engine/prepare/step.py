"""`prepare`, the first step: install the adapter's declared graph preparations, before the
plan is resolved (a plan key may name a method one adds); its record's undo removes them."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch.nn as nn

from ..steps import StepRecord, chain_undo


@dataclasses.dataclass(frozen=True)
class Preparation:
    """One declared preparation. `install(root)` changes the tree and returns its undo."""

    name: str
    why: str
    install: Callable[[nn.Module], Callable[[], None]]


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
