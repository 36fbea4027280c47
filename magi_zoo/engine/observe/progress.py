"""A heartbeat for long phases: a progress line whenever the output has been quiet too long.

A run's phases -- the build, the first call's compiles, a generation stage without a bar of
its own (BAGEL's understanding, the Qwen3-Omni talker, Self-Forcing's first block) -- can
each take tens of seconds on a first run, and a silent terminal reads as a hang. Code names
the phase it is in with `stage(name)` (nested stages restore the outer name); while a
`Heartbeat` runs, a thread prints `  ... <stage>: <n> s` whenever nothing was written to
stdout or stderr for `interval` seconds, so the output never goes quiet for longer. Output
that does arrive (a progress bar's update, a `say` line) resets the wait: no heartbeat lines
between bar updates that come often enough.

The clock and the sleep are arguments, so a test drives the heartbeat with a fake clock.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator

_stages: list[tuple[str, float]] = []  # (name, start) of the stages entered, innermost last
_lock = threading.Lock()


@contextlib.contextmanager
def stage(name: str, clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Name the phase the code is in, for the heartbeat's lines (cheap: no thread of its own;
    without a running `Heartbeat` it only records the name)."""
    with _lock:
        _stages.append((name, clock()))
    try:
        yield
    finally:
        with _lock:
            _stages.pop()


def rename_stage(name: str, clock: Callable[[], float] = time.monotonic) -> None:
    """The innermost stage moves on to `name` (its clock restarts): for a phase that ends inside
    a library call, e.g. the Qwen3-Omni thinker's last token, after which the talker runs."""
    with _lock:
        if _stages:
            _stages[-1] = (name, clock())


def current_stage() -> tuple[str, float] | None:
    """The innermost stage's (name, start), or None outside any."""
    with _lock:
        return _stages[-1] if _stages else None


class _Watched:
    """A stream that records when it was last written to (and whether the last write ended
    its line: a bar redrawing with '\\r' has not), everything else passed through."""

    def __init__(self, stream, beat: Heartbeat):
        self._stream = stream
        self._beat = beat

    def write(self, text: str) -> int:
        if text:
            self._beat.wrote(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class Heartbeat:
    """Prints `  ... <stage>: <n> s` to `out` (default stderr) whenever stdout and stderr were
    quiet for `interval` seconds while a stage is open. Use as a context manager: it watches
    sys.stdout / sys.stderr and runs its thread while inside."""

    def __init__(self, interval: float = 2.0, *, clock: Callable[[], float] = time.monotonic,
                 out=None, poll: float | None = None, quiet_since: float | None = None):
        self.interval = interval
        self.quiet_since = quiet_since  # the clock's time of the last output before this heartbeat (None: now)
        self.clock = clock
        self.poll = poll if poll is not None else min(0.1, interval / 4)
        self._out = out
        self._last = clock() if quiet_since is None else min(clock(), quiet_since)
        self._line_open = False  # the last write left a line unfinished (a bar's '\r' redraw)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: tuple | None = None
        self.beats = 0  # heartbeat lines printed

    def wrote(self, text: str) -> None:
        self._last = self.clock()
        self._line_open = not text.endswith("\n")

    def tick(self) -> bool:
        """One check: print a heartbeat line if quiet for `interval` inside a stage. True if it printed."""
        now = self.clock()
        current = current_stage()
        if current is None or now - self._last < self.interval:
            return False
        name, start = current
        out = self._out or sys.stderr
        out.write(("\n" if self._line_open else "") + f"  ... {name}: {now - start:.0f} s\n")
        out.flush()
        self.beats += 1
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.tick()
            except (OSError, ValueError):  # the output was closed (a reader gone): stop quietly
                return

    def __enter__(self) -> Heartbeat:
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Watched(sys.stdout, self), _Watched(sys.stderr, self)
        now = self.clock()
        self._last = now if self.quiet_since is None else min(now, self.quiet_since)
        self._thread = threading.Thread(target=self._loop, name="magi-zoo-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._saved is not None:
            sys.stdout, sys.stderr = self._saved
