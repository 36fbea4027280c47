"""`magi-zoo`: list models, show a resolved spec, run the demo, generate.

    magi-zoo list
    magi-zoo spec wan2.1 --gpu h100
    magi-zoo demo
    magi-zoo run wan2.1-tiny --prompt "a corgi surfing" --out corgi.mp4
    magi-zoo explain wan2.1-tiny --gpu cpu --out explain/

Errors in what the user gave (flags, paths, weights, CUDA) print one line,
`magi-zoo: error: ...`, and exit 2; `--debug` (anywhere on the line) shows the traceback.
A reader that closes the output early (`magi-zoo spec wan2.1 | head -1`) ends the command
quietly with exit status 141, as a tool killed by SIGPIPE would.

The package: `parser` (the command line), `commands/` (one module per command, imported
only once the command line names it: they load torch, which `--help` / `--version` never
need), `writers` (output files), `launch` (re-running a command under torchrun), `console`
(what is printed).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import sys
from typing import TYPE_CHECKING, Callable

from .console import CLOSED_PIPE_STATUS, plain_progress_bars, print_error, quiet_closed_output, reader_gone, ticking
from .parser import build_parser

if TYPE_CHECKING:  # the lazy names below, for readers and type checkers
    from .commands.run import generate_to
    from .commands.run_options import parse_compile_overrides
    from .writers import write_output

__all__ = ["main", "build_parser", "generate_to", "parse_compile_overrides", "write_output"]

# public name -> the module that defines it, imported on first access (they load torch)
_LAZY = {"generate_to": ".commands.run", "parse_compile_overrides": ".commands.run_options",
         "write_output": ".writers"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


# Commands whose modules import torch and the model libraries (seconds): a ticker while they load.
LONG_IMPORTS = ("run", "demo", "explain")


def command(name: str) -> Callable:
    """The function behind subcommand `name`: `commands.<name>.cmd_<name>`, imported now
    (looked up at call time, so a patch of it is seen)."""
    return getattr(importlib.import_module(f".commands.{name}", __name__), f"cmd_{name}")


def main(argv: list[str] | None = None) -> int:
    """The `magi-zoo` command; returns the exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of our output went away (`| head -1`): nothing more can be shown, and
        # saying so would only add noise. Anything else's broken pipe is an error.
        if not reader_gone():
            raise
        quiet_closed_output()
        return CLOSED_PIPE_STATUS


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:  # --help, --version or a usage error, printed by argparse
        sys.stdout.flush()
        if reader_gone():  # argparse drops a failed write silently: it was not seen
            raise BrokenPipeError(errno.EPIPE, "the reader closed the output") from None
        raise
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what --nproc re-runs under torchrun
    plain_progress_bars()  # before the command imports the libraries (and tqdm)
    try:
        with ticking("loading torch and the model libraries") if args.cmd in LONG_IMPORTS else contextlib.nullcontext():
            fn = command(args.cmd)
        return fn(args)
    except KeyboardInterrupt:
        print("magi-zoo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        if reader_gone() or args.debug:
            raise  # main ends quietly (a closed reader) or shows the traceback
        return print_error(e)
    except Exception as e:
        # Every error ends as one line and exit 2, never a traceback (--debug shows it).
        if args.debug:
            raise
        return print_error(e)
