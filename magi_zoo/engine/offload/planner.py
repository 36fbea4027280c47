"""The offload planner: which units stay on the card and which stream, under a memory budget.

Pure functions of sizes and timings (no torch), so every decision is unit-tested on CPU.
What a plan holds: `plan.py`; when each copy starts: `schedule.py`.

Inputs: the units that may stream (one per repeated block instance, or a whole component),
each with its weight bytes, a *group* (units with one parameter layout: all
WanTransformerBlocks are one group), a *phase* (the component it belongs to:
units of different phases never run interleaved) and optionally its compute time per call;
the bytes that are always on the card (everything not in a unit); the activation peak; the
budget; the host->device copy rate.

Memory model (what `expected_peak` adds up)::

    peak = fixed (weights outside units) + resident units
         + the largest phase's buffers: its streaming pool ((prefetch + 1) buffers, each the
           size of its largest streamed block; one pool per phase, shared by all its groups
           of blocks) + its largest streamed one-of-a-kind unit (a component streamed whole:
           its buffer exists only while it runs)
         + activations

(One pool per phase, not one per group: the schedule never has more than `prefetch` copies
in flight ahead of the running block, whatever their groups, so prefetch + 1 buffers hold
every streamed block of the phase. Flux's double- and single-stream blocks share 2 x 0.63 GiB
instead of 2 x 0.63 + 2 x 0.26: room for two more resident single blocks at 12 GiB.)

(The runtime frees a phase's buffers when a unit of another phase starts: the text
encoder's buffers are gone before the denoising loop, the transformer's before the VAE.)

Which units stay: all of them if they fit. Otherwise units are demoted to streaming until
the peak fits, one-of-a-kind units (components, run once per generation) first, largest
first; then repeated blocks (run every step), one at a time from the group whose streamed
share stays smallest ("balanced": Flux's double- and single-stream blocks stream the same
share, so copies are spread over the whole call instead of crowding the double-block
stretch while the copy engine idles behind resident single blocks). With per-block times
the planner also makes the largest-blocks-first choice (fewest bytes when only one group
need stream) and keeps whichever the simulation says waits less. Within a group the
streamed instances are spread evenly over the depth, so every streamed block is followed by
resident ones whose compute hides its copy.
"""

from __future__ import annotations

from typing import Sequence

from .plan import POOL_SEP, OffloadPlan, OffloadPlanError, Unit, size, units_by_group
from .schedule import prefetch_schedule, stalls


def phase_activations(units: Sequence[Unit], activation: int,
                      measured: dict[str, int] | None = None) -> dict[str, int]:
    """phase -> its activation reserve: the plan-wide `activation`, or more where a unit of the
    phase declares more (`Unit.activation`, from phase_activation_gib); a phase in `measured`
    (reserves from a measured peak, `offload.refit`) takes that instead, lower or higher."""
    out: dict[str, int] = {}
    for u in units:
        out[u.phase] = max(out.get(u.phase, activation), u.activation or 0)
    for phase, nbytes in (measured or {}).items():
        if phase in out:
            out[phase] = int(nbytes)
    return out


def _phase_totals(units: Sequence[Unit], streamed: set[str], *, fixed: int, activation: int, prefetch: int,
                  measured: dict[str, int] | None = None) -> tuple[dict[str, int], dict[str, tuple[int, int]], int]:
    """({phase: its peak with every resident unit in place}, pools {group: (buffers, bytes)},
    largest transient bytes) for one streamed set.

    Phases run one after another, and the runtime frees a phase's buffers when another
    phase starts, so buffers count per phase: a phase's peak is the fixed and resident
    weights plus its pools plus its largest one-of-a-kind unit plus its activations
    (`activation`, or more where a unit of the phase declares more: a VAE decoding a whole
    video); resident weights stay on the card through every phase."""
    resident = sum(u.nbytes for u in units if u.name not in streamed)
    # phase -> [pool bytes, largest transient, activations]
    per_phase = {ph: [0, 0, act] for ph, act in phase_activations(units, activation, measured).items()}
    members: dict[str, list[tuple[str, int, int]]] = {}  # phase -> (group, streamed count, block bytes)
    for g, us in units_by_group(units).items():
        n_str = sum(u.name in streamed for u in us)
        if not n_str:
            continue
        size = max(u.nbytes for u in us)
        if len(us) == 1:  # one of a kind: a buffer only while it runs
            acc = per_phase[us[0].phase]
            acc[1] = max(acc[1], size)
        else:
            members.setdefault(us[0].phase, []).append((g, n_str, size))
    pools: dict[str, tuple[int, int]] = {}
    for ph, gs in members.items():  # one pool per phase, shared by its groups (module docstring)
        n = min(prefetch + 1, sum(n for _, n, _ in gs))
        size = max(b for _, _, b in gs)
        pools[POOL_SEP.join(g for g, _, _ in gs)] = (n, size)
        per_phase[ph][0] += n * size
    transient = max((b for _, b, _ in per_phase.values()), default=0)
    return {ph: fixed + resident + a + b + c for ph, (a, b, c) in per_phase.items()}, pools, transient


def _peak(units: Sequence[Unit], streamed: set[str], *, fixed: int, activation: int,
          prefetch: int, measured: dict[str, int] | None = None,
          evict_within: int | None = None) -> tuple[int, dict[str, tuple[int, int]], int]:
    """(peak bytes, pools, transient bytes) for one streamed set: the largest phase's peak
    (`_phase_totals`). With `evict_within` (phase residency, the budget), while a phase runs,
    resident units of other phases may leave the card (they come back before their own
    phase runs again), as far as that phase needs to fit."""
    totals, pools, transient = _phase_totals(units, streamed, fixed=fixed, activation=activation,
                                             prefetch=prefetch, measured=measured)
    if evict_within is not None:
        for ph in totals:
            spare = sum(u.nbytes for u in units if _evictable(u, ph, streamed))
            totals[ph] -= min(spare, max(0, totals[ph] - evict_within))
    resident = sum(u.nbytes for u in units if u.name not in streamed)
    return max(totals.values(), default=fixed + resident + activation), pools, transient


def _evictable(u: Unit, phase: str, streamed: set[str]) -> bool:
    """May `u` leave the card while `phase` runs (phase residency)? A resident unit of
    another phase that is not pinned."""
    return u.phase != phase and u.mode == "auto" and u.name not in streamed


def evictions(units: Sequence[Unit], streamed: set[str], *, fixed: int, activation: int, prefetch: int,
              budget: int, measured: dict[str, int] | None = None) -> dict[str, list[str]]:
    """phase -> the resident units of other phases that leave the card when it starts, so
    that its peak fits `budget` (the last-running ones first: their phase needs them back
    last). Empty when every phase fits with everything resident in place."""
    totals, _, _ = _phase_totals(units, streamed, fixed=fixed, activation=activation, prefetch=prefetch,
                                 measured=measured)
    out: dict[str, list[str]] = {}
    for ph, total in totals.items():
        need = total - budget
        picked: list[str] = []
        for u in reversed(units):
            if need <= 0:
                break
            if _evictable(u, ph, streamed):
                picked.append(u.name)
                need -= u.nbytes
        if picked:
            out[ph] = picked
    return out


def _spread(n_total: int, n_streamed: int) -> list[int]:
    """Indices of `n_streamed` of `n_total` positions, evenly spaced (the last one last)."""
    if n_streamed <= 0:
        return []
    if n_streamed >= n_total:
        return list(range(n_total))
    # Position i*N/S shifted so the spacing is even and the last block streams: its copy
    # then overlaps the resident blocks at the start of the next call.
    return sorted({n_total - 1 - int(i * n_total / n_streamed) for i in range(n_streamed)})


def _demote(units: Sequence[Unit], forced: set[str], auto: list[Unit], kw: dict, budget: int, *,
            balanced: bool) -> set[str]:
    """The streamed set: units demoted from resident until the peak fits `budget`.

    Order: what runs once per generation before what runs every step (a copy once vs a copy
    per step); within each, one-of-a-kind units (whole components) before repeated blocks,
    largest first. Repeated blocks go one at a time, from the group whose streamed share
    would then be smallest (`balanced`: every group of blocks streams the same share, so the
    copies spread over the whole call and the copy engine never idles behind a stretch of
    resident blocks while another stretch waits for its copies) or from the group with the
    largest blocks (fewest units streamed); ties go to the larger blocks, and among groups
    of one size (Wan2.2's two experts) to the smaller share, so equal groups stream
    equally. A group's streamed blocks are spread evenly over its depth."""
    streamed = set(forced)
    peak, _, _ = _peak(units, streamed, **kw)
    groups = units_by_group(units)
    for once in (True, False):
        if peak <= budget:
            break
        singles = sorted((u for u in auto if u.once == once and len(groups[u.group]) == 1), key=lambda u: -u.nbytes)
        for u in singles:
            streamed.add(u.name)
            peak, _, _ = _peak(units, streamed, **kw)
            if peak <= budget:
                break
        if peak <= budget:
            break
        cands = {g: [u for u in us if u.mode == "auto" and u.once == once]
                 for g, us in groups.items() if len(us) > 1}
        order = sorted((g for g in cands if cands[g]), key=lambda g: -max(u.nbytes for u in cands[g]))
        count: dict[str, int] = {}
        base = set(streamed)

        def chosen() -> set[str]:
            out = set(base)
            for g, n in count.items():
                out |= {cands[g][i].name for i in _spread(len(cands[g]), n)}
            return out

        def share(g: str) -> float:  # the group's streamed share after one more
            return (count.get(g, 0) + 1) / len(cands[g])

        while peak > budget:
            left = [g for g in order if count.get(g, 0) < len(cands[g])]
            if not left:
                break
            big = lambda g: max(u.nbytes for u in cands[g])  # noqa: E731
            g = (min(left, key=lambda g: (share(g), -big(g))) if balanced
                 else max(left, key=lambda g: (big(g), -share(g))))
            count[g] = count.get(g, 0) + 1
            peak, _, _ = _peak(units, chosen(), **kw)
        streamed = chosen()
    return streamed


def plan_offload(units: Sequence[Unit], *, fixed_bytes: int, activation_bytes: int, budget_bytes: int,
                 bandwidth_bytes_s: float = 55e9, prefetch: int = 1,
                 phase_activation_bytes: dict[str, int] | None = None, phase_residency: bool = False) -> OffloadPlan:
    """Decide residency (rules: module docstring) and the prefetch schedule (`schedule.py`).

    `units` are in execution order within each phase. `phase_activation_bytes` replaces the
    reserve of the phases it names (a measured peak: `offload.refit`). `phase_residency`:
    while a phase runs, resident units of other phases may leave the card to make room for
    its peak (copied back before their phase runs again; `OffloadPlan.evict`), so only the
    phases' own needs -- not the largest other phase's -- limit what stays resident. Raises
    `OffloadPlanError` (with `.minimum_bytes`) when even streaming every streamable unit does
    not fit the budget.
    """
    if prefetch < 0:
        raise ValueError("prefetch must be >= 0")
    names = [u.name for u in units]
    if len(set(names)) != len(names):
        raise ValueError("unit names must be unique")
    for u in units:
        if u.mode not in ("auto", "resident", "stream"):
            raise ValueError(f"unit {u.name}: mode {u.mode!r}; choices: auto, resident, stream")
    forced = {u.name for u in units if u.mode == "stream"}
    auto = [u for u in units if u.mode == "auto"]
    every = forced | {u.name for u in auto}
    # The smallest plan streams everything streamable through one buffer per group (no
    # copy overlaps compute: slow, but it runs). A budget between that and the requested
    # prefetch depth gets the deepest prefetch that fits.
    measured = phase_activation_bytes
    within = budget_bytes if phase_residency else None
    minimum, _, _ = _peak(units, every, fixed=fixed_bytes, activation=activation_bytes, prefetch=0, measured=measured)
    while prefetch > 0 and _peak(units, every, fixed=fixed_bytes, activation=activation_bytes,
                                 prefetch=prefetch, measured=measured)[0] > budget_bytes:
        prefetch -= 1
    kw = dict(fixed=fixed_bytes, activation=activation_bytes, prefetch=prefetch, measured=measured,
              evict_within=within)
    if minimum > budget_bytes:
        pins = sum(u.nbytes for u in units if u.mode == "resident")
        biggest = max((u.nbytes for u in units if u.name in every), default=0)
        raise OffloadPlanError(
            f"a memory budget of {size(budget_bytes)} cannot hold this model even with every "
            f"streamable unit streamed: it needs at least {size(minimum)} (weights outside units "
            f"{size(fixed_bytes)} + pinned units {size(pins)} + streaming buffers (largest unit "
            f"{size(biggest)}) + activations {size(max(phase_activations(units, activation_bytes, measured).values()))}"
            f"{' in its largest phase' if any(u.activation for u in units) else ''}). Raise memory_budget_gib to "
            f">= {size(minimum)}, lower the activation reserve, or unpin units (mode='auto')", minimum)

    streamed = _demote(units, forced, auto, kw, budget_bytes, balanced=True)
    if all(u.time_s is not None for u in units if u.phase in {x.phase for x in units if x.name in streamed}):
        # Per-block times known: a measurement decides between the balanced choice and the
        # largest-blocks-first one (less simulated wait; then fewer bytes to copy).
        other = _demote(units, forced, auto, kw, budget_bytes, balanced=False)
        if other != streamed:
            def cost(st):
                _, pools_, _ = _peak(units, st, **kw)
                sched = prefetch_schedule(units, st, prefetch, bandwidth_bytes_s)
                wait = sum(stalls(units, st, sched, pools_, bandwidth_bytes_s).values())
                return round(wait, 6), sum(u.nbytes for u in units if u.name in st)
            streamed = min((streamed, other), key=cost)
    peak, pools, transient = _peak(units, streamed, **kw)
    assert peak <= budget_bytes  # guaranteed by the minimum check: streaming everything fits
    schedule = prefetch_schedule(units, streamed, prefetch, bandwidth_bytes_s)
    copy_s: dict[str, float] = {}
    for u in units:
        copy_s.setdefault(u.phase, 0.0)
        if u.name in streamed:
            copy_s[u.phase] += u.nbytes / bandwidth_bytes_s
    stall = stalls(units, streamed, schedule, pools, bandwidth_bytes_s)
    evict = (evictions(units, streamed, fixed=fixed_bytes, activation=activation_bytes, prefetch=prefetch,
                       budget=budget_bytes, measured=measured) if phase_residency else {})
    size_of = {u.name: u for u in units}
    reload_s: dict[str, float] = {}
    for name in dict.fromkeys(n for names in evict.values() for n in names):
        u = size_of[name]
        reload_s[u.phase] = reload_s.get(u.phase, 0.0) + u.nbytes / bandwidth_bytes_s
    return OffloadPlan(
        evict=evict, reload_s=reload_s,
        budget=budget_bytes, fixed=fixed_bytes, activation=activation_bytes,
        resident=[u.name for u in units if u.name not in streamed], streamed=[u.name for u in units if u.name in streamed],
        slots=pools, transient=transient, schedule=schedule, copy_s=copy_s, expected_peak=peak,
        minimum_budget=minimum, resident_bytes=sum(u.nbytes for u in units if u.name not in streamed),
        streamed_bytes=sum(u.nbytes for u in units if u.name in streamed), stall_s=stall, prefetch=prefetch,
        phase_activation=phase_activations(units, activation_bytes, measured),
        measured_phases=tuple(p for p in (measured or {}) if p in copy_s))
