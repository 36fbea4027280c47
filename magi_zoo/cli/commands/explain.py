"""`magi-zoo explain`: one call with torch's compile trace on, written as a folder."""

from __future__ import annotations

from pathlib import Path

from ... import zoo  # `zoo.load` looked up at call time: a patch of it reaches every command
from ...io import check_writable
from ..console import say
from .run_options import parse_loras


def cmd_explain(args) -> int:
    # checked before the build: a folder that cannot be written, or that holds files (an earlier
    # explanation, or anything else) without --overwrite
    out = check_writable(Path(args.out), what="--out", directory=True, overwrite=args.overwrite,
                         overwrite_hint="pass --overwrite")
    handle = zoo.load(args.model, gpu=args.gpu, weights=args.weights, spec_file=args.spec_file,
                      lora=parse_loras(getattr(args, "lora", None)))
    for line in handle.lora.lines() if handle.lora is not None else []:
        say(line)
    if args.entry is not None:
        handle.adapter.check_entry(args.entry)
    say(f"explaining {handle.variant.name}: one call of its "
        f"{args.entry or handle.adapter.entry_points[0]!r} entry point on example inputs, compile trace on ...")
    ex = handle.explain(out, entry=args.entry)
    say(ex.summary)
    say(f"wrote {out}/ (start with {out / 'summary.md'})")
    return 0
