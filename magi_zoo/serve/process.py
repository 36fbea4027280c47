"""The entry point of every worker process the server starts (`spawn`): the signals, the
cards it sees and torchrun's environment for a group's rank are set before anything imports
torch; then a single worker (`worker.serve`) or one rank of a group (`group.main`) runs."""

from __future__ import annotations

import os
import signal
import sys

from .worker import WorkerSpec, group_environment, serve


def main(conn, spec: WorkerSpec) -> None:
    """A worker process's life (the pool's `spawn` target): signals and card first, then a single
    worker's `serve`, or one rank of a group (`group.main`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    # SIGTERM (the server stopping a busy worker) unwinds: a write in progress removes its temporary
    # file, locks are released; exit status 128 + 15 as a shell reports it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if spec.device_index is not None:  # before torch is imported: this worker sees its own card only
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.device_index)
    if spec.group:  # before torch is imported: the group's cards only
        os.environ.update(group_environment(spec))
        # one CPU thread per rank unless the user chose, as torchrun sets it: N ranks of one host
        # each running a thread per core would oversubscribe the cores N times
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        # every update drawn on every rank, whatever the user's setting: the ranks meet at each bar
        # position (group.StepSync), so which updates are drawn must not depend on each rank's clock
        os.environ["TQDM_MININTERVAL"] = "0"
    os.environ.setdefault("TQDM_MININTERVAL", "0")  # every step's update is drawn: progress per step
    if spec.group:
        from .group import main as rank_main  # lazy: imports torch, after the environment is set

        rank_main(conn, spec)
    else:
        serve(conn, spec)
