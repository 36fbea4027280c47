"""The offload step: keep what fits on the card, stream the rest from pinned host memory.

The `offload` plan section (`specs/offload_spec.py`) names the *units* that may stream
(repeated block classes, whole components) and the budget (root key ""; default: the GPU
profile's memory). `plan_units` measures the units' weight bytes and hands them to the pure
planner (`offload_plan.plan_offload`); when everything fits the step changes nothing and
says so. Otherwise `OffloadRuntime` moves the weights:

- resident units and every weight outside a unit go to the device;
- a streamed unit's weights live in pinned host arenas (`HostArenas`); its parameters'
  `.data` point there between uses;
- a forward pre-hook on the unit binds its parameters to views of a device buffer of its
  phase's pool (one flat buffer per slot, shared by every group of blocks of the phase;
  allocated once per phase and reused, so nothing fragments), waiting on the
  event of the copy that filled it, and issues the copies the schedule starts at this unit
  on a side CUDA stream; a forward post-hook points the parameters back to the host and
  records the event after which the buffer may be overwritten. Events, never synchronizes;
- when a unit of another component (phase) starts, the previous component's buffers are
  freed: the text encoder's buffers are gone before the denoising loop.

Why hooks work with regional compile: the compile step installs the compiled `forward` on
each block *instance*; `nn.Module.__call__` runs the module's hooks around it, so the
copies happen outside the compiled region, never traced into. Dynamo guards a parameter by
its metadata (shape, stride, dtype, device), not its storage, and the views a unit gets
have the layout of the weights they replace (each at a 256-byte aligned offset, as inductor
wants), so swapping storages recompiles nothing (tests count it). Regions that would trace *into* a streamed unit (a compiled ancestor) and
CUDA graphs (which bake weight addresses into the graph) are refused.

On a CPU profile the same code runs with the host as the "device" (copies are synchronous
clones, streams and events are no-ops): that is how the mechanics are tested in CI.
Inference only: a streamed unit called with gradients on raises (its weights would change
under autograd's saved tensors).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import warnings
from typing import Any, Sequence

import torch
import torch.nn as nn

from .offload_plan import GIB, OffloadPlan, OffloadPlanError, Unit, phase_activations, plan_offload, pool_of, POOL_SEP, size
from .compile import cuda_graphs_by
from .steps import StepContext, StepRecord

_RUNTIME = "_magi_zoo_offload"  # root instance attr: the live OffloadRuntime
_ALIGN = 256  # byte alignment of each tensor inside a unit's host buffer


def _evictable_paths(plan: OffloadPlan) -> set[str]:
    """Resident units the plan may evict for another phase (they keep a host copy)."""
    return {p for names in plan.evict.values() for p in names}


def _host_held_paths(plan: OffloadPlan) -> set[str]:
    """Units with a copy in pinned host memory: the streamed ones and those that may be evicted."""
    return set(plan.streamed) | _evictable_paths(plan)


def resident_bytes(root: nn.Module, device_type: str) -> int:
    """Bytes of parameters and buffers on `device_type` under `root` (shared tensors once)."""
    seen, total = set(), 0
    for t in [*root.parameters(), *root.buffers()]:
        if t.device.type == device_type and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # works on meta tensors too


# -- which tensors belong to which unit -------------------------------------------------------

@dataclasses.dataclass
class UnitSpec:
    """A unit found in the tree: its module and the tensors it owns (not a nested unit's)."""

    path: str
    module: nn.Module
    mode: str
    once: bool
    tensors: list[torch.Tensor]  # parameters and buffers, each once
    layout: tuple  # ((shape, dtype) per tensor): units with one layout share buffers
    phase_activation_gib: float | None = None  # its phase's activation peak, when above the plan-wide reserve

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors)


def _owned(module: nn.Module, path: str, unit_paths: set[str]) -> list[torch.Tensor]:
    """Tensors under `module` not under a nested unit (each once, in registration order)."""
    out, seen = [], set()
    for sub_path, sub in module.named_modules(prefix=path):
        owner = sub_path
        while owner != path and owner not in unit_paths:  # the nearest unit at or above sub
            owner = owner.rpartition(".")[0]
        if owner != path:
            continue
        for t in [*sub._parameters.values(), *sub._buffers.values()]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def find_units(ctx_plan, root: nn.Module) -> tuple[list[UnitSpec], dict[str, Any]]:
    """The units the resolved offload section names, in execution (tree) order, and the
    plan-wide settings of the root key. Errors: a unit field on the root, a plan-wide field
    on a unit, a unit with no weights."""
    section = ctx_plan.section("offload")
    settings: dict[str, Any] = {}
    chosen = []
    for t in section.targets:
        spec = t.spec
        if t.path == "":
            if "mode" in spec.model_fields_set:
                raise ValueError("offload key '' (the root): the root is never a unit; set mode on the blocks "
                                 "or components that may stream (e.g. WanTransformerBlock = 'auto')")
            settings = spec.root_fields()
            if spec.phase_activation_gib is not None:
                raise ValueError("offload key '' (the root): phase_activation_gib belongs to a unit (the peak "
                                 "while its component runs); the plan-wide reserve is activation_gib")
            continue
        wrong = spec.root_fields()
        if wrong:
            raise ValueError(f"offload key {t.key!r}: {', '.join(wrong)} apply to the whole plan; set them on "
                             "the root key '' (e.g. load(..., memory_budget_gib=24) or [default.offload] \"\" = "
                             "{ memory_budget_gib = 24 })")
        chosen.append(t)
    paths = {t.path for t in chosen}
    units = []
    for t in chosen:
        tensors = _owned(t.module, t.path, paths)
        if not tensors:
            continue  # a component whose weights all sit in nested units
        units.append(UnitSpec(t.path, t.module, t.spec.mode, t.spec.once, tensors,
                              tuple((tuple(x.shape), x.dtype) for x in tensors), t.spec.phase_activation_gib))
    return units, settings


def _groups(units: list[UnitSpec]) -> dict[str, str]:
    """unit path -> group label: units of one component (phase), class and layout share
    buffers. The label is the class name, suffixed '#k' when one class has several layouts,
    and prefixed 'component/' when the class appears in several components (Wan2.2's two
    experts each get their own buffers: they run in different phases)."""
    keys: dict[str, tuple] = {}
    layouts: dict[str, list[tuple]] = {}
    phases: dict[str, set[str]] = {}
    for u in units:
        cls = type(u.module).__name__
        seen = layouts.setdefault(cls, [])
        if u.layout not in seen:
            seen.append(u.layout)
        phases.setdefault(cls, set()).add(_phase(u.path))
        keys[u.path] = (cls, seen.index(u.layout))
    out = {}
    for u in units:
        cls, i = keys[u.path]
        label = cls if i == 0 else f"{cls}#{i}"
        out[u.path] = f"{_phase(u.path)}/{label}" if len(phases[cls]) > 1 else label
    return out


def _phase(path: str) -> str:
    """The component a unit runs in (its first path segment): units of different components
    never run interleaved."""
    return path.split(".")[0]


def plan_units(root: nn.Module, resolved_plan, profile, *, budget_gib: float | None = None,
               times_s: dict[str, float] | None = None) -> tuple[OffloadPlan | None, list[UnitSpec], list[Unit], dict]:
    """Measure the units and run the planner. Returns (plan or None when the section names no
    unit, unit specs, planner units, settings). Works on meta-device trees (sizes only)."""
    specs, settings = find_units(resolved_plan, root)
    if not specs:
        return None, [], [], settings
    budget = budget_gib if budget_gib is not None else settings.get("memory_budget_gib") or profile.memory_gib
    activation = settings.get("activation_gib")
    activation = 0.1 * budget if activation is None else activation
    groups = _groups(specs)
    owned = {id(t) for u in specs for t in u.tensors}
    fixed, seen = 0, set()
    for t in [*root.parameters(), *root.buffers()]:
        if id(t) not in owned and id(t) not in seen:
            seen.add(id(t))
            fixed += _nbytes(t)
    units = [Unit(u.path, u.nbytes, groups[u.path], _phase(u.path), u.mode, (times_s or {}).get(u.path), u.once,
                  None if u.phase_activation_gib is None else int(u.phase_activation_gib * GIB))
             for u in specs]
    plan = plan_offload(units, fixed_bytes=fixed, activation_bytes=int(activation * GIB),
                        budget_bytes=int(budget * GIB), **planner_settings(settings))
    return plan, specs, units, {**settings, "memory_budget_gib": budget, "activation_gib": activation}


def planner_settings(settings: dict) -> dict[str, Any]:
    """The offload root's settings `plan_offload` takes (copy rate, prefetch depth, phase
    residency), defaults filled in: one reading for the first plan and every refit."""
    return {"bandwidth_bytes_s": settings.get("host_bandwidth_gbs", 55.0) * 1e9,
            "prefetch": settings.get("prefetch", 1), "phase_residency": settings.get("phase_residency", False)}


# -- host memory ------------------------------------------------------------------------------

def available_host_bytes() -> int | None:
    """Memory the host can still give (psutil, else /proc/meminfo; None if unknown)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(need: int, *, already_on_host: int = 0) -> None:
    """Refuse a plan whose pinned host buffers the host cannot hold (pinned memory cannot be
    swapped: running out would stall the whole machine, not just this process)."""
    avail = available_host_bytes()
    if avail is None:
        return
    extra = need - already_on_host  # weights already in host memory are copied, then freed, unit by unit
    if extra > avail:
        raise MemoryError(
            f"weight streaming needs {need / GIB:.1f} GiB of pinned host memory; this host has "
            f"{avail / GIB:.1f} GiB available ({already_on_host / GIB:.1f} GiB of it already held by the "
            "weights). Raise memory_budget_gib (fewer streamed blocks), use a host with more memory, "
            "or free memory first")


# -- the runtime ------------------------------------------------------------------------------

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


class HostArenas:
    """Host memory for streamed weights, in arenas of `ARENA` bytes packed first-fit.

    Why arenas: torch's pinned-memory allocator rounds every request up to a power of two,
    so one pinned buffer per 0.75 GiB Wan block would take 1 GiB (a third wasted over 24
    blocks). Arenas of exactly 2^30 bytes waste only their tails; a tensor larger than half
    an arena gets its own buffer (e.g. UMT5's 1.96 GiB embedding: a 2 GiB one)."""

    ARENA = 1 << 30

    def __init__(self, pinned: bool, total: int = ARENA):
        self.pinned = pinned
        # A model smaller than an arena gets one buffer of the next power of two above it.
        self.arena = min(self.ARENA, 1 << max(total - 1, 1).bit_length())
        self.buffers: list[torch.Tensor] = []
        self._free: list[int] = []  # free bytes at the end of each arena (-1: a dedicated buffer)
        self.bytes = 0  # host bytes held (what the host check counts)

    @staticmethod
    def rounded(sizes: Sequence[int], pinned: bool) -> int:
        """Host bytes `take` will hold for these tensor sizes (the same packing, no memory)."""
        arenas = HostArenas(pinned, HostArenas.total(sizes))
        arenas._alloc = lambda n: None  # type: ignore[method-assign]
        for n in sizes:
            arenas.take(n)
        return arenas.bytes

    @staticmethod
    def total(sizes: Sequence[int]) -> int:
        return sum((n + _ALIGN - 1) // _ALIGN * _ALIGN for n in sizes)

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)

    def take(self, nbytes: int) -> torch.Tensor | None:
        need = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if need > self.arena // 2:
            size = 1 << (need - 1).bit_length() if self.pinned else need  # what the pinned allocator holds
            buf = self._alloc(need)
            self.buffers.append(buf)
            self._free.append(-1)
            self.bytes += size
            return None if buf is None else buf[:nbytes]
        for i, free in enumerate(self._free):
            if free >= need:
                break
        else:
            self.buffers.append(self._alloc(self.arena))
            self._free.append(self.arena)
            self.bytes += self.arena
            i = len(self._free) - 1
        off = self.arena - self._free[i]
        self._free[i] -= need
        buf = self.buffers[i]
        return None if buf is None else buf[off:off + nbytes]


def _offsets(layout: tuple) -> tuple[list[int], int]:
    """Byte offsets of a layout's tensors packed in one flat buffer (each aligned), and its size."""
    offs, n = [], 0
    for shape, dtype in layout:
        offs.append(n)
        n += (math.prod(shape) * dtype.itemsize + _ALIGN - 1) // _ALIGN * _ALIGN
    return offs, n


class _Group:
    """A pool of device buffers (slots) shared by the streamed units of one phase (a
    one-of-a-kind unit has its own). A slot is one flat byte buffer of the pool's largest
    unit; a unit runs on views of it laid out like its weights."""

    def __init__(self, label: str, nbytes: int, n_slots: int, transient: bool, phase: str):
        self.label, self.nbytes, self.transient, self.phase = label, nbytes, transient, phase
        self.slots: list[torch.Tensor | None] = [None] * n_slots
        self.views: dict[tuple[int, tuple], list[torch.Tensor]] = {}  # (slot, layout) -> its tensor views
        self.free = collections.deque(range(n_slots))
        self.free_event: list[Any] = [None] * n_slots  # event after which the slot may be overwritten

    def drop(self, i: int | None = None) -> None:
        """Forget slot i's buffer (every slot's when None): freed once its last view goes."""
        for k in range(len(self.slots)) if i is None else (i,):
            self.slots[k] = None
            self.free_event[k] = None
        self.views = {key: v for key, v in self.views.items() if i is not None and key[0] != i}

    def bind(self, i: int, layout: tuple) -> list[torch.Tensor]:
        """Slot i's buffer seen as tensors of `layout` (cached while the buffer lives)."""
        key = (i, layout)
        if key not in self.views:
            buf, (offs, _) = self.slots[i], _offsets(layout)
            with torch.inference_mode(False), torch.no_grad():
                # Plain tensors even inside inference_mode: the parameters must keep the same
                # dispatch keys call after call, or dynamo's guards would see a new tensor kind.
                self.views[key] = [buf[o:o + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                                   for o, (shape, dtype) in zip(offs, layout)]
        return self.views[key]


class _Streamed:
    def __init__(self, spec: UnitSpec, group: _Group, host: list[torch.Tensor]):
        self.spec, self.group, self.host = spec, group, host
        self.handles: list[Any] = []  # its pre/post hooks (removed when a refit makes it resident)
        self.slot: int | None = None
        self.ready: Any = None  # event recorded after its copy
        self.checks = 0
        self.holds = 0  # open `hold()` blocks: the weights stay on the card between calls


class _ExecutionDevice:
    """Marks a component whose weights may sit on the host as executing on the card.

    diffusers pipelines create prompt ids, latents and timesteps on `_execution_device`,
    which is the first component's parameter device unless the component carries an
    accelerate-style `_hf_hook` with an `execution_device` (the convention accelerate's
    sequential offload uses). With streamed units that parameter device is the host, so
    without this marker token ids would stay on the CPU while the embedding runs on the card.
    `detach_hook` keeps `pipeline.remove_all_hooks()` working."""

    def __init__(self, device: torch.device):
        self.execution_device = device

    def detach_hook(self, module: nn.Module) -> nn.Module:
        return module


class _DeviceMemory:
    """The CUDA allocator's statistics, as refit reads them (tests substitute a fake: a CPU
    run has no allocator statistics)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def peak_reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


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
        self.units: dict[str, _Streamed] = {}
        self.phase: str | None = None  # the component whose units ran last
        self.measuring: dict[str, int] | None = None  # inside refit's measuring call: phase -> activation peak
        self.memory: _DeviceMemory | None = _DeviceMemory(device) if self.cuda else None
        sizes = [_nbytes(t) for s in specs if s.path in _host_held_paths(plan) for t in s.tensors]
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
                self.units[path] = _Streamed(s, groups[self._group_of[path]], self._to_host(s.tensors))
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

    def _groups_for(self, plan: OffloadPlan) -> dict[str, _Group]:
        """group label -> its fresh buffer pool (no buffer allocated yet), for a plan's
        streamed units: the plan's pools (one per phase, shared by its groups of blocks),
        and one pool of one buffer per streamed one-of-a-kind unit."""
        shared = pool_of(plan.slots)
        pools: dict[str, _Group] = {}
        out: dict[str, _Group] = {}
        for path in plan.streamed:
            g = self._group_of[path]
            label = shared.get(g, g)
            nbytes = _offsets(self._spec_of[path].layout)[1]
            if label not in pools:
                n, _ = plan.slots.get(label, (1, 0))
                pools[label] = _Group(label, nbytes, n, transient=label not in plan.slots, phase=self._phase_of[path])
            pools[label].nbytes = max(pools[label].nbytes, nbytes)
            out[g] = pools[label]
        return out

    # -- phase residency --------------------------------------------------------------------
    def _setup_residency(self) -> None:
        """Host copies (kept) of the resident units the plan may evict, and a pre-hook that
        marks its phase's start on each resident unit that may leave or whose phase evicts
        others (a phase may begin with resident units only: streamed units' hooks alone
        would not see it start)."""
        movable = _evictable_paths(self.plan)
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

    def _hook(self, u: _Streamed) -> None:
        m = u.spec.module
        u.handles = [m.register_forward_pre_hook(self._pre_hook(u)),
                     m.register_forward_hook(self._post_hook(u), always_call=True)]
        m.__dict__[_UNIT_ATTR] = (self, u)  # what `streams()` / `hold()` read

    def _unhook(self, u: _Streamed) -> None:
        for h in u.handles:
            h.remove()
        u.handles = []
        u.spec.module.__dict__.pop(_UNIT_ATTR, None)

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
                self.units[path] = _Streamed(s, None, self._to_host(s.tensors))  # type: ignore[arg-type]
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
                v = self.host.take(_nbytes(t)).view(t.dtype).view(t.shape)
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
        as its execution device (see `_ExecutionDevice`); undone by `remove`."""
        if self.device.type == "cpu":
            return
        for comp in [self.root, *self.root.children()]:
            if "_hf_hook" not in comp.__dict__:
                comp.__dict__["_hf_hook"] = _ExecutionDevice(self.device)
                self._marked.append(comp)

    def remove(self) -> None:
        """Exact undo: every tensor back on its original device with its values, hooks gone."""
        self._teardown_residency()
        for u in self.units.values():
            self._unhook(u)
        for comp in self._marked:
            if isinstance(comp.__dict__.get("_hf_hook"), _ExecutionDevice):
                del comp.__dict__["_hf_hook"]
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
    def _alloc(self, g: _Group) -> torch.Tensor:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor (see _Group.bind)
            return torch.empty(g.nbytes, dtype=torch.uint8, device=self.device)

    def _issue(self, u: _Streamed, demand: bool) -> bool:
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

    def _steal(self, u: _Streamed) -> None:
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

    def _pre_hook(self, u: _Streamed):
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

    def _post_hook(self, u: _Streamed):
        def hook(module, args, output):
            self._running = self._running - {module}
            if not u.holds:  # inside hold(): the next call reuses the weights on the card
                self._release(u)
        return hook

    def _release(self, u: _Streamed) -> None:
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

    def _phase_peak(self) -> None:
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
            self._phase_peak()
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


def needs_streaming(root: nn.Module, layers, profile, preparations=()) -> OffloadPlan | None:
    """The offload plan for a tree (typically built on the meta device: sizes only) when it
    streams anything, else None. `load` asks this before building on the card, so a model
    that does not fit is built in host memory and the offload step places it."""
    from .apply import preview

    plan, _, _, _ = plan_units(root, preview(root, layers, preparations), profile)
    return plan if plan is not None and plan.streams else None


def profile_units(root: nn.Module, paths: Sequence[str], call, device: torch.device | str) -> dict[str, float]:
    """Seconds of compute per call of each named submodule over one `call()` (after one
    unrecorded warm-up call; CUDA events on
    the compute stream, so a streamed unit's wait for its copy is not counted; perf_counter
    on CPU): the per-block timing profile `plan_units(..., times_s=...)` takes to make a JIT
    schedule and to simulate the stalls of a plan."""
    import time

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
    out = {}
    for p, pairs in marks.items():
        done = [pr for pr in pairs if len(pr) == 2]
        if done:
            secs = [(b - a) if not cuda else a.elapsed_time(b) / 1e3 for a, b in done]
            out[p] = sum(secs) / len(secs)
    return out


_UNIT_ATTR = "_magi_zoo_offload_unit"  # on a streamed unit's module: (its runtime, its state)


def streams(module: nn.Module) -> bool:
    """Whether `module` is a unit whose weights stream under an applied offload plan."""
    return _UNIT_ATTR in module.__dict__


@contextlib.contextmanager
def hold(module: nn.Module):
    """Keep a streamed unit's weights on the card across the calls inside the block: one
    copy serves them all, instead of one per call. For models that run a block several
    times per step on different inputs (BAGEL's classifier-free guidance runs every layer
    once per context): calling each layer for every context before the next layer, inside
    `hold(layer)`, streams each layer once per step. A no-op for a module that does not
    stream (resident, or no plan), so callers need not check."""
    entry = module.__dict__.get(_UNIT_ATTR)
    if entry is None:
        yield
        return
    rt, u = entry
    u.holds += 1
    try:
        yield
    finally:
        u.holds -= 1
        if not u.holds and u.slot is not None and module not in rt._running:
            rt._release(u)


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
            import difflib

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
            rt._phase_peak()
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


def runtime(root: nn.Module) -> OffloadRuntime | None:
    """The live offload runtime of an applied plan (None when nothing streams)."""
    return root.__dict__.get(_RUNTIME)


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
    _check_compile(ctx, [*plan.streamed, *sorted(_evictable_paths(plan))])
    if getattr(ctx, "train", False):
        raise ValueError(f"the offload plan streams {len(plan.streamed)} unit(s) to fit {size(plan.budget)}, but weight "
                         "streaming is inference-only and this is a training apply (train=True); raise "
                         "memory_budget_gib until the weights stay resident (magi-zoo spec MODEL --memory-budget G "
                         "shows the plan), or pin the trained units (offload mode='resident')")
    device = torch.device(p.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"offload for profile {p.name!r} needs CUDA, which is not available here")
    streamed = [t for s in specs if s.path in _host_held_paths(plan) for t in s.tensors]
    pinned = HostArenas.rounded([_nbytes(t) for t in streamed], pinned=device.type == "cuda")
    on_host = sum(_nbytes(t) for t in streamed if t.device.type == "cpu")
    details["pinned_host_gib"] = round(pinned / GIB, 3)
    if os.environ.get("MAGI_ZOO_SKIP_HOST_CHECK") != "1":
        check_host_memory(pinned, already_on_host=on_host)
    rt = OffloadRuntime(ctx.root, plan, specs, units, device, plan.budget, planner_settings(settings))
    ctx.root.__dict__[_RUNTIME] = rt
    details["counters"] = rt.counters  # live: what the runtime did (`offload.runtime(root).stats()`)

    def undo() -> None:
        ctx.root.__dict__.pop(_RUNTIME, None)
        rt.remove()

    did = plan.summary(units) + f"; {'pinned ' if device.type == 'cuda' else ''}host memory held {size(pinned)}"
    return StepRecord("offload", did, undo, details)


def describe_plan(root: nn.Module, resolved_plan, profile, budget_gib: float | None = None) -> str:
    """The offload plan as text (`magi-zoo spec`): budget, what stays, what streams, buffers,
    expected copy time per call and expected peak; or why there is none."""
    try:
        plan, specs, units, settings = plan_units(root, resolved_plan, profile, budget_gib=budget_gib)
    except OffloadPlanError as e:
        return f"[offload plan]\n  refused: {e}"
    if plan is None:
        return "[offload plan]\n  (no offload units in the spec: nothing may stream)"
    lines = ["[offload plan]", f"  {plan.summary(units)}"]
    if plan.streams:
        by_group: dict[str, list[str]] = {}
        for u in units:
            by_group.setdefault(u.group, []).append(u.name)
        for g, names in by_group.items():
            res = [n for n in names if n in plan.resident]
            n_str = len(names) - len(res)
            if len(names) > 1 and res and n_str:
                short = ", ".join(n.rsplit(".", 1)[-1] for n in res)
                lines.append(f"  {g}: resident {short}; the other {n_str} stream")
            else:
                lines.append(f"  {g}: {'all ' if len(names) > 1 else ''}{'resident' if res else 'streamed'}"
                             f"{f' ({len(names)})' if len(names) > 1 else ''}")
        for g, (n, b) in plan.slots.items():
            label = f"(one pool shared by {', '.join(g.split(POOL_SEP))})" if POOL_SEP in g else g
            lines.append(f"  buffers {label}: {n} x {b / GIB:.3f} GiB")
        lines.append(f"  prefetch: {plan.prefetch} copy/copies in flight ahead of use (host->device "
                     f"{planner_settings(settings)['bandwidth_bytes_s'] / 1e9:g} GB/s assumed); pinned host memory "
                     f"{size(sum(u.nbytes for u in units if u.name in _host_held_paths(plan)))}"
                     f"; activation reserve {size(plan.activation)}"
                     + "".join(f"; {ph} phase {size(b)}" for ph, b in phase_activations(units, 0).items() if b))
        for ph, names in plan.evict.items():
            lines.append(f"  phase residency: while {ph} runs, {len(names)} resident unit(s) leave the card "
                         f"({size(sum(u.nbytes for u in units if u.name in set(names)))}: "
                         f"{', '.join(n.rsplit('.', 2)[-2] + '.' + n.rsplit('.', 1)[-1] if '.' in n else n for n in names[:6])}"
                         f"{' ...' if len(names) > 6 else ''}); copied back before their phase runs again "
                         + ", ".join(f"({p} {s * 1e3:.0f} ms)" for p, s in plan.reload_s.items()))
    return "\n".join(lines)
