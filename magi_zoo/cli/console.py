"""What the CLI prints: progress lines as they happen, and an error as one line.

Errors in what the user gave (flags, paths, weights, CUDA) end as `magi-zoo: error: ...` and
exit status 2, never a traceback (`--debug` shows it).
"""

from __future__ import annotations

import sys

from ..distributed import rank_tag

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
    tag = rank_tag()
    text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
    msg = one_line(text) or type(e).__name__
    if isinstance(e, USER_ERRORS):
        print(f"magi-zoo: error: {tag}{msg}", file=sys.stderr)
    else:
        print(f"magi-zoo: error: {tag}{type(e).__name__}: {msg} (magi-zoo --debug ... shows the traceback)",
              file=sys.stderr)
    return 2
