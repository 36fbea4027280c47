"""`magi-zoo serve`'s flags (kept beside `parser.py`: no torch, so `--help` stays cheap)."""

from __future__ import annotations

import argparse

from ..specs.gpu_profiles import GPU_CHOICES


def add_serve(sub, common: argparse.ArgumentParser) -> None:
    v = sub.add_parser("serve", parents=[common],
                       help="serve models over an OpenAI-compatible HTTP API, with a web page")
    v.add_argument("model", nargs="+", help="the model(s) to serve (each keeps its own workers and queue)")
    v.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    v.add_argument("--devices", default=None, metavar="I,J,...",
                   help="the CUDA devices to run workers on, one worker each, or --nproc per worker (default: "
                        "every visible card; on the CPU one worker)")
    v.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="processes per worker: each worker is a group of N processes on N cards (the devices split "
                        "in consecutive groups of N) running one copy of the model with the plan's context / CFG "
                        "parallel split, as `magi-zoo run --nproc N`; on the CPU CFG parallel only (default 1)")
    v.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default: loopback only; 0.0.0.0 for every interface)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the API (default: $MAGI_ZOO_API_KEY, else none)")
    v.add_argument("--max-queue", type=int, default=16, help="jobs waiting per model before 429 (default 16)")
    v.add_argument("--max-body-mib", type=float, default=32.0, help="the largest request body (default 32 MiB)")
    v.add_argument("--output-dir", default=None,
                   help="where outputs are written, by job id (default: a temporary directory, removed at exit)")
    v.add_argument("--keep-jobs", type=int, default=1000,
                   help="ended jobs kept (and their files); older ones are deleted (default 1000)")
    v.add_argument("--grace", type=float, default=30.0,
                   help="seconds running jobs may finish at shutdown (SIGTERM) before they are failed (default 30)")
    v.add_argument("--warmup", action="store_true",
                   help="one generation at the model's defaults when a worker starts (compiles before the first "
                        "request)")
    v.add_argument("--weights", default=None, help="a local directory, a hub id, or 'random' (one model only)")
    v.add_argument("--dtype", default=None)
    v.add_argument("--no-compile", dest="compile", action="store_false", help="run eager")
    v.add_argument("--fp8", action="store_true",
                   help="fp8 matmuls in the regions the spec declares (cards with fp8 matmuls only)")
    v.add_argument("--step-cache", default=None, metavar="METHOD[:THRESHOLD]",
                   help="reuse work across denoising steps (as `magi-zoo run --step-cache`)")
    v.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one (one model only)")
    v.add_argument("--compile", dest="compile_overrides", action="append", default=None, metavar="KEY=JSON",
                   help="override one compile key (repeatable), as `magi-zoo run --compile`")
    v.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="offload budget per worker, as `magi-zoo run --memory-budget`")
    v.add_argument("--cache-dir", default=None,
                   help="warm-start cache of compile artifacts (default: $MAGI_ZOO_CACHE_DIR)")
    v.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")
