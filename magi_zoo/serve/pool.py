"""The server's side of the workers: a bounded queue per model and one dispatcher per worker.

Each dispatcher owns one worker process (`process.main`, started with `spawn`): it waits for
the worker to load, takes the next job off its model's queue, sends it, relays progress,
and ends the job with the worker's answer. A worker that dies mid-job (killed, out of
memory, a crash in a kernel) ends that job as failed with a message saying so, and the
dispatcher starts a fresh worker while the server keeps answering. A worker that cannot
load is not restarted: its model reports the error on `/health` and refuses jobs.

A worker may be a group of N processes (`--nproc N`, `group.py`): the dispatcher talks to
rank 0 and watches every rank's process. A rank that dies ends the running job as failed,
naming the rank and the signal, and the whole group is stopped and started afresh; a
shutdown stops every rank.

The queue is bounded: `submit` raises `QueueFull` at `max_queue` waiting jobs, which the app
answers with 429. `shutdown` fails every waiting job, lets the running ones finish within a
grace period, then stops the workers and fails what is still running -- explicitly, so no
client waits on a job that will never end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import signal
import socket
import time
from pathlib import Path
from typing import Any

from .jobs import Job
from .metrics import Metrics
from .process import main as worker_main
from .worker import WorkerSpec


class QueueFull(Exception):
    """The model's queue holds `max_queue` jobs already."""


class BrokenGroup(Exception):
    """Rank 0 of a group said its ranks no longer agree (the group is restarted)."""


def death_message(exitcode: int | None) -> str:
    """Why a worker ended, in words (a negative exit code is the signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exited with status {exitcode}"


class RankDied(EOFError):
    """A rank of a group other than 0 ended (rank 0's death closes the pipe: a plain EOFError)."""

    def __init__(self, rank: int):
        super().__init__(f"rank {rank} ended")
        self.rank = rank


def free_port() -> int:
    """A free TCP port on loopback (a group's rendezvous; rank 0 listens on it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One worker: a process and the pipe to it, or a group's N processes (`spec.group`;
    `group.py`), the pipe to rank 0 and the others' sentinels (a rank's death is seen at once)."""

    def __init__(self, spec: WorkerSpec):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        port = free_port() if spec.group else None
        self.processes = []
        for rank in range(max(1, len(spec.group))):
            one = dataclasses.replace(spec, rank=rank, port=port)
            name = f"magi-zoo-serve-worker[{spec.model}]" + (f"[rank {rank}]" if spec.group else "")
            p = ctx.Process(target=worker_main, args=(child if rank == 0 else None, one), daemon=True, name=name)
            p.start()
            self.processes.append(p)
        self.process = self.processes[0]
        child.close()  # only rank 0 holds its end: its death closes the pipe (EOFError here)

    async def recv(self) -> tuple:
        """Rank 0's next message; EOFError once it is gone, RankDied once another rank is."""
        return await asyncio.get_running_loop().run_in_executor(None, self.recv_now)

    def recv_now(self) -> tuple:
        followers = {p.sentinel: rank for rank, p in enumerate(self.processes) if rank}
        ready = mp_connection.wait([self.conn, *followers])
        dead = sorted(followers[s] for s in ready if s in followers)
        if dead:  # before any message: a job a rank died in has failed, whatever rank 0 says next
            raise RankDied(dead[0])
        return self.conn.recv()

    def death(self, wait: float = 5.0, ignore: tuple[int, ...] = ()) -> str | None:
        """Which process ended and how ("rank 1 of the 2-process group (pid P) ended: killed by
        SIGKILL"), waiting up to `wait` seconds for one to end; None when all are alive. Ranks in
        `ignore` are not asked (rank 0 leaving after it reported a broken group)."""
        deadline = time.monotonic() + wait
        while True:
            ended = [(rank, p) for rank, p in enumerate(self.processes) if rank not in ignore and p.exitcode is not None]
            if ended:  # the cause before its consequences: a rank killed by a signal, then a follower, then rank 0
                rank, p = min(ended, key=lambda rp: (rp[1].exitcode >= 0, rp[0] == 0, rp[0]))
                if len(self.processes) == 1:
                    return death_message(p.exitcode)
                return f"rank {rank} of the {len(self.processes)}-process group (pid {p.pid}) ended: " \
                       f"{death_message(p.exitcode)}"
            if time.monotonic() >= deadline:
                return None
            asked = [p.sentinel for rank, p in enumerate(self.processes) if rank not in ignore]
            mp_connection.wait(asked, timeout=max(0.0, deadline - time.monotonic()))

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def ask_stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except (OSError, ValueError):
            pass

    def terminate(self) -> None:
        for p in self.processes:
            p.terminate()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask it to stop, then make sure: terminate, then kill (every rank of a group)."""
        self.ask_stop()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout)
        for p in self.processes:
            if p.is_alive():  # pragma: no cover - a worker stuck in a kernel
                p.kill()
                p.join(timeout)
        self.conn.close()


class ModelPool:
    """A model's queue and its workers: one per entry of `groups`, each a tuple of the devices
    its processes own (one device: a single worker; N: a group of N ranks, `--nproc N`;
    None: the CPU)."""

    def __init__(self, model: str, load: dict[str, Any], groups: list[tuple[int | None, ...]], *, out_dir: Path,
                 max_queue: int, metrics: Metrics, warmup: bool = False):
        self.model, self.load, self.groups, self.out_dir = model, load, groups, out_dir
        self.queue: asyncio.Queue[Job] = asyncio.Queue(maxsize=max_queue)
        self.metrics = metrics
        self.warmup = warmup
        self.workers: dict[int, Worker] = {}
        self.running: dict[int, Job] = {}
        self.ready: set[int] = set()
        self.pids: dict[int, list[int]] = {}  # slot -> the ready worker's pids (a group's: rank 0 first)
        self.load_error: str | None = None
        self.restarts = 0
        self.stopping = False
        self.tasks: list[asyncio.Task] = []

    # -- what the app calls ---------------------------------------------------------------
    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.dispatch(slot)) for slot in range(len(self.groups))]

    def submit(self, job: Job) -> Job:
        if self.load_error is not None:
            raise RuntimeError(f"{self.model} could not be loaded: {self.load_error}")
        if self.stopping:
            raise RuntimeError("the server is shutting down")
        try:
            self.queue.put_nowait(job)
        except asyncio.QueueFull:
            raise QueueFull(f"{self.model}: {self.queue.maxsize} jobs are waiting already; retry later") from None
        self.metrics.queued(self.model, self.queue.qsize())
        return job

    def cancel(self, job: Job) -> None:
        """A waiting job ends now; a running one at its next step (the worker raises there)."""
        job.cancel_requested = True
        if job.status == "queued":
            self.end(job, "cancelled", error="cancelled before it started", code="cancelled")
            return
        for slot, running in self.running.items():
            if running is job and slot in self.workers:
                try:
                    self.workers[slot].conn.send(("cancel", job.id))
                except OSError:  # the worker is gone: its dispatcher ends the job
                    pass

    def health(self) -> dict[str, Any]:
        return {"model": self.model, "workers": len(self.groups), "nproc": len(self.groups[0]),
                "ready": len(self.ready), "queued": self.queue.qsize(), "in_flight": len(self.running),
                "restarts": self.restarts, "pids": [self.pids[s][0] for s in sorted(self.pids)],
                "group_pids": [self.pids[s] for s in sorted(self.pids)], "error": self.load_error}

    # -- one dispatcher per worker ----------------------------------------------------------
    async def dispatch(self, slot: int) -> None:
        while not self.stopping:
            if slot not in self.workers:
                if not await self.start_worker(slot):
                    return
            job = await self.queue.get()
            self.metrics.queued(self.model, self.queue.qsize())
            if job.ended or self.stopping:  # cancelled while it waited, or the server is stopping
                if not job.ended:
                    self.end(job, "failed", error="the server shut down before the job started", code="shutdown")
                continue
            while await self.run(slot, job) == "retry":  # its worker had died before it began: a fresh one
                if not await self.start_worker(slot):
                    self.end(job, "failed", error=f"{self.model} could not be loaded: {self.load_error}",
                             code="load_failed")
                    return

    async def start_worker(self, slot: int, tries: int = 2) -> bool:
        group = self.groups[slot]
        spec = WorkerSpec(self.model, self.load, group[0] if len(group) == 1 else None, warmup=self.warmup,
                          group=group if len(group) > 1 else ())
        worker = self.workers[slot] = Worker(spec)
        try:
            msg = await worker.recv()
        except (EOFError, OSError) as e:
            msg = None
            if isinstance(e, RankDied) and worker.conn.poll(2):  # rank 0's own error says more than a rank's exit
                msg = worker.conn.recv()
            if msg is None or msg[0] != "load_failed":
                msg = ("load_failed", f"{'the worker ' if len(worker.processes) == 1 else ''}"
                       f"{worker.death() or 'a worker process ended'} while loading"
                       + (" (its error is in the server's log)" if isinstance(e, RankDied) else ""))
        if msg[0] != "ready" and spec.group and tries > 1 and "address already in use" in msg[1].lower():
            # the free port a group's rendezvous was given went to another process in between: a new one
            worker.stop()
            del self.workers[slot]
            return await self.start_worker(slot, tries - 1)
        if msg[0] != "ready":
            self.load_error = msg[1]
            worker.stop()
            del self.workers[slot]
            self.fail_waiting(f"{self.model} could not be loaded: {msg[1]}", code="load_failed")
            return False
        self.ready.add(slot)
        self.pids[slot] = worker.pids()
        self.metrics.loaded(self.model, slot, msg[1])
        return True

    async def run(self, slot: int, job: Job) -> str | None:
        """Run `job` on the slot's worker; "retry" when the worker was found dead before the job
        reported any progress (it died idle, or at the job's very start), once per job."""
        worker = self.workers[slot]
        began = False
        self.running[slot] = job
        self.metrics.in_flight(self.model, len(self.running))
        job.start()
        self.metrics.phase(self.model, "queue", job.started - job.created)
        files = {"content": self.out_dir / f"{job.id}{SUFFIX[job.kind]}"}
        if job.audio:
            files["audio"] = self.out_dir / f"{job.id}.wav"
        try:
            worker.conn.send(("job", job.id, job.prompt, job.options, str(files["content"]),
                              str(files["audio"]) if job.audio else None))
            while True:
                msg = await worker.recv()
                if msg[0] == "progress":
                    began = True
                    job.done_steps, job.total_steps = msg[2], msg[3]
                elif msg[0] == "done":
                    self.metrics.phase(self.model, "run", msg[2]["run_s"])
                    self.metrics.compile(self.model, slot, msg[2]["compile"])
                    self.end(job, "completed", files=files)
                    break
                elif msg[0] == "failed" and len(msg) > 4 and msg[4]:  # a group that broke: restarted below
                    raise BrokenGroup(msg[2])
                elif msg[0] == "failed":
                    cancelled = msg[3]
                    self.end(job, "cancelled" if cancelled else "failed", error=msg[2],
                             code="cancelled" if cancelled else "generation_failed")
                    break
        except (EOFError, OSError, BrokenPipeError, BrokenGroup) as e:
            # a dead rank explains a broken group best (its peers only saw a closed connection)
            why = worker.death(wait=1.0, ignore=(0,)) if isinstance(e, BrokenGroup) else worker.death()
            if why is None and len(worker.processes) == 1:
                why = death_message(worker.process.exitcode)
            self.forget(slot)
            if self.stopping:
                return None
            self.restarts += 1
            self.metrics.restarted(self.model)
            if not began and not job.retried:
                job.retried = True
                return "retry"
            if why is None:  # every rank alive, but they no longer agree
                self.end(job, "failed", code="worker_died",
                         error=f"the {len(worker.processes)}-process group failed this job: {e}; the group is being "
                               "restarted, submit the job again")
            elif len(worker.processes) == 1:
                self.end(job, "failed", code="worker_died",
                         error=f"the worker process {why} while running this job; it is being restarted, "
                               "submit the job again")
            else:
                self.end(job, "failed", code="worker_died",
                         error=f"{why}, while running this job; the group is being restarted, submit the job again")
        finally:
            self.running.pop(slot, None)
            self.metrics.in_flight(self.model, len(self.running))
        return None

    def forget(self, slot: int) -> None:
        """The slot's worker is gone (or going): reap it and count it as restarting."""
        worker = self.workers.pop(slot, None)
        if worker is not None:
            worker.stop(timeout=1)
        self.ready.discard(slot)
        self.pids.pop(slot, None)

    def end(self, job: Job, status: str, **kw) -> None:
        if job.finish(status, **kw):
            self.metrics.ended(self.model, status)
            if status != "completed":  # nothing half-made is left behind (writes are atomic, but be sure)
                for suffix in (SUFFIX[job.kind], ".wav"):
                    (self.out_dir / f"{job.id}{suffix}").unlink(missing_ok=True)

    def fail_waiting(self, message: str, *, code: str) -> None:
        while not self.queue.empty():
            self.end(self.queue.get_nowait(), "failed", error=message, code=code)
        self.metrics.queued(self.model, 0)

    async def shutdown(self, grace: float) -> None:
        """Fail what waits, give what runs `grace` seconds, then stop the workers and fail the rest."""
        self.stopping = True
        self.fail_waiting("the server shut down before the job started", code="shutdown")
        deadline = time.monotonic() + grace
        while self.running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        busy = set(self.running)
        for job in list(self.running.values()):
            self.end(job, "failed", error="the server shut down while the job ran", code="shutdown")
        for task in self.tasks:
            task.cancel()
        workers, self.workers = dict(self.workers), {}
        for slot, w in workers.items():  # all told first, so they wind down together
            if slot in busy:  # mid-job past the grace period: its job has failed, its work is not wanted
                w.terminate()
            else:
                w.ask_stop()
        workers = list(workers.values())
        await asyncio.get_running_loop().run_in_executor(None, lambda: [w.stop() for w in workers])


SUFFIX = {"image": ".png", "video": ".mp4", "text": ".txt"}
