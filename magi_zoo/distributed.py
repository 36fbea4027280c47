"""Multi-process plumbing over `torch.distributed`: start the process group from `torchrun`'s
environment, re-launch the CLI under `torchrun`, keep non-zero ranks quiet, check that every
rank runs the same configuration, and build the device mesh the parallel step uses.

Nothing here runs unless a job has more than one process; `import magi_zoo` never imports
this module. Why torchrun (``python -m torch.distributed.run``) rather than our own
spawner: it sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR, and its agent watches every
worker -- when one exits with an error it terminates the others and prints which rank
failed first, so a dead rank never leaves the rest hanging in a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from typing import Any, Sequence

import torch

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


def torchrun_command(nproc: int, argv: Sequence[str], module: str = "magi_zoo.cli") -> list[str]:
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
    argv = _without_option(list(argv), "--nproc")
    # torchrun otherwise prints a banner about OMP_NUM_THREADS=1 in every job: set it as it
    # would (one thread per process avoids oversubscription), unless the user chose.
    env.setdefault("OMP_NUM_THREADS", "1")
    debug = "--debug" in argv
    try:
        proc = subprocess.Popen(torchrun_command(nproc, argv), env=env, stderr=None if debug else subprocess.PIPE,
                                text=True, bufsize=1)
        if not debug:
            _relay_stderr(proc.stderr)
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


def _relay_stderr(stream) -> None:
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


def _without_option(argv: list[str], name: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


# -- device mesh ------------------------------------------------------------------------------
_MESHES: dict[tuple, Any] = {}


def device_mesh(cfg: int, ring: int, ulysses: int):
    """The job's mesh ``(replica, cfg, ring, ulysses)`` (cached: one set of process groups per
    shape). Diffusers' context parallelism reads its ``ring`` and ``ulysses`` dimensions;
    the ``cfg`` dimension pairs the ranks that run the two guidance branches; ``replica``
    holds copies when the world is larger than the degrees (they compute the same)."""
    from torch.distributed.device_mesh import init_device_mesh

    w = world_size()
    replica = w // (cfg * ring * ulysses)
    key = (replica, cfg, ring, ulysses)
    if key not in _MESHES:
        device_type = "cuda" if torch.cuda.is_available() and torch.distributed.get_backend() == "nccl" else "cpu"
        _MESHES[key] = init_device_mesh(device_type, key, mesh_dim_names=("replica", "cfg", "ring", "ulysses"))
    return _MESHES[key]


# -- `magi-zoo run --nproc N` -------------------------------------------------------------------
def run_parallel_fields(nproc: int | None, *, ulysses: int | None, ring: int | None, cfg: bool | None,
                        uneven: bool, runs_cfg: bool) -> dict[str, Any] | None:
    """The parallel-section fields for a `run` command (None: not a parallel run).

    `nproc` is the process count asked for (--nproc; inside a torchrun job, WORLD_SIZE).
    Degrees not given are chosen by `default_parallel`; the product is checked against the
    process count here, before anything is built or launched."""
    from .specs.parallel_spec import ParallelSpec, default_parallel

    given = {k: v for k, v in dict(ulysses_degree=ulysses, ring_degree=ring, cfg=cfg).items() if v is not None}
    if uneven:
        given["uneven"] = True
    n = nproc or 1
    if n == 1 and not any(v not in (None, False, 1) for v in given.values()):
        return None
    if n == 1:
        raise ValueError("--ulysses / --ring / --cfg-parallel split the model over processes: add --nproc N "
                         "(or launch with torchrun)")
    if not {"ulysses_degree", "ring_degree", "cfg"} & set(given):
        given = {**default_parallel(n, runs_cfg), **given}
        if given.get("cfg") and not runs_cfg:  # pragma: no cover - default_parallel never does this
            given.pop("cfg")
    if given.get("cfg") and not runs_cfg:
        raise ValueError("--cfg-parallel splits classifier-free guidance, which this model's run does not use; "
                         "use --ulysses / --ring instead")
    try:
        spec = ParallelSpec(**given)
    except Exception as e:  # pydantic: names the field
        from .specs.section import flat_error

        raise ValueError(f"parallel options: {flat_error(e)}") from None
    spec.check_world(n, where="--nproc")
    return spec.model_dump(exclude_defaults=True)


def parallel_overrides(spec_path: str, fields: dict[str, Any], eager: bool = False) -> dict[str, Any]:
    """A user layer {"parallel": {key: fields}} for every region the spec file declares in a
    [*.parallel] table (what `with_parallel` does to layers); `eager` adds
    {"compile": {key: {method: {"enabled": False}}}} for every compile key (run --no-compile)."""
    from .specs.parallel_spec import with_parallel
    from .specs.plan import SpecFile

    spec = SpecFile.from_toml(spec_path)
    layers = [("model default", spec.default), *(("gpu", layer) for layer in spec.gpu.values())]
    out = with_parallel(layers, fields)[-1][1].to_dict()
    if eager:
        off: dict[str, dict] = {}
        for _, layer in layers:
            for key, method, _ in layer.items("compile"):
                off.setdefault(key, {})[method] = {"enabled": False}
        out["compile"] = off
    return out
