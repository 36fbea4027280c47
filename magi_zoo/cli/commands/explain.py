"""`magi-zoo explain`: one call with torch's compile trace on, written as a folder."""

from __future__ import annotations

from pathlib import Path

from ... import zoo  # `zoo.load` looked up at call time: a patch of it reaches every command
from ..console import say


def cmd_explain(args) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory; pass a directory")
    handle = zoo.load(args.model, gpu=args.gpu, weights=args.weights, spec_file=args.spec_file)
    if args.entry is not None:
        handle.adapter.check_entry(args.entry)
    say(f"explaining {handle.variant.name}: one call of its "
        f"{args.entry or handle.adapter.entry_points[0]!r} entry point on example inputs, compile trace on ...")
    ex = handle.explain(out, entry=args.entry)
    say(ex.summary)
    say(f"wrote {out}/ (start with {out / 'summary.md'})")
    return 0
