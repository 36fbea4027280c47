"""The step protocol: what each engine module contributes to `apply`.

A step is a function ``(ctx: StepContext) -> StepRecord``, named with its place in
`apply.STEP_ORDER` (the table there is the only place that lists the steps). It reads the resolved plan (its own section) and the GPU profile,
changes the module tree in place, and returns a record: one line for the report and an
undo that restores exactly what it changed, so `remove()` can take every step back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.nn as nn

from ..specs.gpu_profiles import GpuProfile
from .resolve import ResolvedPlan


@dataclasses.dataclass
class StepRecord:
    """What one step did: a line for the report, details for `to_dict`, and its undo."""

    step: str
    did: str
    undo: Callable[[], None] | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "did": self.did, **({"details": self.details} if self.details else {})}


@dataclasses.dataclass
class StepContext:
    """Everything a step is told, and the facts steps hand on to the steps after them.

    A cross-step fact is written by the step that made it true and read by later steps (in
    `STEP_ORDER`), so no step reads another's internals (docs/steps.md). Module paths are
    as in the plan ("" is the root)."""

    root: nn.Module
    plan: ResolvedPlan
    profile: GpuProfile
    regions: list = dataclasses.field(default_factory=list)  # compile regions (RegionStats), for the report
    train: bool = False  # a training apply: steps keep what backward needs (e.g. attention with a backward)
    # False: a step that replaces weights (precision's fp8 linears) drops the originals instead of
    # keeping a host copy for its undo, which then leaves the replacements in place (`apply`'s doc).
    keep_originals: bool = True
    # Written by step_cache: path of each model whose calls a step cache now decides -> the method.
    step_cached: dict[str, str] = dataclasses.field(default_factory=dict)
    # Written by memory_format: paths of the convolutions whose weights it made channels-last
    # (offload says which of them a streamed unit runs in the standard layout).
    channels_last: frozenset[str] = frozenset()
    # Written by offload: paths of the units whose weights move between host and card during
    # calls (streamed, or evicted for another phase); empty when every weight stays put.
    offload_moving: frozenset[str] = frozenset()
    # Written by parallel: path of each module a multi-process split wraps -> the split (e.g.
    # "ulysses=2, cfg"); its hooks run collectives with per-call Python state.
    parallel_split: dict[str, str] = dataclasses.field(default_factory=dict)


StepFn = Callable[[StepContext], StepRecord]


def chain_undo(undos: list[Callable[[], None]]) -> Callable[[], None]:
    """One undo that runs `undos` in reverse order (last change undone first)."""

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo
