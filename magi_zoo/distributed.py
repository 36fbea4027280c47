"""Multi-process plumbing over `torch.distributed` (library code): start the process group
from `torchrun`'s environment, keep non-zero ranks quiet, check that every rank runs the same
configuration, and build the device mesh the parallel step uses. Re-running a command under
torchrun is the CLI's (`magi_zoo.cli.launch`).

Importing it starts nothing: every function is a no-op (or answers for one process) unless
the job has more than one.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import sys
import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

# How long a collective may wait for a rank before the job fails (init_process_group's
# timeout). A peer that died is normally noticed sooner -- torchrun tears the job down when
# any worker exits -- this bounds the case where a rank is alive but stuck. First calls
# compile (15-20 s for Wan-14B's blocks on an H100), so the bound is generous.
DEFAULT_TIMEOUT_S = 600
TIMEOUT_ENV = "MAGI_ZOO_DIST_TIMEOUT"


def env_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 outside a torchrun job)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_launched() -> bool:
    """True inside a process started by torchrun (or any launcher that sets WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def rank() -> int:
    """This process's rank (0 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Processes in the job (1 without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return env_world_size()


def rank_tag() -> str:
    """'[rank R/W] ' in a multi-process job, '' otherwise (prefix for error lines)."""
    w = world_size()
    return f"[rank {rank()}/{w}] " if w > 1 else ""


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected seconds (a positive number)") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def init(device_type: str | None = None) -> bool:
    """Start the default process group from torchrun's environment (once); returns whether
    this is a multi-process job. NCCL on CUDA (and the process's GPU set to LOCAL_RANK, so
    ``device="cuda"`` means this rank's card), gloo on CPU. A no-op outside torchrun."""
    dist = torch.distributed
    if dist.is_initialized():
        return dist.get_world_size() > 1
    if not is_launched() or env_world_size() <= 1:
        return False
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        n = torch.cuda.device_count()
        if local >= n:
            raise RuntimeError(f"local rank {local} has no GPU: this machine has {n}; launch at most "
                               f"{n} processes per node (--nproc {n})")
        torch.cuda.set_device(local)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s()))
    return True


def shutdown() -> None:
    """Destroy the process group (what a clean exit does; NCCL warns otherwise)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def digest(obj: Any) -> str:
    """A stable short hash of JSON-able data (non-JSON leaves by their str)."""
    blob = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_same(obj: Any, what: str) -> None:
    """Raise on every rank when the ranks disagree about `obj` (all-gather of its digest):
    a job whose ranks were given different models, plans or arguments would otherwise run
    mismatched collectives and hang or produce garbage. A no-op in one process."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = digest(obj)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        groups: dict[str, list[int]] = {}
        for r, d in enumerate(everyone):
            groups.setdefault(d, []).append(r)
        listing = "; ".join(f"ranks {rs}: {d}" for d, rs in groups.items())
        raise ValueError(f"the ranks were started with different {what} ({listing}); every rank must get the "
                         "same command line, spec and environment (launch with magi-zoo run --nproc N, or "
                         "torchrun with one command)")


def broadcast_seed(seed: int | None) -> int:
    """The seed every rank uses: the one given, else one rank 0 draws and sends (so the
    initial noise is the same on every rank -- each rank computes part of one sample)."""
    if seed is not None:
        return int(seed)
    box = [int(torch.randint(0, 2**31 - 1, ()).item())]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def quiet_unless_rank0():
    """On ranks other than 0: stdout to /dev/null, Python warnings and library logging off.
    Errors still reach stderr (the CLI tags them with the rank). A no-op on rank 0."""
    if rank() == 0:
        yield
        return
    devnull = open(os.devnull, "w")
    old_stdout, old_disable = sys.stdout, logging.root.manager.disable
    try:
        sys.stdout = devnull
        logging.disable(logging.WARNING)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdout = old_stdout
        logging.disable(old_disable)
        devnull.close()


# -- device mesh ------------------------------------------------------------------------------
_MESHES: dict[tuple, Any] = {}


def device_mesh(cfg: int, ring: int, ulysses: int):
    """The job's mesh ``(replica, cfg, ring, ulysses)`` (cached: one set of process groups per
    shape). Diffusers' context parallelism reads its ``ring`` and ``ulysses`` dimensions;
    the ``cfg`` dimension pairs the ranks that run the two guidance branches; ``replica``
    holds copies when the world is larger than the degrees (they compute the same)."""
    w = world_size()
    replica = w // (cfg * ring * ulysses)
    key = (replica, cfg, ring, ulysses)
    if key not in _MESHES:
        device_type = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"
        _MESHES[key] = init_device_mesh(device_type, key, mesh_dim_names=("replica", "cfg", "ring", "ulysses"))
    return _MESHES[key]
