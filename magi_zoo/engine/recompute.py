"""The recompute step: activation checkpointing per region, with the policy as data.

The step replaces each target block's ``forward`` (an instance attribute, as the compile
step does) with a wrapper that calls the original through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. It runs *before* the
compile step, so the compiled region is the wrapper: dynamo traces the checkpoint as one
higher-order op and the partitioner sees what to save and what to recompute (the order
torchtitan uses: activation checkpointing -> compile -> FSDP).

Policies (`RecomputeSpec.policy`):

- ``full``: plain checkpoint, everything recomputed;
- ``selective``: `create_selective_checkpoint_contexts` with a policy that keeps the
  outputs of the `save` ops (op groups or names) and of every custom op registered with
  ``is_compute_sensitive=True`` (the reader of that flag), recomputing the rest;
- ``auto``: per block one of {full, keep attention, keep matmuls, keep both, no
  checkpoint}, chosen by `choose` (a pure function) from a measured `BlockProfile` so that
  the step's estimated peak fits the budget at the least recompute time. The profile is
  measured by `calibrate(root, run)` -- one forward of `run` with the first block of every
  auto region run eagerly under an op-recording dispatch mode; `load(train=True)` does it
  on the model's example inputs. Until then an auto block refuses a grad-mode call.

With grad disabled (inference) every wrapper calls the original forward directly, so an
inference call traces exactly the graph it traced before. Undo puts the original
``forward`` back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import functools
import heapq
import re
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..specs.recompute_spec import OP_GROUPS, SHAPE_GROUPS, RecomputeSpec, resolve_op_name
from .custom_ops import NAMESPACE, list_custom_ops
from .kernels import fa3 as _fa3  # noqa: F401 -- registers magi_zoo::fa3_attention, an OP_GROUPS entry
from .steps import StepContext, StepRecord

GIB = 1024 ** 3
_STATE = "_magi_zoo_recompute"  # block instance attr: its _BlockState
_PRIOR = "_magi_zoo_recompute_prior"  # block instance attr: the `forward` instance attr before us (or None)


# -- op groups and the selective policy ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def group_ops(group: str) -> frozenset:
    """The op packets of one group (`OP_GROUPS`) that exist in this torch build."""
    out = set()
    for name in OP_GROUPS[group]:
        ns, op = name.split(".")
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None:
            out.add(packet)
    return frozenset(out)


def op_group(func: Any) -> str:
    """Which group an op belongs to: 'sensitive' (a compute-sensitive custom op), 'matmuls',
    'attention', or 'other'."""
    if is_compute_sensitive(func):
        return "sensitive"
    packet = getattr(func, "overloadpacket", func)
    for group in OP_GROUPS:
        if packet in group_ops(group):
            return group
    return "other"


def is_compute_sensitive(func: Any) -> bool:
    """Is `func` a custom op registered with ``is_compute_sensitive=True``? Read at trace
    time, so an op registered after `apply` still counts."""
    if getattr(func, "namespace", None) != NAMESPACE:
        return False
    return any(info.overload is func for info in list_custom_ops(is_compute_sensitive=True))


DOWN = "down-projections"  # the shape-defined group (SHAPE_GROUPS)


def _operand_dims(func: Any, args: tuple) -> tuple[int, int] | None:
    """(K, N) of a matmul call -- reduction dim, output dim -- or None for other ops."""
    packet = getattr(func, "overloadpacket", func)
    if packet not in group_ops("matmuls") or len(args) < 2:
        return None
    name = getattr(packet, "__name__", "")
    if name == "linear":  # linear(input, weight[N, K], bias)
        a, w = args[0], args[1]
        return (a.shape[-1], w.shape[0]) if hasattr(a, "shape") and hasattr(w, "shape") else None
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") and len(args) >= 3 else (args[0], args[1])
    if not (hasattr(a, "shape") and hasattr(b, "shape")) or a.dim() < 1 or b.dim() < 1:
        return None
    return a.shape[-1], b.shape[-1]


def is_down_projection(func: Any, args: tuple) -> bool:
    """A matmul whose reduction dim exceeds its output dim (K > N)."""
    dims = _operand_dims(func, args)
    return dims is not None and dims[0] > dims[1]


def save_set(names: Sequence[str]) -> frozenset:
    """Op packets / overloads that `save` names (groups expanded; a shape-defined group stays
    its name, the policy tests the call's shapes)."""
    out: set = set()
    for name in names:
        if name in SHAPE_GROUPS:
            out.add(name)
        else:
            out |= group_ops(name) if name in OP_GROUPS else {resolve_op_name(name)}
    return frozenset(out)


def _policy(saved: frozenset) -> Callable:
    # A closure per save set (what dynamo's checkpoint support accepts as a policy): keep
    # the named ops' outputs and the compute-sensitive custom ops', recompute the rest.
    down = DOWN in saved

    def policy(ctx, func, *args, **kwargs):
        if func in saved or getattr(func, "overloadpacket", None) in saved or is_compute_sensitive(func):
            return CheckpointPolicy.MUST_SAVE
        if down and is_down_projection(func, args):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@functools.lru_cache(maxsize=None)
def context_fn(saved: frozenset) -> Callable:
    """The `context_fn` of a selective checkpoint keeping `saved`: one object per save set,
    so blocks with the same choice share one compiled graph (dynamo guards on its identity)."""
    return functools.partial(create_selective_checkpoint_contexts, _policy(saved))


# -- the per-block wrapper ------------------------------------------------------------------------

class _BlockState:
    """What one block's wrapper reads: whether to checkpoint and with which context."""

    def __init__(self, region: "_Region", checkpointed: bool, ctx_fn: Callable | None, label: str):
        self.region = region
        self.checkpointed = checkpointed  # False: plain forward (policy none, or auto chose none)
        self.context_fn = ctx_fn  # None: full recompute (no selective context)
        self.decided = region.spec.policy != "auto"
        self.profiling = False  # True only inside `calibrate`
        self.label = label  # what this block keeps, for the report
        self.guard = None  # auto, until decided: the pre-hook refusing grad-mode calls
        self.module: nn.Module | None = None  # the block (its parameters: not activations; their device)
        self.fn: Callable | None = None  # the installed wrapper (its code object names the choice)
        self.cls: type | None = None  # the block's class when installed (FSDP2 renames it later)

    def choose(self, save: tuple[str, ...] | None, label: str | None = None) -> None:
        """Make this block keep `save` (None: no checkpoint; (): full recompute) and point
        its wrapper at the code object of that choice (see `_wrap_for`)."""
        self.checkpointed = save is not None
        self.context_fn = context_fn(save_set(save)) if save else None
        self.label = label or option_name(save)
        self.retarget()

    def retarget(self) -> None:
        """Point the wrapper at the code object of the current choice (`label`)."""
        if self.fn is not None:
            self.fn.__code__ = _code_for(self.cls, self.label, self.fn.__code__)


def _wrap(orig: Callable, state: _BlockState) -> Callable:
    def forward(*args, **kwargs):
        if state.profiling:
            return _profile_call(state, orig, args, kwargs)
        if not torch.is_grad_enabled() or not state.checkpointed:
            return orig(*args, **kwargs)
        if state.context_fn is None:
            return checkpoint(orig, *args, use_reentrant=False, **kwargs)
        return checkpoint(orig, *args, use_reentrant=False, context_fn=state.context_fn, **kwargs)

    forward.__wrapped__ = orig  # type: ignore[attr-defined]
    return forward


def _wrap_for(cls: type, orig: Callable, state: _BlockState) -> Callable:
    """`_wrap`, with a code object of its own per block class and choice. Why: dynamo keeps
    compiled code per code object (and at most `recompile_limit` entries on one), and it
    does not guard on which selective policy a checkpoint uses -- blocks of one class with
    different save sets sharing one code object would all run the first one compiled. One
    code object per (class, choice): each choice is its own compiled frame; a second class
    (Flux's single-stream blocks) is not a recompile of the first either."""
    fn = _wrap(orig, state)
    fn.__code__ = _code_for(cls, state.label, fn.__code__)
    fn.__name__ = fn.__code__.co_name
    state.fn, state.cls = fn, cls
    return fn


def _code_for(cls: type, label: str, code: Any) -> Any:
    key = (cls, label)
    if key not in _CODES:
        tag = re.sub(r"\W+", "_", label).strip("_")
        _CODES[key] = code.replace(co_name=f"{cls.__name__}_checkpointed_forward__{tag}")
    return _CODES[key]


_CODES: dict[tuple[type, str], Any] = {}  # (block class, choice) -> the wrapper code its blocks share


def _refuse_undecided(module: nn.Module, args: tuple) -> None:
    # A forward pre-hook on auto blocks until `calibrate` decides (hooks run outside the
    # compiled forward, so this error reaches the caller as written).
    state = module.__dict__[_STATE]
    if torch.is_grad_enabled() and not state.decided and not state.profiling:
        raise RuntimeError(
            f"recompute='auto' on {state.region.key!r}: the per-block choice is not made yet. Measure it "
            "once: magi_zoo.engine.recompute.calibrate(module, lambda: module(**inputs)) "
            "(magi_zoo.load(..., train=True) does this on the example inputs; after load(..., calibrate=False) "
            "call magi_zoo.train.calibrate(handle))")


def _install(module: nn.Module, state: _BlockState) -> None:
    if _STATE in module.__dict__:
        raise RuntimeError(f"{type(module).__name__} already has a recompute wrapper; call "
                           "magi_zoo.remove(module) before applying another plan")
    module.__dict__[_PRIOR] = module.__dict__.get("forward")
    module.__dict__[_STATE] = state
    object.__setattr__(module, "forward", _wrap_for(type(module), module.forward, state))
    if not state.decided:
        state.guard = module.register_forward_pre_hook(_refuse_undecided)


def _uninstall(module: nn.Module) -> None:
    if _STATE not in module.__dict__:
        return
    prior = module.__dict__.pop(_PRIOR)
    state = module.__dict__.pop(_STATE)
    if state.guard is not None:
        state.guard.remove()
    if prior is None:
        module.__dict__.pop("forward", None)
    else:
        object.__setattr__(module, "forward", prior)


# -- profiles (measured) and the choice (pure) ----------------------------------------------------

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
    left. `save` None = no checkpoint; () = full recompute (compute-sensitive ops kept)."""

    name: str
    save: tuple[str, ...] | None
    bytes: int
    recompute_s: float


AUTO_SAVES: tuple[tuple[str, ...], ...] = ((), ("attention",), ("attention", DOWN), ("matmuls",),
                                          ("matmuls", "attention"))


def option_name(save: tuple[str, ...] | None) -> str:
    return "no checkpoint" if save is None else "full" if not save else "keep " + "+".join(save)


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

    A checkpointed block keeps its boundary inputs, the compute-sensitive custom ops'
    outputs and the outputs of the kept groups; it recomputes every other op (their
    forward seconds). No checkpoint keeps what autograd saves and recomputes nothing.
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


# -- measuring a block ------------------------------------------------------------------------------

def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class _OpRecorder(TorchDispatchMode):
    """Records, per op group, the bytes of each op's outputs (new storages only) and its
    time (synchronised around every op on CUDA: a profiling pass, not a fast one)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.groups: dict[str, list] = {}
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        dt = time.perf_counter() - t0
        nbytes = 0
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = _storage_key(t)
                if key not in self.seen:
                    self.seen.add(key)
                    nbytes += key[1]
        names = [op_group(func)]
        if names[0] == "matmuls" and is_down_projection(func, args):
            names.append(DOWN)  # also counted apart: a subset of the matmuls
        for name in names:
            g = self.groups.setdefault(name, [0, 0.0, 0])
            g[0] += nbytes
            g[1] += dt
            g[2] += 1
        return out


def _as_grad_input(x: Any) -> Any:
    # Inputs seen without grad: give floating ones requires_grad, as the residual stream has
    # in a training step, so autograd saves what it would save then.
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


def _training_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Fresh leaves for a profiled block call. Where the call came from a grad-mode forward
    (calibrate's), each input keeps its own requires_grad -- what a training step passes, so
    a compiled block is measured in the variant training runs (dynamo guards on the flag);
    where nothing requires grad (a forward without grad), every floating input gets it."""
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not any(t.requires_grad for t in leaves):
        return torch.utils._pytree.tree_map(_as_grad_input, (args, kwargs))

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().requires_grad_(x.requires_grad)
        return x

    return torch.utils._pytree.tree_map(leaf, (args, kwargs))


class _SavedStorages:
    """A saved-tensors pack hook that records the storages autograd saves for backward
    (`keys`), parameters excluded; `with recorder.hooks():` around a forward."""

    def __init__(self, params: set):
        self.params = params
        self.keys: set = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = _storage_key(t)
            if key not in self.params:
                self.keys.add(key)
        # Not `t` itself: a saved output packed with its grad_fn is a node -> tensor -> node
        # cycle in C++ that no gc sees, and the whole profiled graph (GiBs at the Wan shape)
        # would stay on the card for good. Nothing backwards through what this packs.
        return t.detach()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _call_device(args: tuple, kwargs: dict) -> tuple[torch.device, list[int]]:
    """The device of a block call's first tensor, and the CUDA devices whose RNG a profiled
    call forks (a profiled forward must not move the RNG a training step will use)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    cuda_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    return device, cuda_ids


def _input_storages(args: tuple, kwargs: dict, out: Any) -> tuple[set, set]:
    """(boundary, shared) storage keys of a block call's inputs: the boundary inputs are shaped
    like an output (the residual stream the block passes on, its own); the others -- text
    states, time embedding, RoPE tables -- are one storage for all blocks, live anyway."""
    shapes = {tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    boundary = {_storage_key(t) for t in inputs if tuple(t.shape) in shapes}
    return boundary, {_storage_key(t) for t in inputs} - boundary


def measure_block(fn: Callable, args: tuple, kwargs: dict, *, module: nn.Module | None = None,
                  repeats: int = 2) -> BlockProfile:
    """Run one block forward (`fn(*args, **kwargs)`, eager, no checkpoint) `repeats` times
    under the op recorder and saved-tensor hooks; the last run's timings count (the first
    warms kernels and allocators up). `module` (default: `fn`'s instance): its parameters
    are not activations, whatever autograd saves of them."""
    device, cuda_ids = _call_device(args, kwargs)
    module = module if module is not None else getattr(fn, "__self__", None)
    params = {_storage_key(p) for p in module.parameters()} if isinstance(module, nn.Module) else set()
    prof = None
    for _ in range(repeats):
        a, k = _training_inputs(args, kwargs)
        saved = _SavedStorages(params)
        rec = _OpRecorder(device)
        with torch.random.fork_rng(devices=cuda_ids), torch.enable_grad(), saved.hooks():
            t0 = time.perf_counter()
            with rec:
                out = fn(*a, **k)
            rec.sync()
            total = time.perf_counter() - t0
        boundary, _ = _input_storages(a, k, out)
        prof = BlockProfile(
            groups={g: GroupCost(int(v[0]), float(v[1]), int(v[2])) for g, v in rec.groups.items()},
            forward_s=total,
            boundary_bytes=sum(n for _, n in boundary),
            no_checkpoint_bytes=sum(n for _, n in saved.keys | boundary),
        )
        del out
    return prof


def _is_sharded(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


# FSDP2 under `magi_zoo.train.shard` on CUDA computes in bf16 and reduces gradients in fp32
# (its MixedPrecisionPolicy); elsewhere (CPU, no policy) in the parameters' own dtype.
_FSDP_COMPUTE_BYTES, _FSDP_REDUCE_BYTES = 2, 4


def fsdp_in_flight_bytes(blocks: Sequence[nn.Module], device: torch.device) -> int:
    """What FSDP2 holds beyond the shards while one block runs: the largest sharded block's
    all-gathered parameters twice (the block in flight and the one prefetched next, forward
    and backward) plus its unsharded gradient in the reduce dtype before the reduce-scatter.
    0 when no block is sharded. A DTensor's `numel()` is the whole (unsharded) tensor's."""
    sizes = [sum(p.numel() for p in m.parameters()) for m in blocks if _is_sharded(m)]
    if not sizes:
        return 0
    n = max(sizes)
    if device.type == "cuda":
        return n * (2 * _FSDP_COMPUTE_BYTES + _FSDP_REDUCE_BYTES)
    size = next(p.element_size() for m in blocks for p in m.parameters())
    return n * 3 * size


def measure_options(state: "_BlockState", args: tuple, kwargs: dict, *, repeats: int = 3) -> dict[str, OptionCost]:
    """What each `auto` option really costs one block: the block's own forward -- the
    installed wrapper, compiled where the plan compiles it -- run per option with grad on
    `args`/`kwargs`, then backward (a ones gradient), `repeats` times; the first run warms
    up (compiles), the fastest of the rest counts.

    bytes: the distinct storages autograd saves (parameters and inputs all blocks share
    excluded) plus the block's residual input. Saved-tensor hooks see what a compiled region
    saves for its backward, so this is what the partitioner decided, not what the eager ops
    produce (eager selective checkpoints keep their outputs out of the hooks' sight:
    `options` takes the larger of the two). Each option is one compiled variant of the block
    (guards on its state), the same variants training then reuses. The block's parameter
    gradients are left as they were. On CUDA the allocator's peak over the forward + backward
    gives each option's `transient` (this resets the device's peak-memory statistics)."""
    module = state.module
    params = {_storage_key(p) for p in module.parameters()}
    device, cuda_ids = _call_device(args, kwargs)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prior = (state.checkpointed, state.context_fn, state.decided, state.label)
    grads = {p: p.grad for p in module.parameters()}
    costs: dict[str, OptionCost] = {}
    try:
        for save in (*AUTO_SAVES, None):
            state.choose(save)
            state.decided = True
            nbytes, times = 0, []
            for _ in range(max(2, repeats)):
                a, k = _training_inputs(args, kwargs)
                saved = _SavedStorages(params)
                with torch.random.fork_rng(devices=cuda_ids), torch.enable_grad():
                    sync()
                    if cuda_ids:
                        torch.cuda.reset_peak_memory_stats(device)
                        base = torch.cuda.memory_allocated(device)
                    t0 = time.perf_counter()
                    with saved.hooks():
                        out = module(*a, **k)
                    outs = [t for t in torch.utils._pytree.tree_leaves(out)
                            if isinstance(t, torch.Tensor) and t.requires_grad]
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                    sync()
                    times.append(time.perf_counter() - t0)
                    peak = torch.cuda.max_memory_allocated(device) - base if cuda_ids else None
                boundary, shared = _input_storages(a, k, out)
                nbytes = sum(n for _, n in (saved.keys - shared) | boundary)  # shared inputs: not this block's
                # what the backward needs above the kept activations (the boundary input
                # existed before the call, so it is not in the allocator's delta)
                transient = None if peak is None else max(0, peak - (nbytes - sum(n for _, n in boundary)))
                del out, outs, a, k
                for p in grads:
                    p.grad = None
            costs[option_name(save)] = OptionCost(nbytes, min(times[1:]), transient)
    finally:
        state.checkpointed, state.context_fn, state.decided, state.label = prior
        state.retarget()
        for p, g in grads.items():
            p.grad = g
    return costs


# -- regions, calibration, the step -----------------------------------------------------------------

@dataclasses.dataclass
class _Region:
    key: str
    spec: RecomputeSpec
    states: list[_BlockState]
    cls_name: str
    record: StepRecord | None = None
    profile: BlockProfile | None = None
    choice: str | None = None  # auto: the report's words for what was chosen
    sample: tuple | None = None  # calibrate: (state, args, kwargs) of the profiled block call
    measured: dict[str, OptionCost] | None = None  # calibrate: `measure_options` of that call
    measured_at: tuple | None = None  # the block-input shapes `measured` was taken at
    measured_before_sharding: bool = False  # `measured` reused from an unsharded calibration


def _shapes(args: tuple, kwargs: dict) -> tuple:
    """The shapes and dtypes of a block call's tensor inputs (what a measurement depends on)."""
    items = [*args, *(kwargs[k] for k in sorted(kwargs))]
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in items)


def _regions_under(root: nn.Module) -> list[_Region]:
    out: list[_Region] = []
    for m in root.modules():
        st = m.__dict__.get(_STATE)
        if st is not None and all(r is not st.region for r in out):
            out.append(st.region)
    return out


def _profile_call(state: _BlockState, orig: Callable, args: tuple, kwargs: dict):
    region = state.region
    if region.spec.policy == "auto" and region.profile is None:
        region.profile = measure_block(orig, args, kwargs, module=state.module)
        region.sample = (state, args, kwargs)
    # calibrate's forward may run with grad (so inputs carry training's requires_grad);
    # no block keeps activations there.
    with torch.no_grad():
        return orig(*args, **kwargs)


def _tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard: what this rank holds)."""
    seen, total = set(), 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        key = _storage_key(t)
        if key not in seen and t.device.type != "meta":
            seen.add(key)
            total += key[1]
    return total


def calibrate(root: nn.Module, run: Callable[[], Any], *, measure_compiled: bool = True) -> list[dict[str, Any]]:
    """Measure every `auto` region under `root` and make its per-block choice.

    `run()` should call the model once on inputs of the training shape (its output is
    dropped). It runs without grad and with compiled regions forced eager; the first block
    of each auto region is measured (`measure_block`: op groups' output bytes and times).
    Then (`measure_compiled`, default) that block's real forward -- compiled where the plan
    compiles it -- runs once per option with grad on the same inputs, and the bytes autograd
    saves there replace the estimate where larger (`measure_options`). An FSDP2-sharded block
    cannot be run alone, so there the costs measured by an earlier calibration of the same
    blocks before sharding, at the same input shapes, are reused (else the eager estimate
    stands): calibrate before `shard` and again after it. Then one choice is made over all auto blocks against the budget: the estimated
    peak is

        memory live now (CUDA: allocated -- weights, inputs, whatever else is held; CPU: the
        weights on the blocks' device) + trainable weights x `optimizer_states` (they do not
        exist yet at calibration) + the gradients of trainable weights outside the auto
        blocks + the largest backward working set among the chosen options (one block runs
        its backward at a time; measured per option on CUDA, else the block's no-checkpoint
        bytes) + per auto block max(what it keeps, its parameters' gradient).

    The last term is the backward's timeline: it walks the blocks last to first, freeing a
    block's kept activations as it makes that block's gradients, so at any moment a block
    holds one or the other (the peak over the walk is at most the sum of those maxima;
    counting both, as a plain sum does, charges Wan-1.3B's 30 blocks 2.5 GiB twice).

    Under FSDP2 (blocks sharded with `fully_shard`), plus `fsdp_in_flight_bytes`: the
    all-gathered parameters of the block in flight and of the one prefetched, and the
    block's unsharded gradient before its reduce-scatter.

    Not counted: activations outside the blocks (embeddings, head, loss) and the caching
    allocator's fragmentation (reserved but unallocated; PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True keeps it small); leave headroom for them.

    The choice is written to the recompute step's record (the report) and returned, one
    dict per auto region. Calling it again re-measures and re-chooses.
    """
    regions = [r for r in _regions_under(root) if r.spec.policy == "auto"]
    if not regions:
        raise ValueError("calibrate: no recompute='auto' region under this module; nothing to measure")
    budgets = {r.spec.memory_budget_gib for r in regions}
    if len(budgets) > 1 or len({r.spec.optimizer_states for r in regions}) > 1:
        raise ValueError("recompute='auto' regions of one model share one budget; give every auto region the "
                         f"same memory_budget_gib and optimizer_states (got {sorted(budgets)})")
    for r in regions:
        # an earlier (unsharded) compiled measurement is kept for reuse once the block is
        # sharded, where it cannot be re-taken (below)
        r.profile, r.measured_before_sharding = None, False
        for st in r.states:
            st.profiling = True
    # With grad where nothing is sharded: the blocks' inputs then carry the requires_grad a
    # training step gives them (the blocks themselves run without, `_profile_call`), and the
    # compiled variants measured are those training reuses. An FSDP2 root's forward hooks
    # expect a backward after a grad-mode forward: without grad there.
    sharded = any(_is_sharded(m) for m in root.modules())
    try:
        with _force_eager(), torch.set_grad_enabled(not sharded):
            run()
    finally:
        for r in regions:
            for st in r.states:
                st.profiling = False
    try:
        missing = [r.key for r in regions if r.profile is None]
        if missing:
            raise RuntimeError(f"calibrate: run() never called the auto region(s) {missing}; pass a run that calls "
                               "the model's forward")
        for r in regions:
            st, args, kwargs = r.sample
            # An FSDP2 block's forward outside the root's call would leave its all-gather /
            # backward hooks half run: the eager estimate stands there (shown in the report).
            at = _shapes(args, kwargs)
            if measure_compiled and not _is_sharded(st.module):
                r.measured, r.measured_at = measure_options(st, args, kwargs), at
            elif measure_compiled and r.measured is not None and r.measured_at == at:
                # Sharded now: the compiled costs measured before sharding stand (per-rank
                # activations and a block's backward do not change with sharding; what FSDP2
                # adds is `fsdp_in_flight_bytes`), so auto chooses from them, not the eager estimate.
                r.measured_before_sharding = True
            else:
                r.measured, r.measured_at = None, None
    finally:
        for r in regions:
            r.sample = None  # the block inputs: not kept past calibration
    spec = regions[0].spec
    params = list(root.parameters())
    first = next((p for r in regions for st in r.states[:1] for p in st.module.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    trainable = _tensor_bytes([p for p in params if p.requires_grad])
    on_dev = [t for t in [*params, *root.buffers()] if t.device == device]
    own = _tensor_bytes(on_dev)
    frozen = _tensor_bytes([t for t in on_dev if not t.requires_grad])
    if device.type == "cuda":
        gc.collect()  # what the profiling pass left in reference cycles is not live in training
        live = torch.cuda.memory_allocated(device)
    else:
        live = own
    other = max(0, live - own)  # on the card but no weight of these modules: inputs, leftovers
    for what, n in (("frozen weights (parameters without grad, e.g. a text encoder)", frozen),
                    ("tensors that are no weight of the model (inputs, leftovers)", other)):
        if n > GIB:
            warnings.warn(f"recompute='auto': {n / GIB:.1f} GiB of {what} on {device} count against the "
                          f"{spec.memory_budget_gib:g} GiB budget; if the training step does not need them there, "
                          "move or free them and calibrate again (magi_zoo.train.calibrate(handle))",
                          RuntimeWarning, stacklevel=2)
    region_opts = {id(r): options(r.profile, r.measured) for r in regions}
    # Each option's backward working set: measured (CUDA), else what the block saves without
    # checkpointing (a recomputed block rebuilds at most that).
    region_work = {id(r): [_working_set(r, o) for o in region_opts[id(r)]] for r in regions}
    states = int(trainable * spec.optimizer_states)
    block_grads = {id(r): _tensor_bytes([p for p in r.states[0].module.parameters() if p.requires_grad])
                   for r in regions}
    other_grads = max(0, trainable - sum(block_grads[id(r)] * len(r.states) for r in regions))
    in_flight = fsdp_in_flight_bytes([st.module for r in regions for st in r.states], device)
    fixed = live + states + other_grads + in_flight
    budget = spec.memory_budget_gib * GIB
    blocks, works, owners = [], [], []
    for r in regions:
        # what a block costs at its worst moment: its kept activations, or later its gradient
        footprint = [dataclasses.replace(o, bytes=max(o.bytes, block_grads[id(r)])) for o in region_opts[id(r)]]
        for st in r.states:
            blocks.append(footprint)
            works.append(region_work[id(r)])
            owners.append((r, st))
    pick, transient = choose_within(blocks, works, budget - fixed)
    kept = sum(region_opts[id(r)][i].bytes for (r, _), i in zip(owners, pick.picks))
    summary = []
    for r in regions:
        opts = region_opts[id(r)]
        counts: dict[str, int] = {}
        for (reg, st), i in zip(owners, pick.picks):
            if reg is not r:
                continue
            o = opts[i]
            st.choose(o.save, o.name)
            st.decided = True
            if st.guard is not None:
                st.guard.remove()
                st.guard = None
            counts[o.name] = counts.get(o.name, 0) + 1
        r.choice = ", ".join(f"{n} x {name}" for name, n in counts.items())
        est = {o.name: o for o in options(r.profile)}
        summary.append({
            "region": r.key, "blocks": len(r.states), "choice": counts,
            "bytes_from": ("compiled forward + backward per option"
                           + (", measured before sharding" if r.measured_before_sharding else ""))
                          if r.measured is not None else "eager op outputs and times (estimate)",
            "options": [{"name": o.name, "bytes_per_block": o.bytes, "gib_per_block": round(o.bytes / GIB, 4),
                         "recompute_ms_per_block": round(o.recompute_s * 1e3, 3),
                         "eager_estimate_gib": round(est[o.name].bytes / GIB, 4),
                         "eager_estimate_ms": round(est[o.name].recompute_s * 1e3, 3),
                         "backward_working_set_gib": round(w / GIB, 4)}
                        for o, w in zip(opts, region_work[id(r)])],
        })
    est_peak = (fixed + transient + pick.bytes) / GIB
    accounting = {"budget_gib": spec.memory_budget_gib, "live_gib": round(live / GIB, 3),
                  "frozen_weights_on_device_gib": round(frozen / GIB, 3), "other_live_gib": round(other / GIB, 3),
                  "optimizer_states_gib": round(states / GIB, 3), "gradients_gib": round(trainable / GIB, 3),
                  "gradients_outside_blocks_gib": round(other_grads / GIB, 3),
                  "fsdp_in_flight_gib": round(in_flight / GIB, 3),
                  "largest_block_backward_gib": round(transient / GIB, 3),
                  "kept_activations_gib": round(kept / GIB, 3),
                  "blocks_kept_or_gradient_gib": round(pick.bytes / GIB, 3), "estimated_peak_gib": round(est_peak, 3),
                  "estimated_recompute_ms": round(pick.recompute_s * 1e3, 2), "fits": pick.fits}
    if not pick.fits:
        warnings.warn(f"recompute='auto': even full recompute everywhere is estimated at {est_peak:.3g} GiB, over the "
                      f"{spec.memory_budget_gib:g} GiB budget (live now {live / GIB:.3g}, optimizer states "
                      f"{states / GIB:.3g}, gradients {trainable / GIB:.3g}); raise the budget, shard (FSDP) or "
                      "offload", RuntimeWarning, stacklevel=2)
    for r in regions:
        if r.record is not None:
            r.record.details.setdefault("auto", {})[r.key] = {**next(s for s in summary if s["region"] == r.key),
                                                                 **accounting}
    for record in {id(r.record): r.record for r in regions if r.record is not None}.values():
        record.did = _did([r for r in _regions_under(root) if r.record is record])
    return [{**s, **accounting} for s in summary]


def _working_set(r: _Region, o: Option) -> int:
    m = (r.measured or {}).get(o.name)
    if m is not None and m.transient is not None:
        return m.transient
    return r.profile.no_checkpoint_bytes if r.measured is None else max(
        r.profile.no_checkpoint_bytes, r.measured["no checkpoint"].bytes)


@contextlib.contextmanager
def _force_eager():
    # Calibration must not compile: compiled regions run their Python (our wrapper) eagerly.
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:  # pragma: no cover - torch < 2.6
        yield
        return
    with set_stance("force_eager"):
        yield


def _describe(r: _Region) -> str:
    spec, n = r.spec, len(r.states)
    where = f"{r.key or '<root>'} ({n} x {r.cls_name})"
    if spec.policy == "full":
        return f"full on {where}"
    if spec.policy == "selective":
        return f"selective on {where}, keeping {'+'.join(spec.saved)} and compute-sensitive custom ops"
    if r.choice is None:
        return (f"auto ({spec.memory_budget_gib:g} GiB budget) on {where}: not chosen yet (calibrate measures it; "
                "load(train=True) does on the example inputs)")
    est = r.record.details["auto"][r.key] if r.record is not None else {}
    return (f"auto ({spec.memory_budget_gib:g} GiB budget) on {where}: {r.choice}; estimated peak "
            f"{est.get('estimated_peak_gib', '?')} GiB, recompute {est.get('estimated_recompute_ms', '?')} ms/step")


def _did(regions: list[_Region]) -> str:
    return "; ".join(_describe(r) for r in regions) if regions else "none (no recompute section)"


def recompute_step(ctx: StepContext) -> StepRecord:
    """Install a checkpointing wrapper on every block of every recompute region whose policy
    is not 'none'; the record's undo removes them."""
    section = ctx.plan.section("recompute")
    installed: list[nn.Module] = []
    regions: list[_Region] = []

    def undo() -> None:
        for m in reversed(installed):
            _uninstall(m)

    try:
        for (key, _), targets in section.regions().items():
            spec: RecomputeSpec = targets[0].spec
            if spec.policy == "none":
                continue
            region = _Region(key=key, spec=spec, states=[], cls_name=targets[0].cls_name)
            if spec.policy == "selective":
                ctx_fn, label = context_fn(save_set(spec.saved)), "keep " + "+".join(spec.saved)
            else:
                ctx_fn, label = None, "full" if spec.policy == "full" else "auto (not chosen yet)"
            for t in targets:
                st = _BlockState(region, checkpointed=True, ctx_fn=ctx_fn, label=label)
                st.module = t.module
                _install(t.module, st)
                installed.append(t.module)
                region.states.append(st)
            regions.append(region)
    except BaseException:
        undo()
        raise
    record = StepRecord("recompute", _did(regions), undo,
                        {"regions": {r.key: {"policy": r.spec.policy, "blocks": len(r.states)} for r in regions}})
    for r in regions:
        r.record = record
    return record


def block_choices(root: nn.Module) -> list[tuple[str, str]]:
    """(module path, what it keeps) for every checkpoint-wrapped block under `root`."""
    return [(path, m.__dict__[_STATE].label) for path, m in root.named_modules() if _STATE in m.__dict__]
