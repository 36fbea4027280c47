"""`parallel_step`: spread a denoiser's forward over the processes of a `torchrun` job.

Runs after compile and offload, so everything it adds wraps the compiled regions from outside.
Per region of the plan's ``parallel`` section it installs sequence parallelism (`sequence`) and /
or CFG parallelism (`cfg`); every rank first checks that all ranks apply the same plan to the same
tree. It publishes the paths it wraps on the step context (`StepContext.parallel_split`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ... import distributed
from ...specs.parallel_spec import ParallelSpec
from ..steps import StepContext, StepRecord, chain_undo
from .cfg import cfg_parallel
from .sequence import backend_name, check_sequence_parallel, sequence_parallel


def _compiled_under(ctx: StepContext, path: str) -> list[str]:
    """Compile regions (enabled) at or under `path` in the plan just applied."""
    prefix = f"{path}." if path else ""
    return [r.name for r in ctx.regions if r.spec.enabled
            and any(m == path or m.startswith(prefix) for m in r.modules)]


def _check_device(model: nn.Module, key: str) -> None:
    """Each rank's weights on its own GPU (LOCAL_RANK): the usual mistake is loading before
    `distributed.init()` set the device, which puts every rank on cuda:0."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return
    mine = torch.cuda.current_device()
    if p.device.index != mine:
        raise ValueError(f"parallel {key!r}: this rank's weights are on cuda:{p.device.index} but its GPU is "
                         f"cuda:{mine}; call magi_zoo.distributed.init() (or torch.cuda.set_device(LOCAL_RANK)) "
                         "before loading the model")


def _job_fingerprint(ctx: StepContext) -> list:
    """What every rank must agree on: the resolved plan and the module tree's shape."""
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in ctx.root.named_parameters()]
    return [ctx.profile.name, ctx.plan.digests(), distributed.digest(params)]


def parallel_step(ctx: StepContext) -> StepRecord:
    dist = torch.distributed
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if multi:  # before anything else, on every rank: mismatched ranks all fail here, together
        distributed.check_same(_job_fingerprint(ctx), "models or plans")
    section = ctx.plan.section("parallel")
    regions = [(key, ts) for (key, _), ts in section.regions().items() if ts[0].spec.active]
    world = dist.get_world_size() if multi else 1
    if not regions:
        did = "none requested" + (f" ({world} processes: each runs the whole model)" if world > 1 else "")
        return StepRecord("parallel", did, None, {"world_size": world})
    specs = {ts[0].spec for _, ts in regions}
    if len(specs) > 1:
        raise ValueError("parallel: regions ask for different degrees "
                         f"({'; '.join(f'{k}: {ts[0].spec.describe()}' for k, ts in regions)}); one job has one "
                         "device mesh, so give every parallel region the same degrees")
    spec: ParallelSpec = specs.pop()
    if not multi:
        raise ValueError(f"parallel ({spec.describe()}) needs {spec.degree} processes under torch.distributed; launch "
                         f"with `magi-zoo run ... --nproc {spec.degree}` or `torchrun --nproc-per-node {spec.degree} "
                         "...` and call magi_zoo.distributed.init() before loading")
    replicas = spec.check_world(world)
    mesh = distributed.device_mesh(spec.cfg_degree, spec.ring_degree, spec.ulysses_degree)
    branch = mesh.get_local_rank("cfg")
    undos: list[Callable[[], None]] = []
    done = []
    try:
        for key, targets in regions:
            for t in targets:
                _check_device(t.module, key)
                if spec.sequence_degree > 1:
                    check_sequence_parallel(t.module, spec, key)
                if spec.uneven and _compiled_under(ctx, t.path):
                    # diffusers' uneven-shard attention exchanges the shard sizes with eager
                    # collectives (and splits all-to-alls by them) inside attention; dynamo cannot
                    # trace that (measured: the compiled block fails in a fake-tensor call).
                    raise ValueError(f"parallel {key!r}: uneven=true runs only in eager regions (its attention "
                                     f"exchanges shard sizes with collectives a compiled block cannot trace), and "
                                     f"{', '.join(_compiled_under(ctx, t.path)[:3])} is compiled; pick a shape whose "
                                     "token count divides by the degree, or fence the blocks off "
                                     "(compile {'<block class>': {'enabled': false}})")
            for t in targets:
                if spec.sequence_degree > 1:
                    undos.append(sequence_parallel(t.module, spec, mesh, key))
                if spec.cfg:
                    undos.append(cfg_parallel(t.module, mesh.get_group("cfg"), branch, key))
            where = targets[0].path if len(targets) == 1 else f"{len(targets)} x {targets[0].cls_name}"
            done.append(f"{key or '<root>'} ({where})")
    except BaseException:
        chain_undo(undos)()
        raise
    for _, targets in regions:  # for the steps after this one (cuda_graphs refuses to capture a split)
        for t in targets:
            ctx.parallel_split[t.path] = spec.describe()
    seq = []
    if spec.sequence_degree > 1:
        seq.append(f"attention backend {backend_name(regions[0][1][0].module)}; splits and gathers in hooks "
                   "outside the compiled blocks, all-to-alls inside them as functional collectives")
    if spec.cfg:
        seq.append(f"this rank runs the {'cond' if branch == 0 else 'uncond'} branch")
    did = (f"{spec.describe()} over {world} processes"
           + (f" ({replicas} replicas)" if replicas > 1 else "") + f" on {', '.join(done)}; "
           + "; ".join(seq))
    details = {"world_size": world, "rank": dist.get_rank(), "ulysses_degree": spec.ulysses_degree,
               "ring_degree": spec.ring_degree, "cfg": spec.cfg, "uneven": spec.uneven, "replicas": replicas,
               "mesh": dict(zip(mesh.mesh_dim_names, mesh.mesh.shape)),
               "undo": "exact: hooks removed by name, the processors' and the model's _parallel_config, instance "
                       "forwards, hook registries and attention-registry entries put back; the device mesh's process "
                       "groups stay (process-level, reused by the next apply)"}
    return StepRecord("parallel", did, chain_undo(undos), {k: (list(v) if isinstance(v, tuple) else v)
                                                            for k, v in details.items()})


def cfg_parallel_active(plan: Any) -> bool:
    """Whether a resolved plan (None = nothing applied) splits CFG over processes: a
    pipeline call must then run guidance, which its adapter checks before generating."""
    if plan is None:
        return False
    return any(t.spec.cfg for t in plan.section("parallel").targets)
