"""What one real call measures, fed back into the plan: each unit's compute time
(`profile_units`, for the planner's schedule and simulation) and each phase's activation
peak (`refit`, which re-plans on it and moves the units whose place changes)."""

from __future__ import annotations

import difflib
import time
import warnings
from typing import Any, Sequence

import torch
import torch.nn as nn

from .plan import GIB
from .step import runtime


def profile_units(root: nn.Module, paths: Sequence[str], call, device: torch.device | str) -> dict[str, float]:
    """Seconds of compute per call of each named submodule over one `call()` (after one
    unrecorded warm-up call; CUDA events on
    the compute stream, so a streamed unit's wait for its copy is not counted; perf_counter
    on CPU): the per-block timing profile `plan_units(..., times_s=...)` takes to make a JIT
    schedule and to simulate the stalls of a plan."""
    cuda = torch.device(device).type == "cuda"
    marks: dict[str, list] = {p: [] for p in paths}
    handles = []

    def stamp():
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    for p in paths:
        m = root.get_submodule(p)
        handles.append(m.register_forward_pre_hook(lambda mod, args, p=p: marks[p].append([stamp()])))
        handles.append(m.register_forward_hook(lambda mod, args, out, p=p: marks[p][-1].append(stamp()),
                                               always_call=True))
    try:
        # One unrecorded call first: adding hooks to a compiled block changes what dynamo
        # guards on (its hook dicts), so the first call with them can re-trace (hundreds of
        # ms per block on CPU), which is not the block's compute time.
        call()
        for p in paths:
            marks[p].clear()
        call()
        if cuda:
            torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    if paths and not any(marks.values()):
        # Not one unit's hooks ran: the call never entered them through Python. A forward
        # replayed from a CUDA graph does that; an empty profile would read as "no compute",
        # and a plan simulated on it as "every copy hidden".
        raise RuntimeError(
            f"profile_units: none of the {len(paths)} units ran through Python during call() "
            f"(first: {paths[0]!r}), so nothing was timed. If the call is served from a CUDA "
            "graph, time it inside magi_zoo.engine.cuda_graphs.bypassed(root); else check that "
            "call() runs these modules")
    out = {}
    for p, pairs in marks.items():
        done = [pr for pr in pairs if len(pr) == 2]
        if done:
            secs = [(b - a) if not cuda else a.elapsed_time(b) / 1e3 for a, b in done]
            out[p] = sum(secs) / len(secs)
    return out


def refit(root: nn.Module, call=None, *, activation_gib: dict[str, float] | None = None,
          margin: float = 0.25, floor_gib: float = 0.25) -> dict[str, Any]:
    """Re-plan an applied offload on a measured activation peak, and move the units whose
    place changes (the planner's reserves are estimates; the first real call tells).

    With `call` (CUDA): runs `call()` once -- one denoiser forward on the real inputs, or one
    whole (e.g. one-step) generation to measure every component -- and measures, per phase
    (component) whose streamed units ran, the peak *reserved* memory beyond the weights and
    streaming buffers (so the allocator's cached, fragmented blocks count too). CUDA's peak
    memory statistics are reset at the start and at every phase change of that call. Each
    measured phase's reserve becomes its peak x (1 + margin), at least `floor_gib` above it;
    phases the call did not run keep their declared reserves. (Work between phases -- e.g.
    a resident encoder before the first streamed block -- counts toward the phase before.)
    The re-made plan then runs `call()` once more: units made resident change the
    allocator's layout, and if that call runs out of memory the previous plan comes back
    (a warning says so; the result has "reverted": True). With `activation_gib` ({phase: GiB}): those
    reserves as given, no call (any device).

    A lower reserve keeps more units resident (fewer bytes copied per step); a higher one
    streams more. Returns {"measured_gib", "reserve_gib", "made_resident", "made_streamed",
    "plan"}. Raises ValueError when nothing streams under `root`."""
    rt = runtime(root)
    if rt is None:
        raise ValueError("offload refit: no weights stream under this module (no applied offload plan, or everything "
                         "fits); nothing to refit")
    phases = {u.phase for u in rt.plan_units}
    out: dict[str, Any] = {}
    if activation_gib is not None:
        unknown = sorted(set(activation_gib) - phases)
        if unknown:
            near = [m for u in unknown for m in difflib.get_close_matches(u, sorted(phases), n=1)]
            raise ValueError(f"offload refit: unknown phase(s) {unknown}"
                             f"{f' (did you mean {near}?)' if near else ''}; the plan's phases are {sorted(phases)}")
        reserve = {ph: int(g * GIB) for ph, g in activation_gib.items()}
    else:
        if call is None:
            raise ValueError("offload refit: pass call (a function that runs one call of the model, to measure) or "
                             "activation_gib={phase: GiB}")
        mem = rt.memory
        if mem is None:
            raise ValueError("offload refit: measuring a peak needs CUDA; on this device pass activation_gib={phase: GiB}")
        mem.sync()
        mem.empty_cache()  # blocks cached since the build are not this call's activations
        mem.reset_peak()
        rt.measuring = {}
        try:
            call()
            mem.sync()
            rt.record_phase_peak()
            measured = rt.measuring
        finally:
            rt.measuring = None
        if not measured:
            raise ValueError("offload refit: the call ran no streamed unit, so it says nothing about the phases that "
                             "stream; pass a call of the streaming component (one denoiser forward, or one whole "
                             "generation to measure every component)")
        out["measured_gib"] = {ph: round(b / GIB, 3) for ph, b in measured.items()}
        reserve = {ph: int(max(b * (1 + margin), b + floor_gib * GIB)) for ph, b in measured.items()}
    before = {ph: rt.plan.phase_activation.get(ph, rt.plan.activation) for ph in reserve}
    made_resident, made_streamed = rt.refit(reserve)
    rt.counters.refits += 1
    if call is not None and rt.memory is not None:
        # Check the new plan on the same call: units made resident change the allocator's
        # layout (its fragmentation), which the measured peak did not see. Out of memory
        # (under a hard cap): back to the plan before, and say so.
        try:
            call()
            rt.memory.sync()
        except torch.OutOfMemoryError as e:
            rt.refit(before)
            rt.memory.empty_cache()
            warnings.warn(f"magi_zoo offload refit: the re-made plan ran out of memory on the measuring call "
                          f"({str(e).splitlines()[0]}); the previous plan is back. Refit with a larger margin "
                          "(margin=, floor_gib=) or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before "
                          "CUDA starts (less fragmentation)", RuntimeWarning, stacklevel=2)
            out["reverted"] = True
            made_resident, made_streamed = [], []
    out.update({"reserve_gib": {ph: round(b / GIB, 3) for ph, b in reserve.items()},
                "made_resident": made_resident, "made_streamed": made_streamed, "plan": rt.plan.to_dict()})
    return out
