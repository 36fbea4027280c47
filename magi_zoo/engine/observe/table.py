"""`format_table`: the plain monospace table every printed summary uses (the report, the
resolved plan's repr, `explain`'s summary, the CLI, the benchmarks).

Its own module because the resolver prints with it and the report holds a resolved plan:
beside either, one would import the other.
"""

from __future__ import annotations

from typing import Any


def format_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A plain monospace table (markdown-compatible)."""
    if not rows:
        return "(empty)"
    columns = columns or list(rows[0])
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(columns), sep, *(line(r) for r in cells)])
