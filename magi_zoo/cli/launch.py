"""`magi-zoo run --nproc N`: re-run the same command in N processes under torchrun.

Why torchrun (``python -m torch.distributed.run``) rather than our own spawner: it sets
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR, and its agent watches every worker -- when one
exits with an error it terminates the others and prints which rank failed first, so a dead
rank never leaves the rest hanging in a collective. The ranks themselves start their process
group with `magi_zoo.distributed.init`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Sequence

CLI_MODULE = "magi_zoo.cli"  # what each rank runs: `python -m magi_zoo.cli <argv>`


def torchrun_command(nproc: int, argv: Sequence[str], module: str = CLI_MODULE) -> list[str]:
    """The command that runs ``python -m <module> <argv>`` in `nproc` processes on this machine
    (torchrun's --standalone: a local rendezvous on a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *argv]


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Re-run this CLI command under torchrun with `nproc` processes; returns its exit status.
    torchrun prints one banner per job; our ranks print only rank 0's output and rank-tagged
    errors."""
    env = dict(os.environ)
    # The children read the process count from WORLD_SIZE. --nproc itself must go: torchrun's
    # own parser takes it for an abbreviation of its --nproc-per-node even after the module.
    argv = without_option(list(argv), "--nproc")
    # torchrun otherwise prints a banner about OMP_NUM_THREADS=1 in every job: set it as it
    # would (one thread per process avoids oversubscription), unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    debug = "--debug" in argv
    try:
        proc = subprocess.Popen(torchrun_command(nproc, argv), env=env, stderr=None if debug else subprocess.PIPE,
                                text=True, bufsize=1)
        if not debug:
            relay_stderr(proc.stderr)
        proc.wait()
    except KeyboardInterrupt:
        return 130
    if proc.returncode:
        # torchrun has stopped the other ranks and printed its summary (which rank failed first);
        # the failing rank printed its own one-line, rank-tagged error before that.
        print(f"magi-zoo: error: the {nproc}-process run failed (torchrun exit status {proc.returncode}); the "
              "rank-tagged 'magi-zoo: error: [rank R/N]' line above says why", file=sys.stderr)
        return 2
    return 0


_AGENT_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")  # torchrun's agent (glog format)


def relay_stderr(stream) -> None:
    """Pass the job's stderr through, minus torchrun's own agent log lines and the Python
    traceback of its ChildFailedError (torchrun's, not ours: the rank's own error line and
    torchrun's failure summary, which names the first failing rank, are kept). `--debug`
    relays everything."""
    held: list[str] = []
    for line in stream:
        if held:
            held.append(line)
            if line[:1] not in (" ", "\t") and not line.startswith("Traceback"):
                if not line.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"):
                    sys.stderr.writelines(held)
                held = []
            continue
        if line.startswith("Traceback (most recent call last):"):
            held = [line]
        elif not _AGENT_LOG.match(line):
            sys.stderr.write(line)
    sys.stderr.writelines(held)
    sys.stderr.flush()


def without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without option `name` and its value (``--name V`` or ``--name=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out
