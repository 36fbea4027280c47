"""diffusers' model hooks as the parallel step uses them: the hook classes (imported when a plan
asks for parallelism), and the exact undo of what registering a hook leaves behind -- an instance
`forward`, a hook registry, the context-parallel config attribute."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..compat import diffusers as diffusers_compat

MISSING = object()  # an attribute the instance did not have


def hook_classes():
    """(BaseState, HookRegistry, ModelHook, StateManager) of diffusers' hook machinery."""
    # lazy: diffusers is heavy; `import magi_zoo` never imports it
    from diffusers.hooks.hooks import BaseState, HookRegistry, ModelHook, StateManager

    return BaseState, HookRegistry, ModelHook, StateManager


def registry(module: nn.Module):
    """`module`'s hook registry (created when it has none)."""
    return hook_classes()[1].check_if_exists_or_initialize(module)


def has_registry(module: nn.Module) -> bool:
    """Whether `module` has a hook registry of its own."""
    return diffusers_compat.HOOK_REGISTRY_ATTR in module.__dict__


def drop_empty_registry(module: nn.Module) -> None:
    """Delete `module`'s hook registry if it holds no hook (one the step made)."""
    reg = module.__dict__.get(diffusers_compat.HOOK_REGISTRY_ATTR)
    if reg is not None and not reg.hooks:
        del module.__dict__[diffusers_compat.HOOK_REGISTRY_ATTR]


def instance_attr(obj: Any, name: str) -> Any:
    """`obj`'s own attribute `name` (MISSING when it has none), to put back with `restore_attr`."""
    return obj.__dict__.get(name, MISSING)


def restore_attr(obj: Any, name: str, prior: Any) -> None:
    if prior is MISSING:
        obj.__dict__.pop(name, None)
    else:
        obj.__dict__[name] = prior


def forwards(modules) -> list[tuple[nn.Module, Any]]:
    """Each module's instance-level `forward` (or its absence). Diffusers' `remove_hook` puts
    back the forward it wrapped *as an instance attribute* even when there was none (the
    class method bound); restoring these makes the undo exact."""
    return [(m, instance_attr(m, "forward")) for m in modules]


def restore_forwards(saved: list[tuple[nn.Module, Any]]) -> None:
    for m, prior in saved:
        restore_attr(m, "forward", prior)
