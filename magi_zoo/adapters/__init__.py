"""The adapter registry. Families are imported lazily, by string, so that
`import magi_zoo` stays cheap; adapter modules themselves import diffusers /
transformers only inside their build functions.
"""

from __future__ import annotations

import difflib
import importlib

from .base import Adapter, Variant

# family -> "module:Class". Add a line here to register a family.
FAMILIES: dict[str, str] = {
    "wan": "magi_zoo.adapters.wan:WanAdapter",
    "wan22": "magi_zoo.adapters.wan22:Wan22Adapter",
    "bagel": "magi_zoo.adapters.bagel:BagelAdapter",
    "flux": "magi_zoo.adapters.flux:FluxAdapter",
    "qwen3_omni": "magi_zoo.adapters.qwen3_omni:Qwen3OmniAdapter",
}

_loaded: dict[str, Adapter] = {}


def get_family(family: str) -> Adapter:
    if family not in _loaded:
        mod_name, cls_name = FAMILIES[family].split(":")
        _loaded[family] = getattr(importlib.import_module(mod_name), cls_name)()
    return _loaded[family]


def all_adapters() -> list[Adapter]:
    return [get_family(f) for f in FAMILIES]


def list_models(include_aliases: bool = False) -> list[str]:
    """Every variant name (optionally with aliases), in registry order."""
    names: list[str] = []
    for a in all_adapters():
        names += list(a.variants)
        if include_aliases:
            names += list(a.aliases)
    return names


def lookup(name: str) -> tuple[Adapter, Variant]:
    """Find the adapter and variant for a model name or alias; unknown names get a did-you-mean."""
    key = name.lower()
    for a in all_adapters():
        key_v = a.aliases.get(key, key)
        if key_v in a.variants:
            return a, a.variants[key_v]
    choices = list_models(include_aliases=True)
    close = difflib.get_close_matches(key, choices, n=3, cutoff=0.4)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}.{hint} Known models: {', '.join(list_models())}")


__all__ = ["Adapter", "Variant", "FAMILIES", "get_family", "all_adapters", "list_models", "lookup"]
