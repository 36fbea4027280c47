"""When each streamed unit's copy starts, and how long the compute waits for copies.

"JIT prefetch": a copy starts as late as possible but finishes before use. With per-unit
times, the copy of streamed unit j is issued at the start of the latest unit b such that
the compute from b up to j covers the copy time (bytes / bandwidth), but never more than
`prefetch` streamed units ahead (each copy in flight holds a buffer). Without times, the
copy of streamed unit j is issued when streamed unit j - prefetch starts. The schedule is
cyclic within a phase: the last blocks prefetch the first ones of the next call (a
denoising loop calls the transformer again).

`simulate` replays a schedule against the units' compute times (one copy engine, the
pools' buffers): the planner keeps the choice of streamed units that waits less.
"""

from __future__ import annotations

from typing import Sequence

from .plan import Unit, pool_of, units_by_group


def stalls(units: Sequence[Unit], streamed: set[str], schedule: dict[str, list[str]],
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
    groups = units_by_group(units)
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
