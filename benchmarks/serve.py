"""The serve path's cost: a warm request through `magi-zoo serve` against the same call in-process,
and (with --clients N) the throughput and latency of N concurrent clients.

    python -m benchmarks.serve --model flux-tiny --gpu cpu
    python -m benchmarks.serve --model wan2.1 --gpu h100 --weights DIR --steps 50 --frames 81 --height 480 --width 832
    python -m benchmarks.serve --model flux.1-dev --gpu h100 --weights DIR --steps 28 --height 1024 --width 1024 --clients 4
    python -m benchmarks.serve --model wan2.1 --gpu h100 --weights DIR --steps 50 --frames 81 --height 480 --width 832 --nproc 2

`--nproc N` serves the model on one group of N cards (`magi-zoo serve --nproc N`, its plan's
parallel split) against the same call in-process on one card: the row's model reads
"MODEL --nproc N", and its request-vs-call column is then the group's speedup, not overhead.

In-process: `magi_zoo.load` with the plan, then (after warm-up) the median of `--runs` calls
of `adapter.generate` (the pipeline call) and of `generate_to` (the call and the output file:
what a job runs). On a card these run first and the model is freed before the server starts
(one worker on the same card); on the CPU they run in turn with the requests, so a busy
machine weighs on both alike. A request is POST /v1/jobs, GET /v1/jobs/{id}?wait (answers when the job ends),
GET its content: the wall time a client sees, bytes downloaded. Overhead is the request's
median over `generate_to`'s median (the goal: at most 5% more), and over the pipeline call's.
`/metrics`' compiled-frame count is read before and after the timed requests: a warm request
compiles nothing, so the difference must be 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import add_commit_argument, card_tag, env_line, environment, measured_commit, publish, \
    results_dir, results_table
from magi_zoo.serve.pool import free_port


def options(args) -> dict[str, Any]:
    opts = dict(num_inference_steps=args.steps, height=args.height, width=args.width, num_frames=args.frames, seed=0)
    return {k: v for k, v in opts.items() if v is not None}


class Local:
    """The model in this process, and the two calls timed against a request."""

    def __init__(self, args):
        import magi_zoo
        from magi_zoo.cli.commands.run import generate_to
        from magi_zoo.cli.writers import write_output

        self.handle = h = magi_zoo.load(args.model, gpu=args.gpu, weights=args.weights,
                                        compile=None if args.compile else False)
        given = h.adapter.check_run(h.variant, options(args))
        suffix = {".mp4": ".mp4", ".png": ".png"}.get(h.adapter.out_suffixes(h.variant, given)[0], ".txt")
        out = Path(tempfile.mkdtemp()) / f"out{suffix}"
        self.cuda = h.device.type == "cuda"
        self.output = None

        def call():
            self.output = h.adapter.generate(h, prompt=args.prompt, progress=False, **given)

        self.call = call
        self.to_file = lambda: generate_to(h, prompt=args.prompt, out=out, progress=False, **given)
        # the output file alone, from the last call's output: where generate_to's time over the
        # call goes (the video encode, for a video)
        self.write = lambda: write_output(self.output, out)
        self.env = environment(h.device)

    def timed(self, fn) -> float:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    def free(self) -> None:
        import torch

        self.handle = self.call = self.to_file = self.write = self.output = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def http(url: str, body: dict | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return r.read()


def one_request(base: str, args) -> float:
    """POST the job, wait for its end, download it: ms of wall time."""
    t0 = time.perf_counter()
    job = json.loads(http(base + "/v1/jobs", {"model": args.model, "prompt": args.prompt, **options(args)}))
    job = json.loads(http(f"{base}/v1/jobs/{job['id']}?wait=3600"))
    if job["status"] != "completed":
        raise RuntimeError(f"job {job['id']} {job['status']}: {job['error']}")
    http(f"{base}/v1/jobs/{job['id']}/content")
    return (time.perf_counter() - t0) * 1e3


def compiled_frames(base: str) -> float:
    text = http(base + "/metrics").decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("magi_zoo_compile_frames{"))


def served(args, local: Local) -> dict[str, Any]:
    """Start the server, warm it, time requests; on the CPU the in-process calls are timed in
    turn with the requests (the same load on the machine for both); on a card the model was
    timed and freed before (two copies of a large model need not fit)."""
    cuda = local.cuda
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "magi_zoo.cli", "serve", args.model, "--gpu", args.gpu, "--port", str(port),
           "--log-level", "warning", "--max-queue", str(max(16, 2 * args.clients))]
    cmd += ["--devices", ",".join(str(i) for i in range(args.nproc))] if cuda else []
    cmd += ["--nproc", str(args.nproc)] if args.nproc > 1 else []
    cmd += ["--weights", args.weights] if args.weights else []
    cmd += [] if args.compile else ["--no-compile"]
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + args.start_timeout
        while True:
            try:
                health = json.loads(http(base + "/health"))
                if all(m["ready"] == m["workers"] for m in health["models"]):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see its output above)")
            time.sleep(0.5)
        for _ in range(args.warmup):
            one_request(base, args)
        before = compiled_frames(base)
        single, call, to_file, write = [], [], [], []
        for _ in range(args.runs):
            single.append(one_request(base, args))
            if local.call is not None:
                call.append(local.timed(local.call))
                write.append(local.timed(local.write))
                to_file.append(local.timed(local.to_file))
        record: dict[str, Any] = {"request_ms": single, "warm_compiled_frames_delta": compiled_frames(base) - before,
                                  "call_ms": call, "generate_to_ms": to_file, "write_ms": write}
        if args.clients > 1:
            per_client = max(1, args.requests // args.clients)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
                lists = list(pool.map(lambda _: [one_request(base, args) for _ in range(per_client)],
                                      range(args.clients)))
            wall = time.perf_counter() - t0
            lat = sorted(x for xs in lists for x in xs)
            record.update(clients=args.clients, concurrent_requests=len(lat), concurrent_wall_s=round(wall, 3),
                          throughput_per_s=round(len(lat) / wall, 4),
                          p50_ms=round(statistics.median(lat), 1),
                          p95_ms=round(lat[min(len(lat) - 1, int(round(0.95 * (len(lat) - 1))))], 1),
                          latencies_ms=[round(x, 1) for x in lat])
        return record
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flux-tiny")
    ap.add_argument("--gpu", default="auto")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--prompt", default="a corgi surfing a wave at sunset")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager (CPU default: inductor "
                    "compiles a C++ build per graph)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--clients", type=int, default=1, help="concurrent clients for the throughput run (1: none)")
    ap.add_argument("--requests", type=int, default=16, help="requests in the throughput run, over all clients")
    ap.add_argument("--nproc", type=int, default=1, help="serve on one group of N cards (serve --nproc N); "
                    "the in-process call runs on one")
    ap.add_argument("--start-timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=results_dir("serve"))
    add_commit_argument(ap)
    args = ap.parse_args(argv)
    measured_commit()  # before anything is measured: a result must name its commit
    local = Local(args)
    for _ in range(args.warmup):
        local.call()
        local.to_file()
    times = {"call_ms": [], "generate_to_ms": [], "write_ms": []}
    if local.cuda:  # timed now, then freed for the server's copy
        times = {"call_ms": [local.timed(local.call) for _ in range(args.runs)],
                 "write_ms": [local.timed(local.write) for _ in range(args.runs)],
                 "generate_to_ms": [local.timed(local.to_file) for _ in range(args.runs)]}
        local.free()
    remote = served(args, local)
    for k in times:
        times[k] = times[k] or remote.pop(k)
    call_ms, to_file_ms = statistics.median(times["call_ms"]), statistics.median(times["generate_to_ms"])
    write_ms = statistics.median(times["write_ms"])
    req_ms = statistics.median(remote["request_ms"])
    model = args.model + (f" --nproc {args.nproc}" if args.nproc > 1 else "")
    row = {"model": model, "options": json.dumps(options(args)), "compiled": args.compile,
           "call_ms": round(call_ms, 2), "generate_to_ms": round(to_file_ms, 2),
           "write_ms": round(write_ms, 2), "request_ms": round(req_ms, 2),
           "overhead_vs_generate_to_pct": round(100 * (req_ms / to_file_ms - 1), 2),
           "overhead_vs_call_pct": round(100 * (req_ms / call_ms - 1), 2),
           "warm_compiled_frames_delta": remote["warm_compiled_frames_delta"]}
    for k in ("clients", "throughput_per_s", "p50_ms", "p95_ms"):
        if k in remote:
            row[k] = remote[k]
    env = local.env
    record = {"benchmark": "serve", "env": env, "args": {k: str(v) for k, v in vars(args).items()}, "row": row,
              "in_process": {k: [round(x, 3) for x in v] for k, v in times.items()}, "interleaved": not local.cuda,
              "served": remote}
    columns = [c for c in ("model", "options", "call_ms", "write_ms", "generate_to_ms", "request_ms",
                           "overhead_vs_generate_to_pct", "overhead_vs_call_pct", "warm_compiled_frames_delta",
                           "clients", "throughput_per_s", "p50_ms", "p95_ms") if c in row]
    md = f"{env_line(env)}\n\n" + results_table([row], columns)
    shape = "_".join(f"{k}{v}" for k, v in options(args).items() if k != "seed")
    group = f"_np{args.nproc}" if args.nproc > 1 else ""
    stem = f"serve_{args.model}_{shape}_c{args.clients}{group}_{card_tag(env, local.cuda)}"
    publish(args.out, stem, record, md)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
