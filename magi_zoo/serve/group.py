"""A worker that is a group of N processes (`magi-zoo serve --nproc N`): one copy of the model
spread over N cards by its plan's parallel split (context / CFG parallel), the split
`magi-zoo run --nproc N` applies.

The server starts the N processes itself (`pool.Worker`, `spawn`), each with torchrun's
environment (`worker.group_environment`: RANK, WORLD_SIZE, LOCAL_RANK, a rendezvous on
127.0.0.1 at a free port, the group's cards visible); each starts the process group with
`distributed.init` (NCCL on CUDA, gloo on the CPU) and loads the model with
`zoo.load(..., parallel=...)`. Rank 0 talks to the server's pipe as a single worker does; the
other ranks follow it over a gloo group of their own (the control group: CPU tensors, so no
CUDA sync; no idle limit, since a server may wait hours for a job):

- a job: rank 0 checks it (the options, its output path) and fixes its seed (every rank must
  draw the same initial noise: each computes part of one sample), then broadcasts it; every
  rank runs `generate_to`, rank 0 writing the output;
- progress and cancel: every rank draws the same progress bars; at each new bar position rank
  0 broadcasts whether the job was cancelled, so every rank raises at the same step (a rank
  leaving alone would leave the others waiting in a collective); rank 0 reports the position;
- the end: the ranks exchange their outcomes (ok, cancelled, error), so a job fails with the
  first error of any rank. A rank whose peers do not answer within `AGREE_TIMEOUT_S` (one is
  stuck in a collective, or gone) ends the group: rank 0 tells the server, which restarts the
  whole group. A rank that dies is seen by the server at once (its process sentinel, pool.py).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import distributed, zoo
from .worker import Inbox, JobCancelled, WorkerSpec, compile_info, error_text, ready_info, run_job

OK, CANCELLED, FAILED = 0, 1, 2
# How long a rank that finished its part of a job waits for the others' outcomes. Ranks
# that ran the same call finish within the skew of one step (the last one's collectives
# line them up); a rank still missing after a minute is stuck in a collective whose peer
# left it (an error on one card alone), and the group is restarted.
AGREE_TIMEOUT_S = 60.0
IDLE = datetime.timedelta(days=365)  # the control group's timeout: followers wait for the next job however long


class StepSync:
    """A group's progress callback (`ProgressTap`'s `report`), called on every rank at every bar
    position: at each new position rank 0's cancel flag is broadcast, and every rank raises
    `JobCancelled` there together. Bars redrawn at the same position, or drawn from another
    thread (tqdm's monitor), are skipped: the ranks must meet the same sequence of positions."""

    def __init__(self, control, cancelled: Callable[[], bool] | None = None,
                 report: Callable[[int, int], None] | None = None):
        self.control, self.cancelled, self.report, self.last = control, cancelled, report, None

    def __call__(self, done: int, total: int) -> None:
        if (done, total) == self.last or threading.current_thread() is not threading.main_thread():
            return
        self.last = (done, total)
        flag = torch.tensor([int(self.cancelled is not None and self.cancelled())])
        dist.broadcast(flag, src=0, group=self.control)
        if self.report is not None:
            self.report(done, total)
        if flag.item():
            raise JobCancelled("cancelled")


def agree(control, code: int, message: str) -> list[tuple[int, str]] | None:
    """Every rank's (outcome, message), in rank order; None when a peer did not answer within
    `AGREE_TIMEOUT_S` or is gone (the group is broken)."""
    world = dist.get_world_size(control)
    try:
        flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        work = dist.all_gather(flags, torch.tensor([code], dtype=torch.int64), group=control, async_op=True)
        work.wait(timeout=datetime.timedelta(seconds=AGREE_TIMEOUT_S))
        messages: list[Any] = [None] * world
        dist.all_gather_object(messages, message, group=control)  # every rank is here now: no wait
    except Exception:  # gloo's timeout, or a peer's closed connection
        return None
    return [(int(f.item()), m) for f, m in zip(flags, messages)]


def run_rank(handle, control, prompt: str, options: dict[str, Any], out: str | None, audio_out: str | None, *,
             report: Callable[[int, int], None] | None = None, cancelled: Callable[[], bool] | None = None,
             write: bool = False) -> tuple[dict[str, Any], list[tuple[int, str]] | None]:
    """This rank's part of one job (`out=None`: the warm-up), then the outcomes of all ranks."""
    sync = StepSync(control, cancelled, report)
    info: dict[str, Any] = {}
    try:
        info = run_job(handle, prompt, options, out, audio_out, sync, cancelled or (lambda: False), write=write,
                       tap_cancels=False)
        code, message = OK, ""
    except JobCancelled:
        code, message = CANCELLED, "cancelled while running"
    except Exception as e:  # every rank reports; rank 0 answers with the first error
        code, message = FAILED, error_text(e)
    return info, agree(control, code, message)


def verdict(outcomes: list[tuple[int, str]]) -> tuple[int, str]:
    """The job's outcome from every rank's: the first error (rank 0's own, or tagged with the
    rank's number), else cancelled when any rank was, else ok."""
    world = len(outcomes)
    for rank, (code, message) in enumerate(outcomes):
        if code == FAILED:
            return FAILED, message if rank == 0 else f"[rank {rank}/{world}] {message}"
    if any(code == CANCELLED for code, _ in outcomes):
        return CANCELLED, "cancelled while running"
    return OK, ""


def checked(handle, options: dict[str, Any], out: str, audio_out: str | None) -> dict[str, Any]:
    """A job's options checked on rank 0 before the other ranks start (an error raised here is
    answered at once, and no rank waits in a collective for it), its seed fixed."""
    from ..cli.commands.run_options import check_output_files  # lazy: the CLI's checks, in the worker only

    given = {**options, **({"audio_out": audio_out} if audio_out else {})}
    handle.adapter.check_run(handle.variant, given, Path(out))
    check_output_files(out, audio_out, overwrite=False)
    if "seed" in handle.adapter.run_options and options.get("seed") is None:  # as distributed.broadcast_seed draws it
        options = {**options, "seed": int(torch.randint(0, 2**31 - 1, ()).item())}
    return options


def lead(conn, handle, control) -> bool:
    """Rank 0: jobs from the server's pipe, broadcast to the group, answered on the pipe.
    False when the group broke (the process then exits and the server restarts the group)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server is gone
            msg = ("stop",)
        if msg[0] == "stop":
            tell_stop(control)
            return True
        if msg[0] != "job":  # a cancel that came after its job ended
            continue
        _, job_id, prompt, options, out, audio_out = msg
        inbox = Inbox(conn, job_id)
        try:
            options = checked(handle, options, out, audio_out)
        except Exception as e:
            conn.send(("failed", job_id, error_text(e), False))
            continue
        t = time.perf_counter()
        try:
            dist.broadcast_object_list([("job", prompt, options, out, audio_out)], src=0, group=control)
        except Exception as e:  # a rank is gone (it died idle): nothing ran, the server retries on a fresh group
            conn.send(("failed", job_id, f"the group could not start the job ({error_text(e)})", False, True))
            return False
        report = lambda done, total: conn.send(("progress", job_id, done, total))  # noqa: E731
        info, outcomes = run_rank(handle, control, prompt, options, out, audio_out, report=report,
                                  cancelled=inbox.cancelled, write=True)
        if outcomes is None:
            conn.send(("failed", job_id, f"the group's other ranks did not answer within {AGREE_TIMEOUT_S:.0f} s "
                       "(one is stuck in a collective, or gone)", False, True))
            return False
        code, message = verdict(outcomes)
        if code == OK:
            info.update(run_s=time.perf_counter() - t, compile=compile_info(handle))
            conn.send(("done", job_id, info))
        else:
            conn.send(("failed", job_id, message, code == CANCELLED))
        if inbox.stop:
            tell_stop(control)
            return True


def tell_stop(control) -> None:
    """The followers stop (a follower already gone needs no telling)."""
    try:
        dist.broadcast_object_list([("stop",)], src=0, group=control)
    except Exception:  # a peer's closed connection: the server stops what is left
        pass


def follow(handle, control) -> bool:
    """A rank other than 0: run what rank 0 broadcasts, until it says stop. False when the
    group broke."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0][0] == "stop":
            return True
        _, prompt, options, out, audio_out = box[0]
        _, outcomes = run_rank(handle, control, prompt, options, out, audio_out)
        if outcomes is None:
            return False


def warm_up(handle, control) -> None:
    """One call at the defaults on every rank (seed 0: one initial noise for the group)."""
    options = {"seed": 0} if "seed" in handle.adapter.run_options else {}
    _, outcomes = run_rank(handle, control, "warm up", options, None, None)
    code, message = verdict(outcomes) if outcomes is not None else (FAILED, "a rank did not answer")
    if code != OK:
        raise RuntimeError(f"the warm-up failed: {message}")


def main(conn, spec: WorkerSpec) -> None:
    """One rank's life: join the group, load, (warm up), then lead (rank 0) or follow."""
    rank, world = spec.rank, len(spec.group)
    t0 = time.perf_counter()
    try:
        distributed.init("cpu" if spec.group[0] is None else "cuda")
        control = dist.new_group(backend="gloo", timeout=IDLE)
        handle = zoo.load(spec.model, **spec.load)
        if spec.warmup:
            warm_up(handle, control)
        dist.barrier(group=control)  # every rank has loaded: the group is ready
    except Exception as e:
        if rank == 0:  # the server reports it and does not restart a group that cannot load
            conn.send(("load_failed", error_text(e)))
            return
        print(f"magi-zoo serve: error: [rank {rank}/{world}] {spec.model}: {error_text(e)}", file=sys.stderr,
              flush=True)
        sys.exit(1)  # the server sees the rank end and stops the group
    if rank == 0:
        conn.send(("ready", ready_info(handle, t0)))
        ok = lead(conn, handle, control)
    else:
        try:
            with distributed.quiet_unless_rank0():  # progress bars and notices are rank 0's to give
                ok = follow(handle, control)
        except Exception as e:  # rank 0 is gone: the server restarts the group
            print(f"magi-zoo serve: error: [rank {rank}/{world}] {spec.model}: {error_text(e)}", file=sys.stderr,
                  flush=True)
            ok = False
    if not ok:  # the group broke: the server stops what is left of it and starts it afresh
        sys.exit(1)
    distributed.shutdown()
