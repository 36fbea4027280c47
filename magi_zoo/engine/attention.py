"""The attention step: set the attention backend of every attention layer under a region.

Works on diffusers models, whose attention layers hold a processor that dispatches through
`diffusers.models.attention_dispatch` by the processor's `_attention_backend` (what
`ModelMixin.set_attention_backend` sets model-wide); here it is set per region. Also on
transformers' attention layers (Qwen3-Omni), which call the attention interface their config's
`_attn_implementation` names: each layer in the region gets its own copy of its config naming
the backend ('native' = transformers' SDPA, 'fa3' = the engine's FA3 function registered in that
interface), and on this project's own layers that declare ATTENTION_BACKENDS (BAGEL's). A region
whose subtree has no such layer is an error, never a silent no-op. Undo restores every
processor's previous backend.

Backend names are diffusers' (`AttentionBackendName` values) plus the engine's own kernels
(`ENGINE_BACKENDS`: ``fa3``), each a module under `engine/kernels/` that registers a
function in diffusers' dispatch registry and is imported only when a plan names it.
``auto`` takes the first of the GPU profile's `attention_backends` that can run here; a
choice skipped on the way is reported in one warning that says what to install.
"""

from __future__ import annotations

import copy
import difflib
import functools
import inspect
import importlib
import warnings

import torch.nn as nn

from .resolve import PlanError
from .steps import StepContext, StepRecord

# Engine backends: plan name -> the kernel module providing `missing_reason()`, `register()`
# (returns the diffusers member that now dispatches to it) and `describe()`; for transformers'
# attention layers `register_transformers()` and `transformers_missing_reason()`. They need CUDA.
ENGINE_BACKENDS = {"fa3": "magi_zoo.engine.kernels.fa3"}
# Every backend here trains: diffusers' have backwards, and fa3 (whose wheel is forward-only)
# pairs FA3's forward with cuDNN's attention backward (kernels/fa3.py, "Training").


def _processors(module: nn.Module) -> list:
    """The attention processors under `module` that carry a dispatch backend."""
    out = []
    for m in module.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_attention_backend") and all(p is not proc for p in out):
            out.append(proc)
    return out


def _engine_layers(module: nn.Module) -> list:
    """The attention layers under `module` that are not diffusers': model code written for
    this project (BAGEL's MoT attention) declares the backends it can dispatch in a class
    attribute ``ATTENTION_BACKENDS`` (engine names: "native", "fa3") and reads its instance
    attribute ``attention_backend`` at call time."""
    return [m for m in module.modules() if isinstance(getattr(type(m), "ATTENTION_BACKENDS", None), tuple)]


# transformers' attention layers (Qwen3-Omni's) take 'native' (transformers' SDPA) or an engine
# backend, whose kernel module registers a function in transformers' attention interface. The
# other diffusers names have no transformers counterpart.
TRANSFORMERS_NAMES = ("native", *ENGINE_BACKENDS)


@functools.cache
def _reads_interface(cls: type) -> bool:
    """Whether `cls.forward` looks its attention function up in transformers' interface (by the
    config's `_attn_implementation`); older model code computes attention inline and would ignore
    a backend set on it."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _transformers_layers(module: nn.Module) -> list:
    """transformers' attention layers under `module`: modules of a `transformers.` class that hold
    a config and call the attention interface its `_attn_implementation` names at call time."""
    return [m for m in module.modules()
            if type(m).__module__.startswith("transformers.")
            and hasattr(getattr(m, "config", None), "_attn_implementation") and _reads_interface(type(m))]


def _transformers_backend(name: str, profile, key: str, auto: bool, cls_name: str) -> tuple[str, str]:
    """(the attention implementation transformers layers get for backend `name`, the report
    label). Under `auto`, a choice transformers layers cannot take -- not one of their names, or
    an engine kernel whose transformers path cannot run here though diffusers' layers' can --
    becomes 'native', with one warning saying why."""
    if name not in TRANSFORMERS_NAMES:
        if not auto:
            raise PlanError(f"attention key {key!r}: {cls_name} is a transformers attention layer; it "
                            f"takes {', '.join(map(repr, TRANSFORMERS_NAMES))} or 'auto', not {name!r}")
        name = "native"
    if auto and name in ENGINE_BACKENDS:
        why = _kernel(name).transformers_missing_reason()
        if why is not None:
            warnings.warn(f"attention backend 'auto' on key {key!r} ({cls_name}, a transformers attention "
                          f"layer) uses 'native' instead of {name!r}: {why}", RuntimeWarning, stacklevel=3)
            return "sdpa", f"sdpa (transformers; auto: {name!r} skipped: {why})"
    if name == "native":
        return "sdpa", "sdpa (transformers)"
    _, label = _resolve(name, profile)  # the same checks as for diffusers' layers
    return _kernel(name).register_transformers(), label


def _set_transformers_layer(layer: nn.Module, impl: str, undo_list: list) -> None:
    """Point one transformers attention layer at attention implementation `impl` through its own
    copy of its config (the model's config, and the masks the model builds from it, stay as they
    are)."""
    config = copy.copy(layer.config)
    # the attribute itself: the property's setter would also set it on sub-configs, which the
    # copy shares with the original
    config.__dict__["_attn_implementation_internal"] = impl
    undo_list.append((layer, "config", layer.config))
    layer.config = config


def _kernel(name: str):
    return importlib.import_module(ENGINE_BACKENDS[name])


# Short names for torch SDPA's kernels (diffusers spells them with a leading underscore).
# ``flash`` is *not* one: in diffusers it is the flash-attn package; SDPA's flash kernel is
# ``_native_flash``.
ALIASES = {"sdpa": "native", "cudnn": "_native_cudnn", "efficient": "_native_efficient"}


def _check_name(name: str) -> str:
    """The lower-cased name (an alias resolved) if the engine or diffusers knows it
    (did-you-mean on a typo)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    name = ALIASES.get(name.lower(), name)
    valid = [*ENGINE_BACKENDS, *ALIASES, *(b.value for b in AttentionBackendName)]
    if name.lower() not in valid:
        close = difflib.get_close_matches(name.lower(), valid, n=1)
        hint = f" -- did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"attention backend {name!r} is not a diffusers backend{hint}; valid: 'auto', "
                         f"{', '.join(repr(v) for v in valid)}")
    return name.lower()


def _unavailable(name: str, profile) -> str | None:
    """Why backend `name` cannot run here (None = it can): what `auto` tests each choice by."""
    name = _check_name(name)
    if name in ENGINE_BACKENDS:
        if profile.device != "cuda":
            return f"it needs a CUDA GPU (profile {profile.name!r} is {profile.device})"
        return _kernel(name).missing_reason()
    try:
        _backend(name)
    except RuntimeError as e:  # diffusers: the backend's package is missing
        return str(e)
    return None


def _backend(name: str):
    """Validate a diffusers backend name and check its kernels are installed."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    backend = AttentionBackendName(_check_name(name))
    try:  # raises with the package to install when a backend's kernels are missing
        from diffusers.models.attention_dispatch import _check_attention_backend_requirements
    except ImportError:  # pragma: no cover - other diffusers versions
        return backend
    _check_attention_backend_requirements(backend)
    return backend


def _resolve(name: str, profile) -> tuple[object, str]:
    """(the diffusers member the processors get, the label the report shows)."""
    name = _check_name(name)
    if name not in ENGINE_BACKENDS:
        backend = _backend(name)
        return backend, backend.value
    if profile.device != "cuda":
        raise PlanError(f"attention backend {name!r} runs on CUDA GPUs; profile {profile.name!r} is "
                        f"{profile.device}: use backend='native' (or 'auto') there")
    kernel = _kernel(name)
    member = kernel.register()  # raises, naming the extra, when the kernel is missing
    return member, f"{name} ({kernel.describe()})"


def _auto(profile) -> tuple[str, list[str]]:
    """The first of the profile's `attention_backends` that can run here, and the skipped
    choices with why."""
    skipped = []
    for name in profile.attention_backends:
        why = _unavailable(name, profile)
        if why is None:
            return name, skipped
        skipped.append(f"{name!r} skipped: {why}")
    raise RuntimeError(f"attention backend 'auto' on profile {profile.name!r}: none of "
                       f"{list(profile.attention_backends)} can run here ({'; '.join(skipped)}); "
                       "name a backend explicitly")


def _set_engine_layer(layer: nn.Module, name: str, profile, key: str, undo_list: list) -> str:
    """Set one engine attention layer's backend (one it declares); returns the report label."""
    supported = type(layer).ATTENTION_BACKENDS
    if name not in supported:
        raise PlanError(f"attention key {key!r}: {type(layer).__name__} dispatches {', '.join(map(repr, supported))} "
                        f"(its ATTENTION_BACKENDS), not {name!r}; choose one of those")
    # the same checks and registration as for diffusers' layers (an engine kernel must be
    # registered either way: the layer calls it directly)
    _, label = _resolve(name, profile)
    undo_list.append((layer, "attention_backend", layer.attention_backend))
    layer.attention_backend = name
    return label


def attention_step(ctx: StepContext) -> StepRecord:
    section = ctx.plan.section("attention")
    undo_list: list[tuple[object, str, object]] = []  # (object, attribute, prior value)
    done = []
    auto = None  # resolved once per apply: one warning however many regions say auto

    def undo() -> None:
        for obj, attr, prior in reversed(undo_list):
            setattr(obj, attr, prior)

    try:
        for (key, _), targets in section.regions().items():
            name = targets[0].spec.backend
            if name is None:
                continue
            note, is_auto = "", name == "auto"
            if is_auto:
                if auto is None:
                    auto = _auto(ctx.profile)
                    if auto[1]:
                        warnings.warn(f"attention backend 'auto' on profile {ctx.profile.name!r} uses "
                                      f"{auto[0]!r}: {'; '.join(auto[1])}", RuntimeWarning, stacklevel=2)
                name = auto[0]
                note = f"; auto: {'; '.join(auto[1])}" if auto[1] else ""
            name = _check_name(name)
            n, label = 0, None
            for t in targets:
                procs, layers = _processors(t.module), _engine_layers(t.module)
                hf_layers = _transformers_layers(t.module)
                if not procs and not layers and not hf_layers:
                    raise PlanError(f"attention key {key!r}: {t.cls_name} at {t.path or '<root>'!r} has no "
                                    "attention layer under it that takes a backend (a diffusers attention layer, "
                                    "a transformers one, or a module declaring ATTENTION_BACKENDS); key a "
                                    "transformer or its blocks")
                if procs:
                    backend, label = _resolve(name, ctx.profile)
                    for p in procs:
                        undo_list.append((p, "_attention_backend", p._attention_backend))
                        p._attention_backend = backend
                for layer in layers:
                    label = _set_engine_layer(layer, name, ctx.profile, key, undo_list) or label
                if hf_layers:  # resolved once for the region's layers
                    impl, label = _transformers_backend(name, ctx.profile, key, is_auto, type(hf_layers[0]).__name__)
                    for layer in hf_layers:
                        _set_transformers_layer(layer, impl, undo_list)
                n += len(procs) + len(layers) + len(hf_layers)
            done.append(f"{label} on {key or '<root>'} ({n} attention layers{note})")
    except BaseException:  # a refusal part-way leaves nothing set
        undo()
        raise
    did = "; ".join(done) if done else "library default (no attention section)"
    return StepRecord("attention", did, undo, {"backends": done})
