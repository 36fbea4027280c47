"""What the CLI prints: progress lines as they happen, and an error as one line.

Errors in what the user gave (flags, paths, weights, CUDA) end as `magi-zoo: error: ...` and
exit status 2, never a traceback (`--debug` shows it). A reader that closed the output early
(`| head -1`) ends the command quietly (`reader_gone`, `quiet_closed_output`). Progress bars
drawn into a file or a pipe never move the cursor (`plain_progress_bars`).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time

# The exit status when the reader closed our output: what a shell reports for a tool that
# SIGPIPE ended (128 + 13), so `set -o pipefail` scripts see a truncated listing as one.
CLOSED_PIPE_STATUS = 141

# Errors a user's input causes; their message says what to do. Anything else is named by
# its type, so a bug report can start there.
USER_ERRORS = (ValueError, TypeError, KeyError, OSError, RuntimeError, NotImplementedError, ImportError)


def say(*parts) -> None:
    """Print a progress line now (flushed: long steps follow, and the output may be a pipe)."""
    print(*parts, flush=True)


def one_line(e: object) -> str:
    """`e`'s text with every run of whitespace (line breaks included) as one space."""
    return " ".join(str(e).split())


def print_error(e: BaseException) -> int:
    """Print `e` as the one `magi-zoo: error:` line (rank-tagged in a multi-process run: which
    process failed); returns the exit status, 2."""
    from ..distributed import rank_tag  # lazy: distributed imports torch, which --help / --version never need

    tag = rank_tag()
    text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
    msg = one_line(text) or type(e).__name__
    if isinstance(e, USER_ERRORS):
        print(f"magi-zoo: error: {tag}{msg}", file=sys.stderr)
    else:
        print(f"magi-zoo: error: {tag}{type(e).__name__}: {msg} (magi-zoo --debug ... shows the traceback)",
              file=sys.stderr)
    return 2


def _closed_streams() -> list:
    """stdout / stderr when they are pipes whose reader has gone (poll reports an error on
    a pipe's write end once no reader is left)."""
    gone = []
    for stream in (sys.__stdout__, sys.__stderr__):
        try:
            fd = stream.fileno()
        except (AttributeError, ValueError, OSError):  # closed, or not a file (captured)
            continue
        if not hasattr(select, "poll"):  # pragma: no cover - Windows has no SIGPIPE either
            continue
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0)):
            gone.append(stream)
    return gone


def reader_gone() -> bool:
    """Whether the reader of stdout or stderr has closed it (`magi-zoo ... | head -1`):
    a BrokenPipeError then means "nobody is listening", not a failure."""
    return bool(_closed_streams())


def quiet_closed_output() -> None:
    """Point the closed stream(s) at /dev/null, so the interpreter's final flush of what
    is still buffered adds no 'Broken pipe' message at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in _closed_streams():
        os.dup2(devnull, stream.fileno())
    os.close(devnull)


def plain_progress_bars() -> None:
    """On a terminal, nested progress bars are drawn on lines of their own (tqdm moves the
    cursor between them). Into a file or a pipe those cursor moves would be written as text:
    a stray `ESC[A` for each update of a nested bar -- diffusers' "Loading pipeline
    components" bar around transformers' "Loading weights" and diffusers' "Loading
    checkpoint shards". There every bar draws at position 0, one line after another.

    tqdm reads its defaults from `TQDM_*` variables when it is imported, so this runs before
    anything imports it (the CLI imports the libraries only after parsing); a TQDM_POSITION
    the user set wins, and the ranks of a `--nproc` job (stderr relayed through a pipe)
    inherit it."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed, or not a file
        terminal = False
    if not terminal:
        os.environ.setdefault("TQDM_POSITION", "0")


# When `ticking` last printed (or started): the heartbeat that follows it counts its first
# quiet interval from here, so the hand-over adds no silence.
LAST_TICK = [0.0]


# 1.25 s: a line comes at least every 2 s even when a busy interpreter delays the thread (a
# compile holding the GIL delayed lines by up to ~0.5 s on a loaded 2-core machine).
BEAT_S = 1.25


@contextlib.contextmanager
def ticking(what: str, interval: float = BEAT_S):
    """While the block runs (importing a command's modules: torch, diffusers, transformers take
    seconds, more on a busy machine), print `  ... <what>: N s` to stderr every `interval`
    seconds, so the first seconds of a run are not silent. Stdlib only: the heartbeat of
    `magi_zoo.engine.observe.progress` takes over once torch is loaded."""
    done = threading.Event()
    t0 = LAST_TICK[0] = time.monotonic()

    def beat() -> None:
        while not done.wait(interval):
            try:
                print(f"  ... {what}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # the reader went away: stop quietly
                return
            LAST_TICK[0] = time.monotonic()

    thread = threading.Thread(target=beat, name="magi-zoo-import-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
