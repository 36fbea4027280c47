"""The `auto` policy's cost model and solver: per block one option, chosen to fit a budget.

A block's measured forward (`BlockProfile`, and where measured `OptionCost` per option: see
`measure`) gives each option (`AUTO_SAVES`, or no checkpoint) the bytes it keeps and the
recompute seconds it leaves (`options`); `choose` / `choose_within` pick one option per
block so that the kept bytes fit the budget at the least total recompute time. Pure
functions of their inputs (tested on made-up profiles); `calibration` feeds them.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

from .policy import DOWN, option_name


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """Outputs of one op group in one block forward: bytes, forward seconds, op calls."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0


@dataclasses.dataclass(frozen=True)
class BlockProfile:
    """One block's measured forward: per op group ('matmuls', 'attention', 'sensitive',
    'other'; 'down-projections' again apart, a subset of 'matmuls') the bytes of the outputs
    and the seconds spent; `boundary_bytes` = the inputs a checkpoint keeps that are the
    block's own (the residual stream; inputs every block shares, e.g. text states, are
    counted once, elsewhere); `no_checkpoint_bytes` = what
    autograd saves for the block without checkpointing (unique storages, parameters
    excluded), the block's inputs included."""

    groups: dict[str, GroupCost]
    forward_s: float
    boundary_bytes: int
    no_checkpoint_bytes: int

    def group(self, name: str) -> GroupCost:
        return self.groups.get(name, GroupCost())


@dataclasses.dataclass(frozen=True)
class Option:
    """One thing a block may do: what it keeps, the bytes that costs, the recompute seconds
    left. `save` None = no checkpoint; () = full recompute (a plain checkpoint: every op
    recomputed, compute-sensitive ones too)."""

    name: str
    save: tuple[str, ...] | None
    bytes: int
    recompute_s: float


AUTO_SAVES: tuple[tuple[str, ...], ...] = ((), ("attention",), ("attention", DOWN), ("matmuls",),
                                          ("matmuls", "attention"))


@dataclasses.dataclass(frozen=True)
class OptionCost:
    """One option run for real (`measure_options`): the bytes its forward saved for backward,
    the seconds of one forward + backward of the block, and (CUDA) the working set of its
    backward above what it keeps -- recomputed activations, gradients in flight (None where
    no allocator statistics exist: the CPU)."""

    bytes: int
    step_s: float
    transient: int | None = None


def options(p: BlockProfile, measured: dict[str, OptionCost] | None = None) -> list[Option]:
    """The choices `auto` weighs for a block with profile `p`, by its measured costs.

    A selectively checkpointed block keeps its boundary inputs, the compute-sensitive custom
    ops' outputs and the outputs of the kept groups; it recomputes every other op (their
    forward seconds). Full recompute is a plain checkpoint (`step.BlockState.choose(())`):
    it keeps the boundary inputs only and recomputes every op, the compute-sensitive ones
    too (counting their outputs as kept charged Wan-1.3B's fused up-projection, 0.55 GiB a
    block at 480x832x81, to every `full` block: an estimate 3x the measured peak). No
    checkpoint keeps what autograd saves and recomputes nothing.
    `measured` (option name -> `OptionCost` of the block's real, compiled forward and
    backward; see `measure_options`) refines both: its saved bytes replace the estimate where
    larger (the compiler's partitioner may keep more than the eager ops' outputs: upcasts,
    both sides of a fused op), and an option's recompute seconds become its forward +
    backward time less the no-checkpoint option's (eager op times overstate what a compiled
    region spends on the small ops it fuses).
    """
    sens = p.group("sensitive")
    measured = measured or {}
    out = []
    for save in (*AUTO_SAVES, None):
        if save is None:
            est, secs = p.no_checkpoint_bytes, 0.0
        elif not save:
            est, secs = p.boundary_bytes, p.forward_s
        else:
            kept = [p.group(g) for g in save]
            est = p.boundary_bytes + sens.bytes + sum(g.bytes for g in kept)
            secs = max(0.0, p.forward_s - sens.seconds - sum(g.seconds for g in kept))
        name = option_name(save)
        m, base = measured.get(name), measured.get("no checkpoint")
        if m is not None and base is not None and save is not None:
            secs = max(0.0, m.step_s - base.step_s)
        out.append(Option(name, save, max(est, m.bytes if m is not None else 0), secs))
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `choose` picked: an option index per block, totals, and whether it fits."""

    picks: tuple[int, ...]
    bytes: int
    recompute_s: float
    fits: bool


def _hull(opts: Sequence[Option]) -> list[int]:
    """Indices of the lower convex hull of (bytes, recompute seconds), by bytes: the options
    worth upgrading through (a dominated option -- more bytes, no fewer seconds -- or one
    above the hull is never the best use of the bytes it costs)."""
    order = sorted(range(len(opts)), key=lambda i: (opts[i].bytes, opts[i].recompute_s))
    pareto: list[int] = []
    for i in order:
        if not pareto or opts[i].recompute_s < opts[pareto[-1]].recompute_s:
            if pareto and opts[i].bytes == opts[pareto[-1]].bytes:
                pareto.pop()
            pareto.append(i)
    hull: list[int] = []
    for i in pareto:
        while len(hull) >= 2:
            a, b = opts[hull[-2]], opts[hull[-1]]
            c = opts[i]
            # b is above the segment a-c: a -> c saves seconds per byte at least as well.
            if (b.recompute_s - a.recompute_s) * (c.bytes - a.bytes) >= (c.recompute_s - a.recompute_s) * (b.bytes - a.bytes):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def choose(blocks: Sequence[Sequence[Option]], budget_bytes: float) -> Choice:
    """Per block one option, so that the kept bytes fit `budget_bytes` at the least total
    recompute time. Pure (tested on CPU with made-up profiles).

    Multiple-choice knapsack by the greedy of its LP relaxation: every block starts at its
    cheapest option and the upgrade with the most seconds saved per byte is taken while it
    fits (upgrades walk each block's convex hull, so they come in order of efficiency);
    then any block still able to afford a better option in what is left takes it. With
    identical blocks this is optimal up to one block's step. If even the cheapest options
    do not fit, those are returned with `fits=False`.
    """
    if not blocks:
        return Choice((), 0, 0.0, True)
    hulls = [_hull(opts) for opts in blocks]
    picks = [h[0] for h in hulls]
    pos = [0] * len(blocks)
    used = sum(blocks[b][picks[b]].bytes for b in range(len(blocks)))
    if used > budget_bytes:
        return Choice(tuple(picks), used, sum(blocks[b][picks[b]].recompute_s for b in range(len(blocks))), False)
    heap: list[tuple[float, int]] = []

    def push(b: int) -> None:
        if pos[b] + 1 < len(hulls[b]):
            cur, nxt = blocks[b][hulls[b][pos[b]]], blocks[b][hulls[b][pos[b] + 1]]
            gain = (cur.recompute_s - nxt.recompute_s) / max(1, nxt.bytes - cur.bytes)
            heapq.heappush(heap, (-gain, b))

    for b in range(len(blocks)):
        push(b)
    while heap:
        _, b = heapq.heappop(heap)
        cur, nxt = blocks[b][hulls[b][pos[b]]], blocks[b][hulls[b][pos[b] + 1]]
        if used - cur.bytes + nxt.bytes <= budget_bytes:
            used += nxt.bytes - cur.bytes
            pos[b] += 1
            picks[b] = hulls[b][pos[b]]
            push(b)
    # Fill: what is left may still buy a smaller step off the hull for some block.
    for b, opts in enumerate(blocks):
        cur = opts[picks[b]]
        better = [i for i, o in enumerate(opts)
                  if o.recompute_s < cur.recompute_s and used - cur.bytes + o.bytes <= budget_bytes]
        if better:
            i = min(better, key=lambda i: opts[i].recompute_s)
            used += opts[i].bytes - cur.bytes
            picks[b] = i
    return Choice(tuple(picks), used, sum(blocks[b][picks[b]].recompute_s for b in range(len(blocks))), True)


def choose_within(blocks: Sequence[Sequence[Option]], transients: Sequence[Sequence[int]],
                  budget_bytes: float) -> tuple[Choice, int]:
    """`choose` where each option also has a backward working set (`transients[b][i]`) and
    the peak is what all blocks keep plus the largest working set among the chosen options
    (one block runs its backward at a time). Tries every cap T on the working set: options
    above T are left out and T comes off the budget; returns the fitting choice with the least
    recompute time (else the smallest peak) and its largest working set. Pure."""
    best: tuple | None = None
    for cap in sorted({t for ts in transients for t in ts}):
        allowed = [[i for i, t in enumerate(ts) if t <= cap] for ts in transients]
        if any(not a for a in allowed):
            continue
        c = choose([[blocks[b][i] for i in allowed[b]] for b in range(len(blocks))], budget_bytes - cap)
        picks = tuple(allowed[b][i] for b, i in enumerate(c.picks))
        work = max((transients[b][i] for b, i in enumerate(picks)), default=0)
        c = Choice(picks, c.bytes, c.recompute_s, c.bytes + work <= budget_bytes)
        key = (0, c.recompute_s, c.bytes + work) if c.fits else (1, c.bytes + work, c.recompute_s)
        if best is None or key < best[0]:
            best = (key, c, work)
    if best is None:
        return choose(blocks, budget_bytes), 0
    return best[1], best[2]
