"""The adapter registry. Families are imported lazily, by string, so that
`import magi_zoo` stays cheap; adapter modules themselves import diffusers /
transformers only inside their build functions (`# lazy:`), so listing models stays cheap too.

Out-of-tree families register through a Python entry point in the group
``magi_zoo.adapters`` (name = family, value = ``"module:AdapterClass"``), e.g. in the
contributing package's pyproject.toml::

    [project.entry-points."magi_zoo.adapters"]
    mymodel = "my_package.adapter:MyAdapter"

Its spec file is looked up next to the adapter module when the adapter sets
`spec_file` to a path relative to its own module (see `Adapter.spec_path`).
"""

from __future__ import annotations

import difflib
import importlib
from importlib.metadata import entry_points

from .base import Adapter, Variant

# family -> "module:Class". Add a line here to register a family.
# Each family is a package `adapters/<family>/` whose `adapter.py` holds the class.
FAMILIES: dict[str, str] = {
    "wan": "magi_zoo.adapters.wan.adapter:WanAdapter",
    "wan22": "magi_zoo.adapters.wan22.adapter:Wan22Adapter",
    "bagel": "magi_zoo.adapters.bagel.adapter:BagelAdapter",
    "flux": "magi_zoo.adapters.flux.adapter:FluxAdapter",
    "qwen3_omni": "magi_zoo.adapters.qwen3_omni.adapter:Qwen3OmniAdapter",
    "self-forcing": "magi_zoo.adapters.self_forcing.adapter:SelfForcingAdapter",
    "hunyuanvideo15": "magi_zoo.adapters.hunyuan_video15.adapter:HunyuanVideo15Adapter",
    "ltx2": "magi_zoo.adapters.ltx2.adapter:LTX2Adapter",
    "qwen_image": "magi_zoo.adapters.qwen_image.adapter:QwenImageAdapter",
    "flux2": "magi_zoo.adapters.flux2.adapter:Flux2Adapter",
    "z_image": "magi_zoo.adapters.z_image.adapter:ZImageAdapter",
}

ENTRY_POINT_GROUP = "magi_zoo.adapters"

_loaded: dict[str, Adapter] = {}


def families() -> dict[str, str]:
    """Built-in families plus those installed packages register under ENTRY_POINT_GROUP
    (read on every call, so a package installed at run time is seen)."""
    out = dict(FAMILIES)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in FAMILIES:
            raise ValueError(f"entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} "
                             f"clashes with the built-in family of that name; rename it")
        out[ep.name] = ep.value
    return out


def get_family(family: str) -> Adapter:
    if family not in _loaded:
        table = families()
        if family not in table:
            raise ValueError(f"unknown model family {family!r}; families: {', '.join(table)}")
        mod_name, cls_name = table[family].split(":")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        if not (isinstance(cls, type) and issubclass(cls, Adapter)):
            raise TypeError(f"family {family!r}: {table[family]} is not a magi_zoo Adapter subclass")
        adapter = cls()
        if getattr(adapter, "family", None) != family:
            raise ValueError(f"family {family!r}: {cls.__name__}.family is {getattr(adapter, 'family', None)!r}; "
                             "the registry name and the adapter's family must agree")
        _loaded[family] = adapter
    return _loaded[family]


def all_adapters() -> list[Adapter]:
    return [get_family(f) for f in families()]


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
    close = close_models(key, list_models(include_aliases=True))
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"unknown model {name!r}.{hint} Known models: {', '.join(list_models())} "
                     "(`magi-zoo list` describes them)")


SUGGEST_CUTOFF = 0.75  # difflib's similarity, 0..1, of the names without punctuation


def _bare(name: str) -> str:
    """A name without case and punctuation: 'Wan2.1-Tiny' and 'wan21tiny' compare equal."""
    return "".join(c for c in name.lower() if c.isalnum())


def close_models(name: str, choices: list[str], n: int = 3) -> list[str]:
    """The known names `name` is plausibly a typo or a prefix of (at most `n`): similar
    enough once punctuation is ignored, or starting with it. Nothing for an unrelated name
    -- a far-fetched suggestion ('nosuchmodel' -> 'flux-schnell') misleads more than none."""
    bare = _bare(name)
    scored, seen = [], set()
    for c in choices:
        b = _bare(c)
        ratio = difflib.SequenceMatcher(None, bare, b).ratio()
        if b not in seen and (ratio >= SUGGEST_CUTOFF or (len(bare) >= 3 and b.startswith(bare))):
            seen.add(b)  # 'qwen3-omni' and 'qwen3_omni': one suggestion
            scored.append((-ratio, c))
    return [c for _, c in sorted(scored)[:n]]


__all__ = ["Adapter", "Variant", "FAMILIES", "get_family", "all_adapters", "list_models", "lookup"]
