"""`magi-zoo list`: every model variant with its family, aliases and weights."""

from __future__ import annotations

from ... import adapters
from ...engine import format_table
from ..console import say


def cmd_list(args) -> int:
    rows = []
    for a in adapters.all_adapters():
        inv = {}
        for alias, target in a.aliases.items():
            inv.setdefault(target, []).append(alias)
        for v in a.variants.values():
            rows.append({"model": v.name, "family": a.family, "aliases": ", ".join(inv.get(v.name, [])),
                         "weights": "random (tiny)" if v.tiny else (v.hub_id or "random"),
                         "description": v.description})
    say(format_table(rows))
    return 0
