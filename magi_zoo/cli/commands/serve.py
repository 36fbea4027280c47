"""`magi-zoo serve MODEL [MODEL ...]`: the models loaded once per worker (one worker per GPU;
on the CPU, one) behind an OpenAI-compatible HTTP API and a web page (`magi_zoo.serve`).

Everything the command line says is checked before a worker starts, with `magi-zoo run`'s
own checks: the models exist, the compile overrides and the step cache are valid, the spec
file exists, the devices are there."""

from __future__ import annotations

import os
from pathlib import Path

from ... import adapters
from ...specs import get_profile
from ..console import say
from .run_options import parse_compile_overrides, step_cache_override


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
    say(f"serving {', '.join(config.models)} on http://{args.host}:{args.port} "
        f"({len(config.devices)} worker(s) per model; web page at /, API under /v1)")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=max(1, int(args.grace)))
    return 0


def serve_config(args):
    """The command line, checked, as a `ServeConfig`."""
    from ...serve.app import ServeConfig  # lazy: FastAPI, the serve extra

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
    return ServeConfig(models=list(args.model), load=load, devices=devices(args.devices, profile.device),
                       api_key=args.api_key or os.environ.get("MAGI_ZOO_API_KEY") or None,
                       max_queue=args.max_queue, max_body_bytes=int(args.max_body_mib * 2**20),
                       output_dir=Path(args.output_dir) if args.output_dir else None, keep_jobs=args.keep_jobs,
                       grace_s=args.grace, warmup=args.warmup,
                       gpu_memory_gib=profile.memory_gib if profile.device == "cuda" else None)


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
