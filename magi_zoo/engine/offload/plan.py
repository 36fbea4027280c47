"""What an offload plan is: the units the planner weighs (`Unit`), what it decides
(`OffloadPlan`), the error for a budget no plan meets, and the byte formatting they share.

Plain data (no torch): the planner (`planner.py`), the copy schedule (`schedule.py`), the
runtime and the reports all speak it. The rules that fill a plan are in `planner.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

GIB = 1024 ** 3
POOL_SEP = "+"  # joins the groups of a shared streaming pool's label (group labels never contain it)


def size(nbytes: float) -> str:
    """Bytes as GiB, or MiB / KiB for small (tiny test) models."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(nbytes) >= 0.1 * scale or unit == "KiB":
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def pool_of(pools: dict[str, tuple[int, int]]) -> dict[str, str]:
    """group -> the label of the streaming pool its blocks share (`OffloadPlan.slots`)."""
    return {g: label for label in pools for g in label.split(POOL_SEP)}


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

    def evictable_paths(self) -> set[str]:
        """Resident units the plan may evict for another phase (they keep a host copy)."""
        return {p for names in self.evict.values() for p in names}

    def host_held_paths(self) -> set[str]:
        """Units with a copy in pinned host memory, whose weights move during a call: the
        streamed ones and those that may be evicted."""
        return set(self.streamed) | self.evictable_paths()

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


def units_by_group(units: Sequence[Unit]) -> dict[str, list[Unit]]:
    """group -> its units, in the order given (execution order)."""
    out: dict[str, list[Unit]] = {}
    for u in units:
        out.setdefault(u.group, []).append(u)
    return out
