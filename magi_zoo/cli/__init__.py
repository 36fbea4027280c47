"""`magi-zoo`: list models, show a resolved spec, run the demo, generate.

    magi-zoo list
    magi-zoo spec wan2.1 --gpu h100
    magi-zoo demo
    magi-zoo run wan2.1-tiny --prompt "a corgi surfing" --out corgi.mp4
    magi-zoo explain wan2.1-tiny --gpu cpu --out explain/

Errors in what the user gave (flags, paths, weights, CUDA) print one line,
`magi-zoo: error: ...`, and exit 2; `--debug` shows the traceback.

The package: `parser` (the command line), `commands/` (one module per command), `writers`
(output files), `launch` (re-running a command under torchrun), `console` (what is printed).
"""

from __future__ import annotations

import sys

from .commands.run import generate_to
from .commands.run_options import parse_compile_overrides
from .console import print_error
from .parser import build_parser
from .writers import write_output

__all__ = ["main", "build_parser", "generate_to", "parse_compile_overrides", "write_output"]


def main(argv: list[str] | None = None) -> int:
    """The `magi-zoo` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what --nproc re-runs under torchrun
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("magi-zoo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Every error ends as one line and exit 2, never a traceback (--debug shows it).
        if args.debug:
            raise
        return print_error(e)
