"""The attention layers a backend is set on, one kind each: diffusers' processors, transformers'
attention layers, and this project's own layers that declare ATTENTION_BACKENDS. Each setter
appends (object, attribute, prior value) to the step's undo list."""

from __future__ import annotations

import functools
import inspect
import warnings

import torch.nn as nn

from ..compat import diffusers as diffusers_compat
from ..compat import transformers as transformers_compat
from ..resolve import PlanError
from .backends import ENGINE_BACKENDS, TRANSFORMERS_NAMES, kernel, resolve_backend


def processors(module: nn.Module) -> list:
    """The attention processors under `module` that carry a dispatch backend (diffusers' layers,
    which dispatch through `diffusers.models.attention_dispatch` by that backend)."""
    out = []
    for m in module.modules():
        proc = getattr(m, "processor", None)
        if diffusers_compat.has_backend_slot(proc) and all(p is not proc for p in out):
            out.append(proc)
    return out


def engine_layers(module: nn.Module) -> list:
    """The attention layers under `module` that are not diffusers': model code written for
    this project (BAGEL's MoT attention) declares the backends it can dispatch in a class
    attribute ``ATTENTION_BACKENDS`` (engine names: "native", "fa3") and reads its instance
    attribute ``attention_backend`` at call time."""
    return [m for m in module.modules() if isinstance(getattr(type(m), "ATTENTION_BACKENDS", None), tuple)]


@functools.cache
def _reads_interface(cls: type) -> bool:
    """Whether `cls.forward` looks its attention function up in transformers' interface (by the
    config's attention implementation); older model code computes attention inline and would
    ignore a backend set on it."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def transformers_layers(module: nn.Module) -> list:
    """transformers' attention layers under `module`: modules of a `transformers.` class that hold
    a config and call the attention interface it names at call time."""
    return [m for m in module.modules()
            if type(m).__module__.startswith("transformers.")
            and transformers_compat.has_attn_implementation(getattr(m, "config", None)) and _reads_interface(type(m))]


def set_processors(procs: list, backend: object, undo_list: list) -> None:
    """Point diffusers' processors at dispatch backend `backend`."""
    for p in procs:
        undo_list.append((p, diffusers_compat.set_processor_backend, diffusers_compat.processor_backend(p)))
        diffusers_compat.set_processor_backend(p, backend)


def transformers_backend(name: str, profile, key: str, auto: bool, cls_name: str) -> tuple[str, str]:
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
        why = kernel(name).transformers_missing_reason()
        if why is not None:
            warnings.warn(f"attention backend 'auto' on key {key!r} ({cls_name}, a transformers attention "
                          f"layer) uses 'native' instead of {name!r}: {why}", RuntimeWarning, stacklevel=3)
            return "sdpa", f"sdpa (transformers; auto: {name!r} skipped: {why})"
    if name == "native":
        return "sdpa", "sdpa (transformers)"
    _, label = resolve_backend(name, profile)  # the same checks as for diffusers' layers
    return kernel(name).register_transformers(), label


def set_transformers_layer(layer: nn.Module, impl: str, undo_list: list) -> None:
    """Point one transformers attention layer at attention implementation `impl` through its own
    copy of its config (the model's config, and the masks the model builds from it, stay as they
    are)."""
    undo_list.append((layer, _set_config, layer.config))
    layer.config = transformers_compat.with_attn_implementation(layer.config, impl)


def _set_config(layer: nn.Module, config) -> None:
    layer.config = config


def set_engine_layer(layer: nn.Module, name: str, profile, key: str, undo_list: list) -> str:
    """Set one engine attention layer's backend (one it declares); returns the report label."""
    supported = type(layer).ATTENTION_BACKENDS
    if name not in supported:
        raise PlanError(f"attention key {key!r}: {type(layer).__name__} dispatches {', '.join(map(repr, supported))} "
                        f"(its ATTENTION_BACKENDS), not {name!r}; choose one of those")
    # the same checks and registration as for diffusers' layers (an engine kernel must be
    # registered either way: the layer calls it directly)
    _, label = resolve_backend(name, profile)
    undo_list.append((layer, _set_attention_backend, layer.attention_backend))
    layer.attention_backend = name
    return label


def _set_attention_backend(layer: nn.Module, name: str) -> None:
    layer.attention_backend = name
