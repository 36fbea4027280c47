"""The worker process: one per GPU (on the CPU: one), holding one model loaded with its plan
(`serve`; a group of N processes for one copy over N cards: `group.py`).

It is started with the `spawn` method (a fresh interpreter: no CUDA state or event loop copied
from the server; entry point `process.main`) and talks to the server over one
`multiprocessing` pipe:

    server -> worker   ("job", job_id, prompt, options, out, audio_out)  |  ("cancel", job_id)  |  ("stop",)
    worker -> server   ("ready", info)  |  ("load_failed", message)
                       ("progress", job_id, done, total)
                       ("done", job_id, info)  |  ("failed", job_id, message, cancelled[, broken])

A job runs the same path as `magi-zoo run` after its build: `generate_to` checks the options,
generates through the handle and writes the output atomically. Progress is read off the
progress bars the families already draw (tqdm's `n/total` meter, Self-Forcing's
`block i/N` lines), so every family reports steps without a hook of its own; a cancel
request raises at the next bar update, i.e. between two steps.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from typing import Any, Callable

# tqdm's meter `  3/10 [00:01<...` and Self-Forcing's `block 2/4:` lines
BAR = re.compile(r"(\d+)/(\d+) \[")
BLOCK = re.compile(r"block (\d+)/(\d+):")


class JobCancelled(Exception):
    """Raised inside a generation at the next progress update once its cancel was asked for."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker loads: `magi_zoo.load`'s arguments, and the card it owns."""

    model: str
    load: dict[str, Any]  # gpu, weights, dtype, compile, overrides, precision, spec_file, cache_dir, ...
    device_index: int | None = None  # the CUDA device this worker owns (None: CPU, or the only card)
    warmup: bool = False  # one call at the defaults right after loading (compiles before the first request)
    # a group (`--nproc N`, `group.py`): the group's CUDA devices, one per rank (None each on the CPU),
    # this process's rank, and the loopback port rank 0's rendezvous listens on; () = a single worker
    group: tuple[int | None, ...] = ()
    rank: int = 0
    port: int | None = None


class ProgressTap:
    """A stand-in for stdout / stderr during a job: progress lines become `report(done,
    total)` calls (and are not echoed: a server log is no place for bars); other text goes
    to the real stream. Raises `JobCancelled` when `cancelled()` turns true."""

    def __init__(self, stream, report: Callable[[int, int], None], cancelled: Callable[[], bool]):
        self.stream, self.report, self.cancelled = stream, report, cancelled

    def write(self, text: str) -> int:
        if self.cancelled():
            raise JobCancelled("cancelled")
        seen = False
        for part in text.replace("\r", "\n").split("\n"):
            m = BAR.search(part) or BLOCK.search(part)
            if m:
                self.report(int(m.group(1)), int(m.group(2)))
                seen = True
        if not seen and text.strip():
            self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


def compile_info(handle) -> dict[str, Any]:
    """The compile counters the server exports: compiled frames, graph breaks, recompiles,
    compile seconds (0 everywhere for an eager model), and the compile cache's outcome."""
    report = handle.report()
    cache = handle.cache.status if handle.cache is not None else "unused"  # unused | miss | hit | rebuilt | saved
    if report is None:
        return {"frames": 0, "graph_breaks": 0, "recompiles": 0, "compile_s": 0.0, "cache": cache}
    return {"frames": report.frames, "graph_breaks": report.graph_breaks, "recompiles": report.recompiles,
            "compile_s": round(report.compile_s, 3), "cache": cache}


class Inbox:
    """What the server sent while a job runs, read without blocking at each progress update:
    a cancel of this job (raised at the update) or a stop (after the job)."""

    def __init__(self, conn, job_id: str):
        self.conn, self.job_id, self.cancel, self.stop = conn, job_id, False, False

    def cancelled(self) -> bool:
        while not self.cancel and self.conn.poll():
            msg = self.conn.recv()
            self.cancel = self.cancel or (msg[0] == "cancel" and msg[1] == self.job_id)
            self.stop = self.stop or msg[0] == "stop"
        return self.cancel


def serve(conn, spec: WorkerSpec) -> None:
    """A single worker: load, say ready, run jobs until told to stop or the pipe closes."""
    t0 = time.perf_counter()
    try:
        from .. import zoo  # lazy: the worker process imports torch and the libraries after choosing its card

        handle = zoo.load(spec.model, **spec.load)
        if spec.warmup:
            run_job(handle, "warm up", {}, None, None, lambda d, t: None, lambda: False)
    except Exception as e:  # the server reports it and does not restart a worker that cannot load
        conn.send(("load_failed", error_text(e)))
        return
    conn.send(("ready", ready_info(handle, t0)))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server is gone
            return
        if msg[0] == "stop":
            return
        if msg[0] != "job":  # a cancel that came after its job ended
            continue
        _, job_id, prompt, options, out, audio_out = msg
        inbox = Inbox(conn, job_id)
        report = lambda done, total: conn.send(("progress", job_id, done, total))  # noqa: E731
        t = time.perf_counter()
        try:
            info = run_job(handle, prompt, options, out, audio_out, report, inbox.cancelled)
        except JobCancelled:
            conn.send(("failed", job_id, "cancelled while running", True))
        except Exception as e:  # the job fails with the error's text; the worker keeps serving
            conn.send(("failed", job_id, error_text(e), False))
        else:
            info.update(run_s=time.perf_counter() - t, compile=compile_info(handle))
            conn.send(("done", job_id, info))
        if inbox.stop:
            return


def group_environment(spec: WorkerSpec) -> dict[str, str]:
    """torchrun's environment for one rank of a group, which the server starts itself: the
    rendezvous on loopback at the group's port, and the group's cards visible (LOCAL_RANK
    picks this rank's, as `distributed.init` reads it)."""
    n = str(len(spec.group))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec.port), "RANK": str(spec.rank), "WORLD_SIZE": n,
           "LOCAL_RANK": str(spec.rank), "LOCAL_WORLD_SIZE": n}
    if spec.group[0] is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in spec.group)
    return env


def error_text(e: BaseException) -> str:
    """An exception as the one line a job's or a load's error carries."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def ready_info(handle, t0: float) -> dict[str, Any]:
    """What the "ready" message carries: the load's seconds, the pid, the compile counters."""
    return {"load_s": time.perf_counter() - t0, "pid": os.getpid(), "compile": compile_info(handle)}


def run_job(handle, prompt: str, options: dict[str, Any], out: str | None, audio_out: str | None,
            report: Callable[[int, int], None], cancelled: Callable[[], bool], *, write: bool = True,
            tap_cancels: bool = True) -> dict[str, Any]:
    """One generation through `magi-zoo run`'s own path (`generate_to`), progress bars tapped;
    `out=None` generates without writing (the warm-up); `write=False` generates for `out`
    without writing it (a group's ranks other than 0). `tap_cancels=False`: the tap does not
    check `cancelled` (a group's `report` decides, at the same step on every rank); it is
    still checked once the output is written."""
    from ..cli.commands.run import generate_to  # lazy: imports the CLI's writers (diffusers) in the worker only

    options = dict(options)
    if audio_out is not None:
        options["audio_out"] = audio_out
    old = sys.stdout, sys.stderr
    in_tap = cancelled if tap_cancels else (lambda: False)
    taps = ProgressTap(old[0], report, in_tap), ProgressTap(old[1], report, in_tap)
    sys.stdout, sys.stderr = taps

    def generated() -> None:
        # From here the bars are the writer's (the video encoder draws one, `1/1 [`): swallowed,
        # not reported. Reported, they would move the job's progress back, and in a group rank 0
        # alone (the rank that writes) would meet `report`'s collective, which its peers never join.
        for tap in taps:
            tap.report = lambda done, total: None
    try:
        if out is None:
            given = handle.adapter.check_run(handle.variant, options)
            handle.adapter.generate(handle, prompt=prompt, progress=True, **given)
            return {}
        written = generate_to(handle, prompt=prompt, out=out, progress=True, overwrite=False, write=write,
                              on_generated=generated, **options)
    finally:
        sys.stdout, sys.stderr = old
    if cancelled():  # asked for after the last update: the output is not what was wanted any more
        for path in written:
            path.unlink(missing_ok=True)
        raise JobCancelled("cancelled")
    return {"files": [str(p) for p in written]}
