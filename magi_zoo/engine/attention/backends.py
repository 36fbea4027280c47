"""Attention backend names: which names exist, which can run here, what `auto` picks, and the
diffusers member (or engine kernel) a name resolves to.

Backend names are diffusers' (`AttentionBackendName` values) plus the engine's own kernels
(`ENGINE_BACKENDS`: ``fa3``, ``fa3_varlen``), each a module under `engine/kernels/` that registers a function in
diffusers' dispatch registry; its kernel loads only when a plan names it. ``auto`` takes the first
of the GPU profile's `attention_backends` that can run here.
"""

from __future__ import annotations

import difflib
import importlib

from ..compat import diffusers as diffusers_compat
from ..resolve import PlanError

# Engine backends: plan name -> the kernel module providing `missing_reason()`, `register()`
# (returns the diffusers member that now dispatches to it) and `describe()`; for transformers'
# attention layers `register_transformers()` and `transformers_missing_reason()`. They need CUDA.
# Every backend here trains: diffusers' have backwards, and fa3 (whose wheel is forward-only)
# pairs FA3's forward with cuDNN's attention backward (kernels/fa3.py, "Training"; fa3_varlen's
# masked calls that need gradients run on SDPA). ``fa3_varlen`` reads a boolean mask as key
# padding (diffusers' varlen contract), so only a spec whose model masks padding names it; `auto`
# never picks it (no GPU profile lists it).
ENGINE_BACKENDS = {"fa3": "magi_zoo.engine.kernels.fa3", "fa3_varlen": "magi_zoo.engine.kernels.fa3_varlen"}

# transformers' attention layers (Qwen3-Omni's) take 'native' (transformers' SDPA) or an engine
# backend, whose kernel module registers a function in transformers' attention interface. The
# other diffusers names have no transformers counterpart, nor has fa3_varlen (transformers' layers
# build their own masks; the engine's transformers function already takes padding-free calls to FA3).
TRANSFORMERS_NAMES = ("native", "fa3")

# Short names for torch SDPA's kernels (diffusers spells them with a leading underscore).
# ``flash`` is *not* one: in diffusers it is the flash-attn package; SDPA's flash kernel is
# ``_native_flash``.
ALIASES = {"sdpa": "native", "cudnn": "_native_cudnn", "efficient": "_native_efficient"}


def kernel(name: str):
    """The kernel module of engine backend `name` (imported by name: the table above is the
    only place that lists them)."""
    return importlib.import_module(ENGINE_BACKENDS[name])


def _backend_names():
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName


def check_name(name: str) -> str:
    """The lower-cased name (an alias resolved) if the engine or diffusers knows it
    (did-you-mean on a typo)."""
    name = ALIASES.get(name.lower(), name)
    valid = [*ENGINE_BACKENDS, *ALIASES, *(b.value for b in _backend_names())]
    if name.lower() not in valid:
        close = difflib.get_close_matches(name.lower(), valid, n=1)
        hint = f" -- did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"attention backend {name!r} is not a diffusers backend{hint}; valid: 'auto', "
                         f"{', '.join(repr(v) for v in valid)}")
    return name.lower()


def unavailable_reason(name: str, profile) -> str | None:
    """Why backend `name` cannot run here (None = it can): what `auto` tests each choice by."""
    name = check_name(name)
    if name in ENGINE_BACKENDS:
        if profile.device != "cuda":
            return f"it needs a CUDA GPU (profile {profile.name!r} is {profile.device})"
        return kernel(name).missing_reason()
    try:
        diffusers_backend(name)
    except RuntimeError as e:  # diffusers: the backend's package is missing
        return str(e)
    return None


def diffusers_backend(name: str):
    """The diffusers member for backend `name`, its kernels checked to be installed (raises
    RuntimeError naming the package to install)."""
    backend = _backend_names()(check_name(name))
    diffusers_compat.check_backend_requirements(backend)
    return backend


def resolve_backend(name: str, profile) -> tuple[object, str]:
    """(the diffusers member the processors get, the label the report shows)."""
    name = check_name(name)
    if name not in ENGINE_BACKENDS:
        backend = diffusers_backend(name)
        return backend, backend.value
    if profile.device != "cuda":
        raise PlanError(f"attention backend {name!r} runs on CUDA GPUs; profile {profile.name!r} is "
                        f"{profile.device}: use backend='native' (or 'auto') there")
    module = kernel(name)
    member = module.register()  # raises, naming the extra, when the kernel is missing
    return member, f"{name} ({module.describe()})"


def auto_backend(profile) -> tuple[str, list[str]]:
    """The first of the profile's `attention_backends` that can run here, and the skipped
    choices with why."""
    skipped = []
    for name in profile.attention_backends:
        why = unavailable_reason(name, profile)
        if why is None:
            return name, skipped
        skipped.append(f"{name!r} skipped: {why}")
    raise RuntimeError(f"attention backend 'auto' on profile {profile.name!r}: none of "
                       f"{list(profile.attention_backends)} can run here ({'; '.join(skipped)}); "
                       "name a backend explicitly")
