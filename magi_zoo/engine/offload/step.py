"""The offload step: plan residency under the memory budget and, when weights must move,
install the stream runtime; and the public handles on what it installed (`runtime`,
`streams`, `hold`).

The `offload` plan section (`specs/offload_spec.py`) names the *units* that may stream
(repeated block classes, whole components) and the budget (root key ""; default: the GPU
profile's memory). `units.plan_units` measures the units' weight bytes and hands them to the
pure planner (`planner.plan_offload`); when everything fits the step changes nothing and
says so. Otherwise `streaming.OffloadRuntime` moves the weights, and the step publishes the
units whose weights move on the step context (`StepContext.offload_moving`) for the steps
after it. docs/offload.md describes the design.

Why hooks work with regional compile: the compile step installs the compiled `forward` on
each block *instance*; `nn.Module.__call__` runs the module's hooks around it, so the
copies happen outside the compiled region, never traced into. Dynamo guards a parameter by
its metadata (shape, stride, dtype, device), not its storage, and the views a unit gets
have the layout of the weights they replace (each at a 256-byte aligned offset, as inductor
wants), so swapping storages recompiles nothing (tests count it). Regions that would trace
*into* a streamed unit (a compiled ancestor) and CUDA graphs (which bake weight addresses
into the graph) are refused. Inference only: a streamed unit called with gradients on raises
(its weights would change under autograd's saved tensors).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Sequence

import torch
import torch.nn as nn

from ..compile import cuda_graphs_by
from ..resolve import path_within
from ..steps import StepContext, StepRecord
from .arena import HostArenas, check_host_memory
from .plan import GIB, size
from .streaming import UNIT_ATTR, OffloadRuntime
from .units import plan_units, planner_settings, resident_bytes, tensor_bytes

RUNTIME_ATTR = "_magi_zoo_offload"  # root instance attr: the live OffloadRuntime


def runtime(root: nn.Module) -> OffloadRuntime | None:
    """The live offload runtime of an applied plan (None when nothing streams)."""
    return root.__dict__.get(RUNTIME_ATTR)


def streams(module: nn.Module) -> bool:
    """Whether `module` is a unit whose weights stream under an applied offload plan."""
    return UNIT_ATTR in module.__dict__


@contextlib.contextmanager
def hold(module: nn.Module):
    """Keep a streamed unit's weights on the card across the calls inside the block: one
    copy serves them all, instead of one per call. For models that run a block several
    times per step on different inputs (BAGEL's classifier-free guidance runs every layer
    once per context): calling each layer for every context before the next layer, inside
    `hold(layer)`, streams each layer once per step. A no-op for a module that does not
    stream (resident, or no plan), so callers need not check."""
    entry = module.__dict__.get(UNIT_ATTR)
    if entry is None:
        yield
        return
    rt, u = entry
    u.holds += 1
    try:
        yield
    finally:
        u.holds -= 1
        rt.end_hold(u)


def _check_compile(ctx: StepContext, streamed: Sequence[str]) -> None:
    """Refuse compile regions that would trace into a streamed unit's hooks, and CUDA graphs
    over one (they replay fixed weight addresses)."""
    for t in ctx.plan.section("compile").targets:
        if not t.spec.enabled:
            continue
        for s in streamed:
            inside = t.path == "" or s.startswith(t.path + ".")
            under_or_at = t.path == s or t.path.startswith(s + ".")
            if inside:
                raise ValueError(
                    f"offload streams {s!r}, which is inside the compiled region {t.key!r} ({t.path or '<root>'}): "
                    "its weight copies would be traced into the graph. Compile the repeated blocks (regional "
                    f"compile) instead of an enclosing module, or pin {s!r} (mode='resident')")
            graphs = cuda_graphs_by(t.spec) if under_or_at else None
            if graphs:
                raise ValueError(
                    f"compile region {t.key!r} uses {graphs} (CUDA graphs) on the streamed unit {s!r}: "
                    "a graph replays fixed weight addresses, but streamed weights move between buffers. Use "
                    "mode='default' or 'max-autotune-no-cudagraphs' there, or pin the unit")


def offload_step(ctx: StepContext) -> StepRecord:
    """Plan residency under the budget; stream what does not fit (module docstring)."""
    p = ctx.profile
    plan, specs, units, settings = plan_units(ctx.root, ctx.plan, p)
    if plan is None:
        used = resident_bytes(ctx.root, p.device) / GIB
        did = f"no offload units in the plan; weights {used:.2f} GiB on {p.device}, profile {p.name} has {p.memory_gib:g} GiB"
        if used > p.memory_gib:
            did += " -- does not fit"
            warnings.warn(f"magi_zoo: the module's weights ({used:.1f} GiB) exceed the {p.name} profile's "
                          f"{p.memory_gib:g} GiB; pick the profile of the card you run on (gpu=...), or name "
                          "the units that may stream in an [offload] section", RuntimeWarning, stacklevel=3)
        return StepRecord("offload", did, None, {"resident_gib": round(used, 3), "budget_gib": p.memory_gib})
    details = {"plan": plan.to_dict(), "settings": settings}
    if not plan.streams:
        return StepRecord("offload", plan.summary(units), None, details)
    _check_compile(ctx, [*plan.streamed, *sorted(plan.evictable_paths())])
    if ctx.train:
        raise ValueError(f"the offload plan streams {len(plan.streamed)} unit(s) to fit {size(plan.budget)}, but weight "
                         "streaming is inference-only and this is a training apply (train=True); raise "
                         "memory_budget_gib until the weights stay resident (magi-zoo spec MODEL --memory-budget G "
                         "shows the plan), or pin the trained units (offload mode='resident')")
    device = torch.device(p.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"offload for profile {p.name!r} needs CUDA, which is not available here")
    moving = plan.host_held_paths()
    streamed = [t for s in specs if s.path in moving for t in s.tensors]
    pinned = HostArenas.rounded([tensor_bytes(t) for t in streamed], pinned=device.type == "cuda")
    on_host = sum(tensor_bytes(t) for t in streamed if t.device.type == "cpu")
    details["pinned_host_gib"] = round(pinned / GIB, 3)
    if os.environ.get("MAGI_ZOO_SKIP_HOST_CHECK") != "1":
        check_host_memory(pinned, already_on_host=on_host)
    rt = OffloadRuntime(ctx.root, plan, specs, units, device, plan.budget, planner_settings(settings))
    ctx.root.__dict__[RUNTIME_ATTR] = rt
    ctx.offload_moving = frozenset(moving)  # for cuda_graphs: these weights move during calls
    details["counters"] = rt.counters  # live: what the runtime did (`offload.runtime(root).stats()`)

    def undo() -> None:
        ctx.root.__dict__.pop(RUNTIME_ATTR, None)
        rt.remove()

    did = plan.summary(units) + f"; {'pinned ' if device.type == 'cuda' else ''}host memory held {size(pinned)}"
    flat = standard_layout_when_streamed(ctx.channels_last, plan.streamed)
    if flat:  # said, not refused: the outputs are the same, only memory_format's gain is lost there
        details["standard_layout_when_streamed"] = flat
        did += (f"; {len(flat)} channels-last convolution weight(s) run in the standard layout while their unit "
                f"streams (e.g. {flat[0]}: a streamed unit's weights are views of its flat buffer)")
    return StepRecord("offload", did, undo, details)


def standard_layout_when_streamed(channels_last: frozenset[str], streamed: list[str]) -> list[str]:
    """The convolutions memory_format made channels-last that sit in a streamed unit: their
    weights become views of the unit's flat card buffer, in the standard layout."""
    return sorted(p for p in channels_last if any(path_within(p, u) for u in streamed))
