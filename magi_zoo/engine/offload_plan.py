"""The offload planner: which units stay on the card, which stream, and when each copy starts.

Pure functions of sizes and timings (no torch), so every decision is unit-tested on CPU.

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

When each copy starts ("JIT prefetch"): as late as possible but finished before use. With
per-unit times, the copy of streamed unit j is issued at the start of the latest unit b
such that the compute from b up to j covers the copy time (bytes / bandwidth), but never
more than `prefetch` streamed units ahead (each copy in flight holds a buffer). Without
times, the copy of streamed unit j is issued when streamed unit j - prefetch starts. The
schedule is cyclic within a phase: the last blocks prefetch the first ones of the next call
(a denoising loop calls the transformer again).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

GIB = 1024 ** 3


def size(nbytes: float) -> str:
    """Bytes as GiB, or MiB / KiB for small (tiny test) models."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= 0.1 * scale or unit == "KiB":
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


class OffloadPlanError(ValueError):
    """A budget no plan can meet; the message names the minimum that would work."""

    def __init__(self, msg: str, minimum_bytes: int):
        super().__init__(msg)
        self.minimum_bytes = minimum_bytes


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit that may stream: a repeated block instance or a whole component."""

    name: str  # module path, e.g. "transformer.blocks.3"
    nbytes: int
    group: str  # units with one parameter layout share device buffers
    phase: str  # the component it runs in ("transformer", "text_encoder", ...)
    mode: str = "auto"  # auto | resident | stream
    time_s: float | None = None  # compute time of one call (None: unknown)
    once: bool = False  # runs once per generation (encoders, VAE): streamed before per-step blocks
    activation: int | None = None  # its phase's activation peak, when above the plan-wide reserve


@dataclasses.dataclass
class OffloadPlan:
    """What the planner decided (every number in bytes / seconds)."""

    budget: int
    fixed: int
    activation: int
    resident: list[str]
    streamed: list[str]
    slots: dict[str, tuple[int, int]]  # pool -> (buffers, bytes per buffer); pool label: its groups joined by '+' (`pool_of`)
    transient: int  # largest streamed one-of-a-kind unit (its buffer lives only while it runs)
    schedule: dict[str, list[str]]  # unit name -> streamed units whose copy starts at its pre-hook
    copy_s: dict[str, float]  # phase -> copy seconds per call of that phase
    expected_peak: int
    minimum_budget: int  # the smallest budget that has a plan (everything streamable streamed)
    resident_bytes: int
    streamed_bytes: int
    stall_s: dict[str, float] = dataclasses.field(default_factory=dict)  # phase -> simulated wait per call (times known)
    prefetch: int = 1  # copies in flight ahead of use (0: one buffer per group, copies never overlap)
    phase_activation: dict[str, int] = dataclasses.field(default_factory=dict)  # phase -> the reserve planned with
    measured_phases: tuple[str, ...] = ()  # phases whose reserve came from a measured peak (refit)
    # Phase residency: phase -> resident units of other phases that leave the card when it
    # starts; phase -> seconds to copy its evicted units back when it runs again (once per
    # return, e.g. once per generation for the denoiser after the VAE).
    evict: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    reload_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def streams(self) -> bool:
        """Whether any weights move during a generation (streamed, or evicted for a phase)."""
        return bool(self.streamed or self.evict)

    def summary(self, units: Sequence[Unit] | None = None) -> str:
        """One line for the report."""
        moves = "".join(f"; while {ph} runs {len(v)} resident unit(s) leave the card" for ph, v in self.evict.items())
        if not self.streamed:
            return (f"all weights resident: {size(self.resident_bytes)} in units + {size(self.fixed)} "
                    f"other, expected peak {size(self.expected_peak)} of {size(self.budget)} budget{moves}")
        by_group: dict[str, list[int]] = {}
        if units is not None:
            pooled = pool_of(self.slots)
            for u in units:
                if u.group in pooled or u.name in self.streamed:
                    by_group.setdefault(u.group, [0, 0])[u.name in self.streamed] += 1
        groups = ", ".join(f"{g}: {n_res} resident / {n_str} streamed" for g, (n_res, n_str) in by_group.items())
        copy = ", ".join(f"{p} {s * 1e3:.0f} ms" for p, s in self.copy_s.items() if s)
        return (f"budget {size(self.budget)}: {len(self.resident)} unit(s) resident "
                f"({size(self.resident_bytes)}), {len(self.streamed)} streamed "
                f"({size(self.streamed_bytes)} from host memory){f' [{groups}]' if groups else ''}; "
                f"expected copy per call: {copy}; expected peak {size(self.expected_peak)}{moves}")

    def to_dict(self) -> dict:
        g = lambda b: round(b / GIB, 3)  # noqa: E731
        return {"budget_gib": g(self.budget), "expected_peak_gib": g(self.expected_peak),
                "minimum_budget_gib": g(self.minimum_budget), "fixed_gib": g(self.fixed),
                "activation_gib": g(self.activation), "resident_gib": g(self.resident_bytes),
                "streamed_gib": g(self.streamed_bytes), "resident": list(self.resident),
                "streamed": list(self.streamed),
                "buffers": {k: {"count": n, "gib_each": g(b)} for k, (n, b) in self.slots.items()},
                "transient_gib": g(self.transient), "prefetch": self.prefetch,
                "activation_gib_per_phase": {p: g(b) for p, b in self.phase_activation.items()},
                **({"measured_phases": list(self.measured_phases)} if self.measured_phases else {}),
                **({"evict": {p: list(v) for p, v in self.evict.items()},
                    "reload_ms": {p: round(s * 1e3, 2) for p, s in self.reload_s.items()}} if self.evict else {}),
                "copy_ms_per_call": {p: round(s * 1e3, 2) for p, s in self.copy_s.items()},
                **({"simulated_stall_ms_per_call": {p: round(s * 1e3, 2) for p, s in self.stall_s.items()}}
                   if self.stall_s else {}),
                "prefetch_schedule": {k: list(v) for k, v in self.schedule.items()}}


def _groups(units: Sequence[Unit]) -> dict[str, list[Unit]]:
    out: dict[str, list[Unit]] = {}
    for u in units:
        out.setdefault(u.group, []).append(u)
    return out


POOL_SEP = "+"  # group labels (class names, '#k', 'component/') never contain it


def pool_of(pools: dict[str, tuple[int, int]]) -> dict[str, str]:
    """group -> the label of the streaming pool its blocks share (`OffloadPlan.slots`)."""
    return {g: label for label in pools for g in label.split(POOL_SEP)}


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
    for g, us in _groups(units).items():
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
    groups = _groups(units)
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
    """Decide residency and the prefetch schedule (rules: module docstring).

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
                wait = sum(_waits(units, st, sched, pools_, bandwidth_bytes_s).values())
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
    stall = _waits(units, streamed, schedule, pools, bandwidth_bytes_s)
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


def _waits(units: Sequence[Unit], streamed: set[str], schedule: dict[str, list[str]],
           pools: dict[str, tuple[int, int]], bandwidth_bytes_s: float) -> dict[str, float]:
    """phase -> simulated wait per call (`simulate`), for each phase that streams and whose
    units' times are all known."""
    out: dict[str, float] = {}
    for phase in dict.fromkeys(u.phase for u in units if u.name in streamed):
        us = [u for u in units if u.phase == phase]
        if all(u.time_s is not None for u in us):
            out[phase] = simulate(us, streamed, schedule, pools, bandwidth_bytes_s)
    return out


def prefetch_schedule(units: Sequence[Unit], streamed: set[str], prefetch: int,
                      bandwidth_bytes_s: float) -> dict[str, list[str]]:
    """unit name -> streamed units whose copy starts when that unit starts (rules: module
    docstring). One-of-a-kind streamed units are loaded by their own pre-hook (no
    prefetch: they run once, and an early copy would only hold memory longer)."""
    groups = _groups(units)
    out: dict[str, list[str]] = {}
    phases: dict[str, list[Unit]] = {}
    for u in units:
        phases.setdefault(u.phase, []).append(u)
    for us in phases.values():
        n = len(us)
        s_idx = [i for i, u in enumerate(us) if u.name in streamed and len(groups[u.group]) > 1]
        n_s = len(s_idx)
        if prefetch == 0:  # one buffer: each copy waits for the previous block to finish
            continue
        known = all(u.time_s is not None for u in us)
        issues: list[tuple[int, int]] = []  # (unrolled issue position, use position)
        for j, p in enumerate(s_idx):
            # Earliest allowed start, in unrolled positions (negative = the previous call):
            # the start of the streamed unit `prefetch` before this one, whose buffer
            # count then holds it; with no more streamed units than that, right after this
            # unit's own use in the previous call.
            if n_s > prefetch:
                k = j - prefetch
                limit = s_idx[k] if k >= 0 else s_idx[k + n_s] - n
            else:
                limit = p - n + 1
            issue = limit
            if known:  # as late as possible: the compute from `issue` up to p covers the copy
                need, acc, b = us[p].nbytes / bandwidth_bytes_s, 0.0, p
                while b - 1 >= limit and (acc < need or b == p):
                    b -= 1
                    acc += us[b % n].time_s
                issue = b
            issues.append((issue, p))
        # Per issuing unit, copies in the order they are used (the copy engine is serial).
        for issue, p in sorted(issues, key=lambda ip: (ip[0] % n, ip[1] - ip[0])):
            out.setdefault(us[issue % n].name, []).append(us[p].name)
    return out


def simulate(units: Sequence[Unit], streamed: set[str], schedule: dict[str, list[str]],
             pools: dict[str, tuple[int, int]], bandwidth_bytes_s: float, calls: int = 3) -> float:
    """Simulated wait for copies per call in steady state (the last of `calls` calls), in
    seconds: compute runs units in order; one copy engine runs copies in issue order; a
    copy needs a free buffer of its pool (freed when the unit that held it finishes); a
    streamed unit waits for its copy. Times must be known."""
    t = 0.0  # compute clock
    engine = 0.0  # copy engine clock
    ready: dict[str, float] = {}  # unit -> time its copy finishes
    busy: dict[str, list[float]] = {g: [0.0] * n for g, (n, _) in pools.items()}  # buffer free times
    shared = pool_of(pools)
    group = {u.name: shared.get(u.group, u.group) for u in units}  # unit -> its pool
    nbytes = {u.name: u.nbytes for u in units}
    held: dict[str, int] = {}
    wait_last = 0.0
    for c in range(calls):
        wait = 0.0
        for u in units:
            for v in schedule.get(u.name, []):
                if v in ready:
                    continue
                slots = busy[group[v]]
                i = min(range(len(slots)), key=lambda k: slots[k])
                if slots[i] == float("inf"):  # no buffer free: the runtime defers this copy too
                    continue
                start = max(t, engine, slots[i])
                engine = start + nbytes[v] / bandwidth_bytes_s
                ready[v], held[v] = engine, i
                slots[i] = float("inf")
            if u.name in streamed and group[u.name] in pools:
                if u.name not in ready:  # not prefetched: a demand copy
                    slots = busy[group[u.name]]
                    i = min(range(len(slots)), key=lambda k: slots[k])
                    start = max(t, engine, slots[i])
                    engine = start + u.nbytes / bandwidth_bytes_s
                    ready[u.name], held[u.name] = engine, i
                    slots[i] = float("inf")
                if ready[u.name] > t:
                    wait += ready[u.name] - t
                    t = ready[u.name]
                t += u.time_s
                busy[group[u.name]][held.pop(u.name)] = t
                del ready[u.name]
            elif u.name in streamed:  # one of a kind: loaded on demand
                start = max(t, engine)
                engine = start + u.nbytes / bandwidth_bytes_s
                wait += engine - t
                t = engine + u.time_s
            else:
                t += u.time_s
        wait_last = wait
    return wait_last
