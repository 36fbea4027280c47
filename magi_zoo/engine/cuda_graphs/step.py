"""The cuda_graphs step: capture whole calls of a method in CUDA graphs, with an exact undo.

For each enabled target of the ``cuda_graphs`` section the step replaces the instance's
method (whatever it is by then: the plain forward, or a compiled one) with a `GraphedCall`
(`graphed.py`: how calls are captured and replayed).

Why at the end of the apply order: the graph records everything the call launches -- the
compiled blocks, the eager code between them, the custom attention ops -- so it must wrap
the finished module. What cannot be recorded is refused at apply (`conflict`): step
caching (hooks decide in Python per call whether to run a block), streamed offload units
(copies scheduled from Python hooks between buffers that change), sequence/CFG parallelism
(collectives with per-call Python state), and compile regions inside that capture CUDA
graphs themselves (inductor's CUDA graph trees cannot nest in an outer capture). The steps
before publish what they did on the step context (`StepContext.step_cached`,
`.offload_moving`, `.parallel_split`); this step reads nothing else of theirs. A user's
entry that meets one of these is an error; an entry only the shipped spec set (e.g. Flux's
on an H100) yields instead -- to the memory budget, the step cache or the training the user
chose -- and the report says which call is not captured and why.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ...specs.cuda_graph_spec import CudaGraphSpec
from ..compile import cuda_graphs_by
from ..resolve import PlanError, path_within, paths_related
from ..steps import StepContext, StepRecord
from .graphed import GraphedCall, install, uninstall


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
    for path, method in ctx.step_cached.items():
        if paths_related(path, t.path):
            return (f"step caching ({method!r} on {path or '<root>'!r}) decides in Python at every call "
                    "whether to run each block, and a graph replays one fixed decision: use one or the other")
    for path in ctx.parallel_split:
        if paths_related(path, t.path):
            return (f"the parallel split on {path or '<root>'!r} runs collectives with per-call Python state, "
                    "which a graph cannot record here")
    moving = sorted(p for p in ctx.offload_moving if path_within(p, t.path))
    if moving:
        return (f"{len(moving)} offload unit(s) inside it stream or move (e.g. {moving[0]!r}), their copies "
                "scheduled by Python hooks between changing buffers; raise the memory budget until they stay "
                "resident")
    return None


def cuda_graphs_step(ctx: StepContext) -> StepRecord:
    """Install a `GraphedCall` on every enabled target; undo puts the methods back."""
    section = ctx.plan.section("cuda_graphs")
    done: list[tuple[nn.Module, str]] = []
    calls: dict[str, GraphedCall] = {}
    lines: list[str] = []

    def undo() -> None:
        for m, method in reversed(done):
            uninstall(m, method)

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
                install(t.module, method, call)
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
