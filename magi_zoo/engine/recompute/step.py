"""The recompute step: a checkpointing wrapper on every block of a recompute region.

The step replaces each target block's ``forward`` (an instance attribute, as the compile
step does) with a wrapper that calls the original through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. It runs *before* the
compile step, so the compiled region is the wrapper: dynamo traces the checkpoint as one
higher-order op and the partitioner sees what to save and what to recompute (the order
torchtitan uses: activation checkpointing -> compile -> FSDP).

Each block's `BlockState` says what its wrapper does: no checkpoint, full recompute, or a
selective checkpoint keeping a save set (`policy`). An ``auto`` block refuses a grad-mode
call until `calibration.calibrate` has chosen for it. With grad disabled (inference) every
wrapper calls the original forward directly, so an inference call traces exactly the graph
it traced before. Undo puts the original ``forward`` back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ...specs.recompute_spec import RecomputeSpec
from ..compat.torch import checkpoint_hooks_kwargs
from ..steps import StepContext, StepRecord
from .auto import BlockProfile, OptionCost
from .measure import measure_block
from .policy import context_fn, option_name, save_set

_STATE = "_magi_zoo_recompute"  # block instance attr: its BlockState
_PRIOR = "_magi_zoo_recompute_prior"  # block instance attr: the `forward` instance attr before us (or None)
# What every checkpoint call passes besides use_reentrant=False: on a torch that asks, keep
# the tensors a selective checkpoint saves out of surrounding saved-tensors hooks, as before.
_HOOKS_KWARGS = checkpoint_hooks_kwargs()


# -- the per-block wrapper ------------------------------------------------------------------------

class BlockState:
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


def _wrap(orig: Callable, state: BlockState) -> Callable:
    def forward(*args, **kwargs):
        if state.profiling:
            return _profile_call(state, orig, args, kwargs)
        if not torch.is_grad_enabled() or not state.checkpointed:
            return orig(*args, **kwargs)
        if state.context_fn is None:
            return checkpoint(orig, *args, use_reentrant=False, **_HOOKS_KWARGS, **kwargs)
        return checkpoint(orig, *args, use_reentrant=False, context_fn=state.context_fn, **_HOOKS_KWARGS,
                          **kwargs)

    forward.__wrapped__ = orig  # type: ignore[attr-defined]
    return forward


def _wrap_for(cls: type, orig: Callable, state: BlockState) -> Callable:
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


def _install(module: nn.Module, state: BlockState) -> None:
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


# -- regions: the blocks of one recompute key ---------------------------------------------------------

@dataclasses.dataclass
class _Region:
    """One recompute key's blocks (a region), their spec, and what calibration found."""

    key: str
    spec: RecomputeSpec
    states: list[BlockState]
    cls_name: str
    record: StepRecord | None = None
    profile: BlockProfile | None = None
    choice: str | None = None  # auto: the report's words for what was chosen
    sample: tuple | None = None  # calibrate: (state, args, kwargs) of the profiled block call
    measured: dict[str, OptionCost] | None = None  # calibrate: `measure_options` of that call
    measured_at: tuple | None = None  # the block-input shapes `measured` was taken at
    measured_before_sharding: bool = False  # `measured` reused from an unsharded calibration


def _regions_under(root: nn.Module) -> list[_Region]:
    out: list[_Region] = []
    for m in root.modules():
        st = m.__dict__.get(_STATE)
        if st is not None and all(r is not st.region for r in out):
            out.append(st.region)
    return out


def _profile_call(state: BlockState, orig: Callable, args: tuple, kwargs: dict):
    # The wrapper's path while `calibrate` runs the model: the first block of an auto
    # region is measured (`measure_block`) and its inputs kept for `measure_options`.
    region = state.region
    if region.spec.policy == "auto" and region.profile is None:
        region.profile = measure_block(orig, args, kwargs, module=state.module)
        region.sample = (state, args, kwargs)
    # calibrate's forward may run with grad (so inputs carry training's requires_grad);
    # no block keeps activations there.
    with torch.no_grad():
        return orig(*args, **kwargs)


# -- the step and what it reports ----------------------------------------------------------------------

def _describe(r: _Region) -> str:
    spec, n = r.spec, len(r.states)
    where = f"{r.key or '<root>'} ({n} x {r.cls_name})"
    if spec.policy == "full":
        return f"full on {where}"
    if spec.policy == "selective":
        return f"selective on {where}, keeping {'+'.join(spec.saved)} and compute-sensitive custom ops"
    if r.choice is None:
        return (f"auto ({spec.train_peak_gib:g} GiB budget) on {where}: not chosen yet (calibrate measures it; "
                "load(train=True) does on the example inputs)")
    est = r.record.details["auto"][r.key] if r.record is not None else {}
    return (f"auto ({spec.train_peak_gib:g} GiB budget) on {where}: {r.choice}; estimated peak "
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
                st = BlockState(region, checkpointed=True, ctx_fn=ctx_fn, label=label)
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


def recompute_state(module: nn.Module) -> BlockState | None:
    """The recompute state of one block (what its wrapper reads: `label`, `choose(save)`),
    or None when the module carries no recompute wrapper."""
    return module.__dict__.get(_STATE)
