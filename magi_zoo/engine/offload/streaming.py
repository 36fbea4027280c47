"""The stream runtime: the live state of an applied offload plan that streams weights.

`OffloadRuntime` moves the weights the plan places:

- resident units and every weight outside a unit go to the device;
- a streamed unit's weights live in pinned host arenas (`arena.HostArenas`); its
  parameters' `.data` point there between uses;
- a forward pre-hook on the unit binds its parameters to views of a device buffer of its
  phase's pool (`device.BufferPool`: one flat buffer per slot, shared by every group of
  blocks of the phase; allocated once per phase and reused, so nothing fragments), waiting
  on the event of the copy that filled it, and issues the copies the schedule starts at this
  unit on a side CUDA stream; a forward post-hook points the parameters back to the host and
  records the event after which the buffer may be overwritten. Events, never synchronizes;
- when a unit of another component (phase) starts, the previous component's buffers are
  freed: the text encoder's buffers are gone before the denoising loop; with phase
  residency, resident units of other phases leave the card and come back before their own
  phase runs again.

On a CPU profile the same code runs with the host as the "device" (copies are synchronous
clones, streams and events are no-ops): that is how the mechanics are tested in CI.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any

import torch
import torch.nn as nn

from ..compat.diffusers import mark_execution_device, unmark_execution_device
from .arena import HostArenas
from .device import BufferPool, DeviceMemory, StreamedUnit, layout_offsets
from .plan import GIB, OffloadPlan, Unit, pool_of, size
from .planner import plan_offload
from .units import UnitSpec, planner_settings, resident_bytes, tensor_bytes

UNIT_ATTR = "_magi_zoo_offload_unit"  # on a streamed unit's module: (its runtime, its StreamedUnit)


@dataclasses.dataclass
class OffloadCounters:
    """What the runtime did (cumulative since apply)."""

    copies: int = 0  # units copied host -> device
    bytes_copied: int = 0
    prefetched: int = 0  # copies started ahead of use by the schedule
    demand: int = 0  # copies started by the unit's own pre-hook (the compute waits for all of it)
    deferred: int = 0  # scheduled copies postponed because no buffer was free
    phase_changes: int = 0  # a unit of another component ran: the previous one's buffers were freed
    refits: int = 0  # re-plans on measured activation peaks (`offload.refit`)
    evictions: int = 0  # phase residency: resident units that left the card for another phase
    reloads: int = 0  # ... and came back before their own phase ran again
    bytes_reloaded: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class OffloadRuntime:
    """The live state of one applied offload plan (see the module docstring)."""

    def __init__(self, root: nn.Module, plan: OffloadPlan, specs: list[UnitSpec], units: list[Unit],
                 device: torch.device, budget_bytes: int, planner: dict[str, Any] | None = None):
        self.root, self.plan, self.device, self.budget = root, plan, device, budget_bytes
        # What a refit re-plans with: the planner's units and settings as first applied; and
        # lookups by unit path (units never change, only where they live).
        self.specs, self.plan_units = specs, units
        self._spec_of = {s.path: s for s in specs}
        self._phase_of = {u.name: u.phase for u in units}
        self._group_of = {u.name: u.group for u in units}
        self.planner = planner_settings({}) if planner is None else planner  # plan_offload's settings
        # Phase residency: host copies of the resident units that may leave the card, which
        # of them are off it now, and their pre-hooks (they mark their phase's start).
        self.evict_host: dict[str, list[torch.Tensor]] = {}
        self.evicted: set[str] = set()
        self._evict_hooks: list[Any] = []
        self.cuda = device.type == "cuda"
        self.counters = OffloadCounters()
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._originals: list[tuple[torch.Tensor, torch.device]] = []  # (tensor, original device)
        self._marked: list[nn.Module] = []  # components tagged with the execution device
        self.units: dict[str, StreamedUnit] = {}
        self.phase: str | None = None  # the component whose units ran last
        self.measuring: dict[str, int] | None = None  # inside refit's measuring call: phase -> activation peak
        self.memory: DeviceMemory | None = DeviceMemory(device) if self.cuda else None
        sizes = [tensor_bytes(t) for s in specs if s.path in plan.host_held_paths() for t in s.tensors]
        self.host = HostArenas(self.cuda, HostArenas.total(sizes))
        self.over_budget_warned = False
        self._install()

    # -- setup / undo -----------------------------------------------------------------------
    def _install(self) -> None:
        streamed = set(self.plan.streamed)
        seen: set[int] = set()
        for t in [*self.root.parameters(), *self.root.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                self._originals.append((t, t.device))
        stream_ids = {id(t) for p in streamed for t in self._spec_of[p].tensors}
        # Stream first, then move the rest: weights built on the card leave it before the
        # resident ones arrive from the host, so the peak never holds both.
        groups = self._groups_for(self.plan)
        try:
            for path in self.plan.streamed:
                s = self._spec_of[path]
                self.units[path] = StreamedUnit(s, groups[self._group_of[path]], self._to_host(s.tensors))
            self._setup_residency()
            with torch.no_grad():
                for t, _ in self._originals:
                    if id(t) not in stream_ids and t.device != self.device:
                        t.data = t.data.to(self.device)
            for u in self.units.values():
                self._hook(u)
            self._mark_execution_device()
            if self.cuda:
                torch.cuda.empty_cache()  # the weights that left: give their memory back
                torch.cuda.reset_peak_memory_stats(self.device)
            self.weights_on_device = resident_bytes(self.root, self.device.type)
        except BaseException:
            self.remove()
            raise

    def _groups_for(self, plan: OffloadPlan) -> dict[str, BufferPool]:
        """group label -> its fresh buffer pool (no buffer allocated yet), for a plan's
        streamed units: the plan's pools (one per phase, shared by its groups of blocks),
        and one pool of one buffer per streamed one-of-a-kind unit."""
        shared = pool_of(plan.slots)
        pools: dict[str, BufferPool] = {}
        out: dict[str, BufferPool] = {}
        for path in plan.streamed:
            g = self._group_of[path]
            label = shared.get(g, g)
            nbytes = layout_offsets(self._spec_of[path].layout)[1]
            if label not in pools:
                n, _ = plan.slots.get(label, (1, 0))
                pools[label] = BufferPool(label, nbytes, n, transient=label not in plan.slots, phase=self._phase_of[path])
            pools[label].nbytes = max(pools[label].nbytes, nbytes)
            out[g] = pools[label]
        return out

    # -- phase residency --------------------------------------------------------------------
    def _setup_residency(self) -> None:
        """Host copies (kept) of the resident units the plan may evict, and a pre-hook that
        marks its phase's start on each resident unit that may leave or whose phase evicts
        others (a phase may begin with resident units only: streamed units' hooks alone
        would not see it start)."""
        movable = self.plan.evictable_paths()
        marks = [p for p in self.plan.resident if p in movable or self._phase_of[p] in self.plan.evict]
        for path in marks:
            s = self._spec_of[path]
            if path in movable and path not in self.evict_host:
                self.evict_host[path] = self._host_copy(s.tensors)
            ph = self._phase_of[path]
            self._evict_hooks.append(s.module.register_forward_pre_hook(
                lambda m, a, ph=ph: None if ph == self.phase else self._enter_phase(ph)))

    def _teardown_residency(self) -> None:
        """Every evicted unit back on the card, the residency hooks gone (refit, remove)."""
        self._reload(list(self.evicted))
        for h in self._evict_hooks:
            h.remove()
        self._evict_hooks = []

    def _reload(self, paths: list[str]) -> None:
        with torch.no_grad():
            for path in paths:
                for t, h in zip(self._spec_of[path].tensors, self.evict_host[path]):
                    # On the compute stream, before the unit's kernels: ordered, no event needed.
                    t.data = h.to(self.device, non_blocking=True, copy=True)
                self.evicted.discard(path)
                self.counters.reloads += 1
                self.counters.bytes_reloaded += self._spec_of[path].nbytes

    def _residency(self, phase: str) -> None:
        """Entering `phase`: the units the plan evicts for it leave the card (their weights
        point at their host copies; the device memory returns to the allocator, reusable by
        this phase at once, since the compute stream orders it after their last kernels); the
        units of `phase` that another phase evicted come back."""
        with torch.no_grad():
            for path in self.plan.evict.get(phase, ()):
                if path not in self.evicted:
                    for t, h in zip(self._spec_of[path].tensors, self.evict_host[path]):
                        t.data = h
                    self.evicted.add(path)
                    self.counters.evictions += 1
        self._reload([p for p in self.evicted if self._phase_of[p] == phase])

    def _hook(self, u: StreamedUnit) -> None:
        m = u.spec.module
        u.handles = [m.register_forward_pre_hook(self._pre_hook(u)),
                     m.register_forward_hook(self._post_hook(u), always_call=True)]
        m.__dict__[UNIT_ATTR] = (self, u)  # what `streams()` / `hold()` read

    def _unhook(self, u: StreamedUnit) -> None:
        for h in u.handles:
            h.remove()
        u.handles = []
        u.spec.module.__dict__.pop(UNIT_ATTR, None)

    def refit(self, phase_activation_bytes: dict[str, int]) -> tuple[list[str], list[str]]:
        """Re-plan with these per-phase activation reserves (measured: `offload.refit`) and
        move the units whose place changes: units the new plan keeps resident come onto the
        card for good (hooks removed), units it streams go to host memory (hooks added).
        Returns (made resident, made streamed). Between calls only: nothing may run or be
        held. Parameters keep their shapes, dtypes and devices, so compiled blocks do not
        recompile (tests count it)."""
        if self._running or any(u.holds for u in self.units.values()):
            raise RuntimeError("offload refit: a streamed unit is running or held; refit between calls")
        new = plan_offload(self.plan_units, fixed_bytes=self.plan.fixed, activation_bytes=self.plan.activation,
                           budget_bytes=self.budget, phase_activation_bytes=phase_activation_bytes, **self.planner)
        if self.cuda:
            torch.cuda.synchronize(self.device)  # no copy or kernel still reads a buffer
        self._teardown_residency()  # every resident unit on the card while units move
        old, now = set(self.plan.streamed), set(new.streamed)
        promote = [p for p in self.plan.streamed if p not in now]
        demote = [p for p in new.streamed if p not in old]
        with torch.no_grad():
            for u in self.units.values():  # every buffer dropped: the new plan sizes its own pools
                if u.slot is not None:
                    for t, h in zip(u.spec.tensors, u.host):
                        t.data = h
                    u.slot, u.ready = None, None
            for path in demote:  # leave the card first, so the peak never holds both
                s = self._spec_of[path]
                self.units[path] = StreamedUnit(s, None, self._to_host(s.tensors))  # type: ignore[arg-type]
            for path in promote:
                u = self.units.pop(path)
                self._unhook(u)
                for t, h in zip(u.spec.tensors, u.host):
                    # Its host copy stays in the arena (arenas are not split); the card
                    # holds the weights from now on.
                    t.data = h.to(self.device, copy=True)
        groups = self._groups_for(new)
        for path, u in self.units.items():
            u.group = groups[self._group_of[path]]
        for path in demote:
            self._hook(self.units[path])
        self.plan, self.phase = new, None
        self.evict_host = {p: v for p, v in self.evict_host.items() if p not in now}  # streamed: own host copy
        self._setup_residency()
        self.over_budget_warned = False  # the next calls check the measured peak again
        for u in self.units.values():
            u.checks = 0
        if self.cuda:
            torch.cuda.empty_cache()
        self.weights_on_device = resident_bytes(self.root, self.device.type)
        return promote, demote

    def _host_copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy a unit's tensors into the host arenas (pinned when CUDA is there: only pinned
        memory copies asynchronously, ~55 GB/s against ~4.4 pageable); returns the views."""
        views = []
        with torch.no_grad():
            for t in tensors:
                v = self.host.take(tensor_bytes(t)).view(t.dtype).view(t.shape)
                v.copy_(t.data)
                views.append(v)
        return views

    def _to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`_host_copy`, then each tensor's .data points at its view (the unit streams)."""
        views = self._host_copy(tensors)
        with torch.no_grad():
            for t, v in zip(tensors, views):
                t.data = v
        return views

    def _mark_execution_device(self) -> None:
        """Tag every component (child of the root) that has no hook of its own with the card
        as its execution device: diffusers pipelines make prompt ids, latents and timesteps
        on the first component's parameter device, which is the host for a streamed one
        (`compat.diffusers.mark_execution_device`); undone by `remove`."""
        if self.device.type == "cpu":
            return
        for comp in [self.root, *self.root.children()]:
            if mark_execution_device(comp, self.device):
                self._marked.append(comp)

    def remove(self) -> None:
        """Exact undo: every tensor back on its original device with its values, hooks gone."""
        self._teardown_residency()
        for u in self.units.values():
            self._unhook(u)
        for comp in self._marked:
            unmark_execution_device(comp)
        self._marked = []
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        streamed = {id(x) for u in self.units.values() for x in u.spec.tensors}
        with torch.no_grad():
            for t, dev in self._originals:
                if t.device != dev or id(t) in streamed:
                    # A copy, never a view: a streamed tensor lives in its unit's (pinned)
                    # host buffer, which must not outlive the plan.
                    t.data = t.data.to(dev, copy=True)
        self._originals.clear()
        self.units.clear()
        self.host = HostArenas(self.cuda)  # the arenas go with the last views into them
        if self.cuda:
            torch.cuda.empty_cache()

    # -- copies -----------------------------------------------------------------------------
    def _alloc(self, g: BufferPool) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor (see BufferPool.bind)
            return torch.empty(g.nbytes, dtype=torch.uint8, device=self.device)

    def _issue(self, u: StreamedUnit, demand: bool) -> bool:
        """Start the copy of `u` into a free buffer of its group; False if none is free."""
        g = u.group
        if not g.free:
            return False
        i = g.free.popleft()
        fresh = g.slots[i] is None
        if fresh:
            g.slots[i] = self._alloc(g)
        dst = g.bind(i, u.spec.layout)
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self.stream):
                if fresh:  # the new memory may still be read by queued compute kernels
                    self.stream.wait_stream(compute)
                elif g.free_event[i] is not None:
                    self.stream.wait_event(g.free_event[i])
                with torch.no_grad():
                    for d, s in zip(dst, u.host):
                        d.copy_(s, non_blocking=True)
                u.ready = torch.cuda.Event()
                u.ready.record(self.stream)
        else:
            with torch.no_grad():
                for d, s in zip(dst, u.host):
                    d.copy_(s)
        u.slot = i
        c = self.counters
        c.copies += 1
        c.bytes_copied += u.spec.nbytes
        if demand:
            c.demand += 1
        else:
            c.prefetched += 1
        return True

    def _steal(self, u: StreamedUnit) -> None:
        """No buffer free for a unit about to run: take one from a prefetched unit that has
        not run yet (it will be copied again on demand). Happens only when the calls do not
        follow the planned order."""
        for v in self.units.values():
            if (v is not u and v.group is u.group and v.slot is not None and v.spec.module not in self._running
                    and not v.holds):  # a held unit's buffer still backs its weights
                v.group.free.appendleft(v.slot)
                v.slot, v.ready = None, None
                return
        raise RuntimeError(f"offload: no free buffer for {u.spec.path}; every buffer of group "
                           f"{u.group.label} is in use (a streamed unit called inside another of its group, "
                           "or more of its units held at once by offload.hold than it has buffers?)")

    # -- hooks ------------------------------------------------------------------------------
    _running: set = frozenset()

    def _pre_hook(self, u: StreamedUnit):
        def hook(module, args):
            if torch.is_grad_enabled() and any(t.requires_grad for t in u.spec.tensors):
                raise RuntimeError(f"{u.spec.path} streams its weights (offload), which is inference-only; call it "
                                   "under torch.no_grad() / torch.inference_mode(), or raise the memory budget so "
                                   "it stays resident")
            if u.group.phase != self.phase:
                self._enter_phase(u.group.phase)
            if u.slot is None:
                if not self._issue(u, demand=True):
                    self._steal(u)
                    self._issue(u, demand=True)
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(u.ready)
            with torch.no_grad():
                for t, d in zip(u.spec.tensors, u.group.bind(u.slot, u.spec.layout)):
                    t.data = d
            self._running = self._running | {module}
            for name in self.plan.schedule.get(u.spec.path, ()):
                v = self.units.get(name)
                if v is not None and v.slot is None and not self._issue(v, demand=False):
                    self.counters.deferred += 1
        return hook

    def _post_hook(self, u: StreamedUnit):
        def hook(module, args, output):
            self._running = self._running - {module}
            if not u.holds:  # inside hold(): the next call reuses the weights on the card
                self._release(u)
        return hook

    def end_hold(self, u: StreamedUnit) -> None:
        """The last `hold()` block on `u` ended: its buffer goes back unless it is running."""
        if not u.holds and u.slot is not None and u.spec.module not in self._running:
            self._release(u)

    def _release(self, u: StreamedUnit) -> None:
        """After a unit's (last held) call: its tensors point at host memory again and its
        buffer goes back to the group's free list once the compute stream is past it."""
        with torch.no_grad():
            for t, h in zip(u.spec.tensors, u.host):
                t.data = h
        g, i = u.group, u.slot
        if i is None:
            return
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            g.free_event[i] = ev
            if u.checks < 2:  # the first calls: does the measured peak hold the budget?
                u.checks += 1
                self._check_peak()
        if g.transient:
            # A one-of-a-kind unit (a component): its buffer is freed on the compute
            # stream, ordered after its use, so the memory is back for the next phase.
            g.drop(i)
        g.free.append(i)
        u.slot, u.ready = None, None

    def record_phase_peak(self) -> None:
        """Inside refit's measuring call: the peak reserved memory since the current phase
        began, beyond the weights on the card and the buffers alive now, is that phase's
        activations (cached-but-free blocks count: the cap counts them too); the peak
        statistics restart for the next phase. Allocator statistics are host-side: no sync."""
        if self.measuring is None or self.phase is None:
            return
        act = max(0, self.memory.peak_reserved() - self.weights_on_device - self._buffer_bytes())
        self.measuring[self.phase] = max(self.measuring.get(self.phase, 0), act)
        self.memory.reset_peak()

    def _buffer_bytes(self) -> int:
        """Bytes of the streaming buffers allocated now (each group once)."""
        return sum({id(u.group): sum(b.numel() for b in u.group.slots if b is not None)
                    for u in self.units.values()}.values())

    def _enter_phase(self, phase: str) -> None:
        """A unit of another component runs: free every other component's buffers (the plan
        counts buffers per phase). Copies still in flight into them (the next call's first
        blocks, prefetched) are dropped; the compute stream first waits for the side stream,
        so the memory is reused only after those copies finished."""
        if self.measuring is not None:
            self.record_phase_peak()
        if self.cuda and self.phase is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        for v in self.units.values():
            g = v.group
            if g.phase == phase or v.spec.module in self._running:
                continue
            if v.slot is not None:  # prefetched, not run: copied again when it runs
                g.free.append(v.slot)
                v.slot, v.ready = None, None
        for g in {id(v.group): v.group for v in self.units.values()}.values():
            if g.phase != phase and len(g.free) == len(g.slots):  # nothing of it runs or holds data
                g.drop()
                g.free = collections.deque(range(len(g.slots)))
        self.phase = phase
        self.counters.phase_changes += 1
        if self.plan.evict or self.evicted:
            self._residency(phase)

    def _check_peak(self) -> None:
        peak = torch.cuda.max_memory_reserved(self.device)
        if peak > self.budget and not self.over_budget_warned:
            self.over_budget_warned = True
            warnings.warn(f"magi_zoo offload: the measured peak ({size(peak)} reserved) exceeds the "
                          f"{size(self.budget)} budget; the activations need more than the reserve, or the "
                          "allocator holds freed blocks it cannot reuse. Set a larger activation reserve (offload "
                          "'' = {activation_gib = ...}, or phase_activation_gib on a unit of the phase that peaks, "
                          "e.g. the VAE), a larger budget, or PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                          "before CUDA starts (fewer reserved-but-unused blocks)",
                          RuntimeWarning, stacklevel=2)

    def stats(self) -> dict[str, Any]:
        """Counters, plus the measured device peaks on CUDA (since apply)."""
        out: dict[str, Any] = self.counters.to_dict()
        out["pinned_host_gib" if self.cuda else "host_gib"] = round(self.host.bytes / GIB, 3)
        buffers = self._buffer_bytes()
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            out["max_allocated_gib"] = round(peak / GIB, 3)
            out["max_reserved_gib"] = round(torch.cuda.max_memory_reserved(self.device) / GIB, 3)
            # What the activations took at the peak: allocated minus resident weights and the
            # streaming buffers alive now (a one-of-a-kind unit's buffer is gone after its call,
            # so for a peak inside such a unit this overestimates by its size).
            out["measured_activation_gib"] = round((peak - self.weights_on_device - buffers) / GIB, 3)
            out["activation_reserve_gib"] = round(self.plan.activation / GIB, 3)
        return out
