"""The GPU suite's card lock (tests/helpers/card_lock.py): shared holders run together, an
exclusive holder (a `gpu_timing` test) runs alone, and one waiting for the card is not passed by
shared holders that arrive after it."""

import threading
import time

from helpers.card_lock import card_lock


def _order(path, first_exclusive: bool, second_exclusive: bool) -> list[str]:
    """Thread A holds the lock 0.3 s; B asks for it 0.05 s in. The log says whether B's block
    started while A's was still running."""
    log: list[str] = []
    started = threading.Event()

    def a():
        with card_lock(path, first_exclusive):
            started.set()
            log.append("a in")
            time.sleep(0.3)
            log.append("a out")

    def b():
        started.wait()
        time.sleep(0.05)
        with card_lock(path, second_exclusive):
            log.append("b in")

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return log


def test_shared_holders_run_together(tmp_path):
    assert _order(tmp_path / "card.lock", False, False) == ["a in", "b in", "a out"]


def test_an_exclusive_holder_runs_alone(tmp_path):
    assert _order(tmp_path / "card.lock", True, False) == ["a in", "a out", "b in"]
    assert _order(tmp_path / "card.lock", False, True) == ["a in", "a out", "b in"]


def test_a_waiting_exclusive_holder_is_not_passed(tmp_path):
    """A holds shared; X asks for exclusive and waits; C asks for shared after X: C must wait
    for X (flock alone would let C in beside A)."""
    path, log = tmp_path / "card.lock", []
    a_in, x_waiting = threading.Event(), threading.Event()

    def a():
        with card_lock(path, False):
            a_in.set()
            x_waiting.wait(5)
            time.sleep(0.2)  # C arrives while A still holds the card and X waits for it
            log.append("a out")

    def x():
        a_in.wait(5)
        x_waiting.set()
        with card_lock(path, True):
            log.append("x in")
            time.sleep(0.05)
            log.append("x out")

    def c():
        x_waiting.wait(5)
        time.sleep(0.1)
        with card_lock(path, False):
            log.append("c in")

    threads = [threading.Thread(target=f) for f in (a, x, c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert log == ["a out", "x in", "x out", "c in"]
