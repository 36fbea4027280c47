"""A readers-writer lock across processes (xdist workers) on one file: `card_lock(path,
exclusive)` holds it shared or exclusive for the block. A turnstile file in front of it gives a
waiting exclusive holder priority: flock alone lets shared holders keep taking the lock while an
exclusive one waits, and with three workers there is seldom a moment when none holds it."""

import contextlib
import fcntl
from pathlib import Path


@contextlib.contextmanager
def card_lock(path: Path, exclusive: bool):
    with open(path.with_suffix(".turnstile"), "a") as turnstile, open(path, "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # a waiting exclusive holder keeps it: no new shared ones pass
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
