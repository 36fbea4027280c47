"""`magi-zoo serve MODEL [MODEL ...]`: the models loaded once per worker (one worker per GPU,
or per group of `--nproc` GPUs; on the CPU, one) behind an OpenAI-compatible HTTP API and a
web page (`magi_zoo.serve`).

Everything the command line says is checked before a worker starts, with `magi-zoo run`'s
own checks: the models exist, the compile overrides and the step cache are valid, the spec
file exists, the devices are there, `--nproc` divides them and each model's plan can be
split over that many processes."""

from __future__ import annotations

import os
from pathlib import Path

from typing import Any

from ... import adapters
from ...overrides import eager_compile, with_parallel
from ...specs import SpecFile, get_profile
from ...specs.parallel_spec import ParallelSpec
from ..console import say
from .run_options import parse_compile_overrides, run_parallel_fields, step_cache_override


def cmd_serve(args) -> int:
    try:
        import uvicorn  # lazy: an optional dependency (the serve extra)
    except ImportError:
        raise ImportError("magi-zoo serve needs the serve extra: pip install 'magi-zoo[serve]' "
                          "(FastAPI, uvicorn, python-multipart, prometheus-client)") from None
    from ...serve.app import create_app  # lazy: FastAPI and the serve extra, only for this command

    config = serve_config(args)
    app = create_app(config)
    if args.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        say(f"warning: listening on {args.host} without --api-key: anyone who reaches this port can use the GPUs")
    workers = len(config.groups())
    per = f"{workers} worker(s) of {config.nproc} processes" if config.nproc > 1 else f"{workers} worker(s)"
    say(f"serving {', '.join(config.models)} on http://{args.host}:{args.port} "
        f"({per} per model; web page at /, API under /v1)")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=max(1, int(args.grace)))
    return 0


def serve_config(args):
    """The command line, checked, as a `ServeConfig`."""
    from ...serve.app import ServeConfig, split_groups  # lazy: FastAPI, the serve extra

    for name in args.model:
        adapters.lookup(name)  # an unknown name: the registry's error, with the close matches
    if len(args.model) > 1 and (args.weights is not None or args.spec_file is not None):
        raise ValueError("--weights / --spec-file name one model's files; serve one model with them")
    if args.spec_file is not None and not Path(args.spec_file).is_file():
        raise ValueError(f"--spec-file {args.spec_file!r}: no such file")
    for flag, value, low in (("--port", args.port, 0), ("--max-queue", args.max_queue, 1),
                             ("--keep-jobs", args.keep_jobs, 1)):
        if value < low:
            raise ValueError(f"{flag} {value}: must be >= {low}")
    if args.max_body_mib <= 0 or args.grace < 0:
        raise ValueError("--max-body-mib must be > 0 and --grace >= 0")
    compile_overrides = parse_compile_overrides(args.compile_overrides)
    if compile_overrides is not None and not args.compile:
        raise ValueError("--compile and --no-compile contradict each other; pass one")
    overrides = {}
    for name in args.model:
        overrides = step_cache_override(args, adapters.lookup(name)[0]) or overrides
    profile = get_profile(args.gpu)
    load = dict(gpu=args.gpu, weights=args.weights, dtype=args.dtype,
                compile=compile_overrides if args.compile else False, overrides=overrides or None,
                precision="fp8" if args.fp8 else None, spec_file=args.spec_file, cache_dir=args.cache_dir,
                memory_budget_gib=args.memory_budget)
    nproc = getattr(args, "nproc", 1)
    cards = devices(args.devices, profile.device)
    split_groups(cards, nproc)  # --nproc that does not divide the cards: refused now
    model_load = {adapters.lookup(name)[1].name: group_load(name, nproc, args, profile, load["compile"])
                  for name in args.model} if nproc > 1 else {}
    return ServeConfig(models=list(args.model), load=load, devices=cards, nproc=nproc, model_load=model_load,
                       api_key=args.api_key or os.environ.get("MAGI_ZOO_API_KEY") or None,
                       max_queue=args.max_queue, max_body_bytes=int(args.max_body_mib * 2**20),
                       output_dir=Path(args.output_dir) if args.output_dir else None, keep_jobs=args.keep_jobs,
                       grace_s=args.grace, warmup=args.warmup,
                       gpu_memory_gib=profile.memory_gib if profile.device == "cuda" else None)


def group_load(name: str, nproc: int, args, profile, compile_arg) -> dict[str, Any]:
    """`load`'s arguments for one model served by groups of `nproc` processes: the plan's
    parallel degrees as `magi-zoo run --nproc N` picks them (CFG first where the call runs it,
    then Ulysses within the denoiser's heads, ring for the rest), checked before any worker
    starts; under --no-compile the plan still applies, every region eager."""
    adapter, variant = adapters.lookup(name)
    spec = SpecFile.from_toml(args.spec_file or adapter.spec_path())
    try:
        with_parallel(spec.layers_for(profile.name), {})
    except ValueError:
        raise ValueError(f"--nproc {nproc}: {name}'s spec declares no parallel region ({adapter.family} has no "
                         "context or CFG parallel plan here), so one copy cannot be spread over processes; serve it "
                         "without --nproc (one worker per GPU), or serve a model whose spec has one (Wan, Flux)") from None
    runs_cfg = getattr(adapter, "runs_cfg", lambda call, variant: False)(dict(adapter.call_defaults(variant)), variant)
    heads = variant.config.get("transformer", {}).get("num_attention_heads")
    fields = run_parallel_fields(nproc, ulysses=None, ring=None, cfg=None, uneven=False, runs_cfg=runs_cfg,
                                 heads=heads)
    split = ParallelSpec(**fields)
    if profile.device == "cpu" and split.sequence_degree > 1:
        raise ValueError(f"--nproc {nproc}: {name} would run {split.describe()}, and diffusers' context "
                         "parallelism (ulysses / ring) runs on GPUs; on the CPU only CFG parallel splits the work "
                         + ("(--nproc 2)" if runs_cfg else f"(and {name}'s call does not run CFG)")
                         + ": serve it on GPUs, or without --nproc")
    out: dict[str, Any] = {"parallel": fields}
    if compile_arg is False:  # the parallel split is part of the plan: it applies, every region eager
        out["compile"] = eager_compile(spec)
    return out


def devices(text: str | None, device: str) -> list[int | None]:
    """One worker per entry: the CUDA devices given (or every visible one), [None] on the CPU."""
    if device != "cuda":
        if text is not None:
            raise ValueError("--devices names CUDA devices; on the CPU (--gpu cpu) one worker runs")
        return [None]
    import torch  # lazy: counting the cards initialises CUDA's driver API only

    count = torch.cuda.device_count()
    if text is None:
        return list(range(count)) or [None]
    try:
        wanted = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--devices {text!r}: expected device indices, e.g. 0,1") from None
    bad = [i for i in wanted if not 0 <= i < count]
    if not wanted or bad or len(set(wanted)) != len(wanted):
        raise ValueError(f"--devices {text!r}: this machine has {count} CUDA device(s) (0..{count - 1}); name each "
                         "once")
    return wanted
