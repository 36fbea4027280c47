"""`apply`: the one function that applies a plan to a module tree, in a fixed order."""

from __future__ import annotations

from typing import Any, Sequence

import torch.nn as nn

from ..specs.gpu_profiles import GpuProfile, get_profile
from ..specs.plan import PlanLayer, as_layers
from . import compile as compile_mod
from .attention import attention_step
from .compile import compile_step
from .cuda_graphs import cuda_graphs_step
from .memory_format import memory_format_step
from .offload import OffloadPlan, offload_step, streaming_plan
from .parallel import parallel_step
from .precision import precision_step
from .recompute import recompute_step
from .step_cache import step_cache_step
from .custom_ops import list_custom_ops
from .prepare import Preparation, prepare
from .observe.report import Report
from .resolve import ResolvedPlan, resolve
from .steps import StepContext, StepFn, StepRecord

# The fixed order. Why: preparation may add the methods a plan names, so it runs before
# the plan is resolved; attention (and precision) change which ops the graphs contain, so
# they precede tracing; recompute must sit *inside* compiled regions so the compiler sees
# it; offload hooks and collectives wrap compiled regions and are never traced into them
# (torchtitan's order: activation checkpointing -> compile -> FSDP). memory_format re-lays
# out convolution weights before anything traces or copies them: inductor specialises on
# weight strides, and offload's resident copies keep the layout they find. Adding a step is a
# package under engine/ with one `<name>_step` function and one row in STEPS below.
# step_cache comes right after compile: diffusers' caching hooks wrap whatever `forward` an
# instance has when they are registered, so after compile they wrap the compiled blocks and
# decide in eager Python whether to call them; registered before, dynamo would trace the
# hooks' `.item()` tests and per-step state into the blocks (engine/step_cache/).
# cuda_graphs comes last: a graph records everything one call launches, so it wraps the
# finished module (compiled blocks, attention ops, the eager code between them).
STEP_ORDER = ("prepare", "attention", "precision", "memory_format", "recompute", "compile", "step_cache",
              "offload", "parallel", "cuda_graphs")
# Every step after `prepare` (which runs before resolution, below), in STEP_ORDER: an
# explicit table, so the order never depends on which modules happen to be imported.
STEPS: tuple[tuple[str, StepFn], ...] = (
    ("attention", attention_step), ("precision", precision_step), ("memory_format", memory_format_step),
    ("recompute", recompute_step),
    ("compile", compile_step), ("step_cache", step_cache_step), ("offload", offload_step),
    ("parallel", parallel_step), ("cuda_graphs", cuda_graphs_step),
)
assert tuple(name for name, _ in STEPS) == STEP_ORDER[1:], "STEPS must list STEP_ORDER's steps in order"

_APPLIED = "_magi_zoo_applied"  # root instance attr: the StepRecords of the plan applied there


def apply(module: nn.Module, plan: Any = None, *, gpu: str | GpuProfile | None = None,
          layers: Sequence[tuple[str, PlanLayer]] | None = None,
          preparations: Sequence[Preparation] = (), train: bool = False, keep_originals: bool = True) -> Report:
    """Apply a plan in place to any `nn.Module` tree and return a live `Report`.

    `plan` is a dict ({section: {key: spec}}, or {key: spec} for compile alone), a
    `PlanLayer`, a `SpecFile`, or a path to a TOML spec file (its `[default]` plus
    `[gpu.<gpu>]` tables). `layers` instead takes pre-stacked ``[(layer name, PlanLayer),
    ...]`` (what `magi_zoo.load` passes). `gpu` is a profile name or `GpuProfile` every step
    is told (default: the card the module's weights are on, or "cpu" -- the engine never
    initialises CUDA by itself). `preparations` are
    an adapter's declared graph preparations. `train=True` tells every step the module
    will be trained (attention then keeps a backend with a backward). With no compile entry in any layer, the
    engine default compiles the root: exactly `torch.compile(module)`. `keep_originals=False` drops
    each bf16 linear the precision step turns into fp8 instead of keeping a host copy for the undo
    (2 bytes per parameter: 64 GB for FLUX.2-dev's transformer); `remove` then leaves those fp8
    linears in place, as an fp8 checkpoint loads them, and the report says so. `load` passes it for
    a model built in host memory to stream, where host memory is what runs out.

    The steps run in `STEP_ORDER`, one engine module each, and this is the only place that
    encodes it:

    1. prepare -- the adapter's graph preparations (before resolution: they may add the
       methods a plan key names);
    2. attention / custom ops -- they change which ops the graphs contain, so they must be
       in place before anything is traced;
    3. precision -- fp8 linears where the plan says matmul='fp8' (before tracing: the
       graphs must contain the fp8 ops);
    4. memory_format -- convolution weights channels-last where the plan says (before
       tracing and offload: both see the weights' strides);
    5. recompute -- activation checkpointing per region (none / full / selective / auto);
       it must sit *inside* compiled regions, so it wraps each block before compile does;
    6. compile -- installs the compiled methods (compilation itself happens lazily on the
       first call and is booked to each region's counters);
    7. step_cache -- diffusers' step-caching hooks (first block cache, MagCache, ...) wrap
       the compiled blocks from outside, so they run after compile; hooks that would land
       inside a compiled region are refused;
    8. offload -- hooks that move weights wrap compiled regions, never traced into them
       (today: reads the profile's memory and says whether the weights fit);
    9. parallel -- multi-process splits (Ulysses / ring / CFG), hooks that wrap compiled
       regions from outside; collectives inside them only as functional collectives;
    10. cuda_graphs -- whole calls of a method captured in CUDA graphs and replayed; last,
       because the graph records everything the finished call launches (what it cannot
       record -- step caching, streamed offload, parallel splits -- is refused).

    Every step returns a record and an undo; `remove(module)` undoes them all, last first.
    Applying twice first removes the earlier plan, so wrappers never stack. A bad plan key
    raises before the tree is changed.
    """
    profile = _profile(gpu, module)
    if layers is None:
        layers = as_layers(plan if plan is not None else {}, gpu=profile.name)
    elif plan is not None:
        raise TypeError("pass either plan= or layers=, not both")
    replaced = remove(module)
    records: list[StepRecord] = []
    ctx = None
    try:
        records.append(prepare(module, list(preparations)))
        resolved: ResolvedPlan = resolve(module, list(layers))
        ctx = StepContext(root=module, plan=resolved, profile=profile, train=train, keep_originals=keep_originals)
        for _name, step in STEPS:
            records.append(step(ctx))
    except BaseException:
        _undo(records)
        raise
    # The registry is process-wide (every imported family's ops), and which of them this
    # tree calls is not knowable before tracing: give the count, not other models' names.
    n_ops = len(list_custom_ops())
    ops = (f"{n_ops}, by any model imported (`magi-zoo spec MODEL` lists a model's own)" if n_ops else "none")
    for r in records:
        if r.step == "attention":
            r.did += f"; custom ops registered in this process: {ops}"
        if r.step == "compile" and replaced:
            r.did += f"; replaced an earlier plan ({replaced} step(s) undone)"
    module.__dict__[_APPLIED] = records
    return Report(steps=records, regions=ctx.regions, plan=resolved, profile=profile.name)


def _profile(gpu: str | GpuProfile | None, module: nn.Module) -> GpuProfile:
    """The profile named, else the card the module's weights are on (CUDA is then already
    initialised, by whoever put them there), else "cpu"."""
    if isinstance(gpu, GpuProfile):
        return gpu
    if gpu is None:
        first = next(module.parameters(), None)
        gpu = "auto" if first is not None and first.device.type == "cuda" else "cpu"
    return get_profile(gpu)


def _undo(records: list[StepRecord]) -> None:
    for r in reversed(records):
        if r.undo is not None:
            r.undo()


def remove(module: nn.Module) -> int:
    """Undo every step of the plan applied to `module` (last step first), restoring it
    exactly; also removes compiled methods installed on submodules by other applies.
    Returns how many steps and methods were undone (0: nothing was applied)."""
    records = module.__dict__.pop(_APPLIED, None) or []
    _undo(records)
    return len(records) + compile_mod.uninstall_all(module)


def preview(module: nn.Module, layers: Sequence[tuple[str, PlanLayer]],
            preparations: Sequence[Preparation] = ()) -> ResolvedPlan:
    """Resolve a plan without applying it (what `magi-zoo spec` shows): the preparations are
    installed for the resolution (they may add methods a key names) and undone after."""
    rec = prepare(module, list(preparations))
    try:
        return resolve(module, list(layers))
    finally:
        rec.undo()


def needs_streaming(module: nn.Module, layers: Sequence[tuple[str, PlanLayer]], profile: GpuProfile,
                    preparations: Sequence[Preparation] = ()) -> OffloadPlan | None:
    """The offload plan for a tree (typically built on the meta device: sizes only) when it
    streams anything, else None. `load` asks this before building on the card, so a model
    that does not fit is built in host memory and the offload step places it. Here, beside
    `preview`, because it resolves the plan first (the offload step never imports apply)."""
    return streaming_plan(module, preview(module, layers, preparations), profile)
