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

from .console import CLOSED_PIPE_STATUS, quiet_closed_output, reader_gone

CLI_MODULE = "magi_zoo.cli"  # what each rank runs: `python -m magi_zoo.cli <argv>`


def torchrun_command(nproc: int, argv: Sequence[str], module: str = CLI_MODULE) -> list[str]:
    """The command that runs ``python -m <module> <argv>`` in `nproc` processes on this machine
    (torchrun's --standalone: a local rendezvous on a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *argv]


def launch(nproc: int, argv: Sequence[str]) -> int:
    """Re-run this CLI command under torchrun with `nproc` processes; returns its exit status.
    torchrun prints one banner per job; our ranks print only rank 0's output, and each
    distinct error once (`relay_stderr`)."""
    env = dict(os.environ)
    # The children read the process count from WORLD_SIZE. --nproc itself must go: torchrun's
    # own parser takes it for an abbreviation of its --nproc-per-node even after the module.
    argv = without_option(list(argv), "--nproc")
    # torchrun otherwise prints a banner about OMP_NUM_THREADS=1 in every job: set it as it
    # would (one thread per process avoids oversubscription), unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    debug = "--debug" in argv
    said_why = False
    try:
        proc = subprocess.Popen(torchrun_command(nproc, argv), env=env, stderr=None if debug else subprocess.PIPE,
                                text=True, bufsize=1)
        if not debug:
            said_why = relay_stderr(proc.stderr)
        proc.wait()
    except KeyboardInterrupt:
        return 130
    if proc.returncode:
        if reader_gone():  # rank 0's reader closed its output (`| head`): quiet, as in one process
            quiet_closed_output()
            return CLOSED_PIPE_STATUS
        if not said_why:  # no rank printed its error (killed, crashed): torchrun's summary names it
            print(f"magi-zoo: error: the {nproc}-process run failed (torchrun exit status {proc.returncode}); "
                  "torchrun's summary above names the rank that failed first", file=sys.stderr)
        return 2
    return 0


_AGENT_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")  # torchrun's agent (glog format)
_RANK_ERROR = re.compile(r"^magi-zoo: error: \[rank (\d+)/(\d+)\] (.*)$")  # console.print_error's line
_CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
_SUMMARY_ENTRY = re.compile(r"^\s*rank\s*: (\d+) .*?^\s*exitcode\s*: (-?\d+)", re.M | re.S)
_TERMINATED = -15  # SIGTERM: torchrun stopping the other ranks after the first failure


def relay_stderr(stream) -> bool:
    """Pass the job's stderr through, minus torchrun's own agent log lines and the Python
    traceback of its ChildFailedError (torchrun's, not ours). `--debug` relays everything.

    One failure, one error: the ranks' `magi-zoo: error: [rank R/N] ...` lines are held to
    the end and printed once per distinct message, naming every rank that gave it (all ranks
    fail alike when they run the same check). torchrun's failure summary follows only when
    some rank's failure is not explained by such a line (a crash, a kill). Returns whether a
    rank printed its error."""
    held: list[str] = []
    errors: dict[str, list[int]] = {}  # message -> the ranks that printed it, in order
    world = 0
    summary: list[str] | None = None  # torchrun's failure summary, after its ChildFailedError line
    for line in stream:
        if summary is not None:
            summary.append(line)
            continue
        if held:
            held.append(line)
            if line[:1] not in (" ", "\t") and not line.startswith("Traceback"):
                if line.startswith(_CHILD_FAILED):
                    summary = []
                else:
                    sys.stderr.writelines(held)
                held = []
            continue
        m = _RANK_ERROR.match(line.rstrip("\n"))
        if m:
            errors.setdefault(m.group(3), []).append(int(m.group(1)))
            world = int(m.group(2))
        elif line.startswith("Traceback (most recent call last):"):
            held = [line]
        elif not _AGENT_LOG.match(line):
            sys.stderr.write(line)
    sys.stderr.writelines(held)
    for message, ranks in errors.items():
        ranks = sorted(set(ranks))
        tag = f"rank {ranks[0]}/{world}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} of {world}"
        sys.stderr.write(f"magi-zoo: error: [{tag}] {message}\n")
    if summary and _unexplained(''.join(summary), {r for rs in errors.values() for r in rs}):
        sys.stderr.writelines(summary)
    sys.stderr.flush()
    return bool(errors)


def _unexplained(summary: str, said: set[int]) -> bool:
    """Whether torchrun's failure summary lists a rank that failed without its own error
    line (exit status 2 is the CLI's error exit; SIGTERM is torchrun stopping the rest)."""
    entries = [(int(r), int(code)) for r, code in _SUMMARY_ENTRY.findall(summary)]
    return not entries or any(code != _TERMINATED and not (code == 2 and r in said) for r, code in entries)


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
