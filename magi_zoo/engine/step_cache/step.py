"""The step_cache step: diffusers' caching hooks on a denoiser, with an exact undo.

For each region of the ``step_cache`` section whose method is not ``none``, the step
builds diffusers' config dataclass (`diffusers.hooks.<Method>Config`) from the spec and
calls the model's own `CacheMixin.enable_cache(config)`; undo calls `disable_cache()` and
then removes what diffusers leaves behind (a `forward` bound method stored on each hooked
instance, the hook registries, the instance's cache config: `compat.diffusers.hook_state`),
so `remove()` gives back the module exactly as it was. The step publishes the models it
cached on the step context (`StepContext.step_cached`) for the steps after it.

Why it runs after compile: diffusers' `HookRegistry.register_hook` wraps whatever
`forward` the instance has at that moment. After the compile step that is the compiled
method the engine installed on each block, so a block hook decides in plain Python whether
to call the compiled block at all, and the compiled code never sees the hooks. Before
compile, `torch.compile(block.forward)` would trace the hook itself: its `.item()`
threshold test, its `torch.compiler.disable` helpers and its per-step Python state
(graph breaks, or an error under fullgraph). Hooks that land *inside* a compiled region
(PyramidAttentionBroadcast hooks attention layers inside the blocks; TaylorSeer does too
unless `use_lite_mode`) would be traced the same way, so the step refuses them with what
to do instead.

PyramidAttentionBroadcast needs the current timestep; the step reads it from the
`timestep` argument of the hooked model's own call (a forward pre-hook, outside compiled
code), so no pipeline object is needed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ...specs.section import SECTIONS
from ...specs.step_cache_spec import METHODS, StepCacheSpec
from ..compat.diffusers import cache_config, hook_registry, hook_state, restore_hook_state
from ..resolve import PlanError, path_within, paths_related
from ..steps import StepContext, StepRecord


def config_for(spec: StepCacheSpec, timestep=None) -> Any:
    """diffusers' config dataclass for `spec` (None for method 'none'). `timestep` is the
    current-timestep callback PAB needs."""
    m = METHODS[spec.method]
    if m.config is None:
        return None
    import diffusers.hooks as hooks  # lazy: diffusers is heavy; only a plan that caches needs it

    cls = getattr(hooks, m.config)
    kw = spec.config_kwargs()
    if "taylor_factors_dtype" in kw and isinstance(kw["taylor_factors_dtype"], str):
        name = kw["taylor_factors_dtype"].replace("torch.", "")
        dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"step_cache option taylor_factors_dtype={kw['taylor_factors_dtype']!r}: "
                             "use 'bfloat16', 'float16' or 'float32'")
        kw["taylor_factors_dtype"] = dtype
    for name in ("mag_ratios", "skip_predict_identifiers", "cache_identifiers"):
        if isinstance(kw.get(name), tuple):  # the spec stores lists as tuples (hashable)
            kw[name] = list(kw[name])
    if spec.method == "pab":
        kw["current_timestep_callback"] = timestep
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:  # diffusers' own checks (e.g. MagCache without mag_ratios)
        raise ValueError(f"step_cache method {spec.method!r}: {e}".strip()) from None


class _TimestepProbe:
    """Remembers the `timestep` the model was last called with (a forward pre-hook) and
    gives it to PAB as a number. Wan passes 0-1000, Flux 0-1 (the pipeline divides by
    1000); the max covers Wan2.2 TI2V's per-token timesteps (conditioning tokens are 0)."""

    def __init__(self) -> None:
        self.value: Any = None

    def hook(self, module, args, kwargs) -> None:
        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        self.value = t

    def __call__(self) -> float:
        t = self.value
        if t is None:
            raise RuntimeError("step_cache 'pab': the model has not been called with a timestep yet")
        return float(t.max()) if isinstance(t, torch.Tensor) else float(t)


def _snapshot(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Per submodule: what enabling a cache may change on it (`compat.diffusers.hook_state`)."""
    return [(m, hook_state(m)) for m in module.modules()]


def _restore(snap: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    for m, state in snap:
        restore_hook_state(m, state)


def _hooked(module: nn.Module, path: str, before: dict[int, set[str]]) -> list[tuple[str, nn.Module]]:
    """(path, submodule) of every submodule that got a diffusers hook from this step."""
    out = []
    for sub, m in module.named_modules():
        reg = hook_registry(m)
        if reg is not None and set(reg.hooks) - before.get(id(m), set()):
            out.append((f"{path}.{sub}" if path and sub else path or sub, m))
    return out


def _inside_compiled(path: str, compiled: dict[str, str]) -> str | None:
    """The compiled region that strictly contains `path`, if any."""
    for cpath, region in compiled.items():
        if path != cpath and path_within(path, cpath):
            return region
    return None


def _sequence_parallel(ctx: StepContext, path: str) -> str:
    """The parallel section's sequence split on `path` or around/inside it ('' = none). The
    plan's section, not a fact of the parallel step: that step runs after this one."""
    if "parallel" not in SECTIONS:
        return ""
    for t in ctx.plan.section("parallel").targets:
        # either one holds the other (a cache keyed on the root covers a split on any submodule,
        # a split on the root covers a cache keyed anywhere)
        related = paths_related(path, t.path)
        degrees = {k: getattr(t.spec, k, 1) or 1 for k in ("ulysses_degree", "ring_degree")}
        if related and any(v > 1 for v in degrees.values()):
            return ", ".join(f"{k}={v}" for k, v in degrees.items() if v > 1)
    return ""


def step_cache_step(ctx: StepContext) -> StepRecord:
    """Enable the section's caching method on every keyed model; undo disables it exactly."""
    section = ctx.plan.section("step_cache")
    undos: list = []
    done: list[str] = []
    details: dict[str, Any] = {}

    def undo() -> None:
        for u in reversed(undos):
            u()

    # Compiled regions (enabled specs only; a fenced-off method runs eager): path -> region name.
    compiled = {p: r.name or "<root>" for r in ctx.regions if r.spec.enabled for p in r.modules}
    try:
        for (key, _), targets in section.regions().items():
            spec: StepCacheSpec = targets[0].spec
            if spec.method == "none":
                continue
            for t in targets:
                _enable(ctx, key, spec, t, compiled, undos, details)
            done.append(f"{spec.method} on {key or '<root>'} ({spec.short()}; "
                        f"{sum(details[t.path or '<root>']['hooked'] for t in targets)} modules hooked)")
    except BaseException:
        undo()
        raise
    did = "; ".join(done) if done else "none (every step runs every block)"
    return StepRecord("step_cache", did, undo, details)


def _enable(ctx: StepContext, key: str, spec: StepCacheSpec, t, compiled: dict[str, str],
            undos: list, details: dict[str, Any]) -> None:
    module = t.module
    where = f"step_cache key {key!r}: {t.cls_name} at {t.path or '<root>'!r}"
    if not callable(getattr(module, "enable_cache", None)):
        raise PlanError(f"{where} has no enable_cache (diffusers' CacheMixin): step caching applies to "
                        "diffusers denoisers; key the transformer")
    if cache_config(module) is not None:
        raise PlanError(f"{where} already has caching enabled outside the plan "
                        f"({type(cache_config(module)).__name__}); call its disable_cache() first")
    split = _sequence_parallel(ctx, t.path)
    if split:
        raise PlanError(f"{where}: step caching with sequence parallelism ({split}) is not supported: each "
                        "rank would decide to skip blocks from its own shard of the sequence, and ranks that "
                        "decide differently wait on each other's collectives forever. Use parallel cfg=true "
                        "(each rank runs whole sequences) or step_cache method 'none'")
    probe = _TimestepProbe() if spec.method == "pab" else None
    config = config_for(spec, probe)
    snap = _snapshot(module)
    before = {id(m): set(reg.hooks) for m in module.modules() if (reg := hook_registry(m)) is not None}
    handle = None

    def undo_one() -> None:
        if handle is not None:
            handle.remove()
        if cache_config(module) is not None:
            module.disable_cache()
        _restore(snap)

    try:
        module.enable_cache(config)
    except BaseException:
        _restore(snap)
        raise
    undos.append(undo_one)
    hooked = _hooked(module, t.path, before)
    if not hooked:
        raise PlanError(f"{where}: method {spec.method!r} hooked no module ({config!r} matched nothing in "
                        f"this model); nothing would be cached. "
                        + ("TaylorSeer's default patterns name attention layers 'attn' (Wan's are "
                           "attn1/attn2): set use_lite_mode=true or cache_identifiers"
                           if spec.method == "taylorseer" else "pick another method"))
    inside = [(p, _inside_compiled(p, compiled)) for p, _ in hooked]
    inside = [(p, r) for p, r in inside if r is not None]
    if inside:
        whole = [n for n in METHODS if n not in ("none", "pab", "taylorseer")] + ["taylorseer with use_lite_mode=true"]
        raise PlanError(
            f"{where}: method {spec.method!r} hooks {len(inside)} module(s) inside the compiled region "
            f"{inside[0][1]!r} (e.g. {inside[0][0]!r}); dynamo would trace the hook's Python state into the "
            f"compiled graph (graph breaks; an error under fullgraph). Use a method that hooks whole blocks "
            f"({', '.join(whole)}), or fence the region off: "
            f"compile {{{inside[0][1]!r}: {{'enabled': false}}}}")
    if probe is not None:
        handle = module.register_forward_pre_hook(probe.hook, with_kwargs=True)
    ctx.step_cached[t.path] = spec.method
    details[t.path or "<root>"] = {"method": spec.method, "config": type(config).__name__,
                                   "hooked": len(hooked), **{k: v for k, v in spec.config_kwargs().items()
                                                             if not isinstance(v, tuple)}}


def full_passes(report) -> dict[str, int]:
    """Calls per compiled region (the engine's own accounting): with block caching on, the
    blocks a cache skipped are not called, so this counts the block work really done."""
    return {r.name: r.calls for r in report.regions}
