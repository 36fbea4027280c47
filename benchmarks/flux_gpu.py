"""Flux.1 transformer: eager vs diffusers regional compile vs magi_zoo, one forward.

    python -m benchmarks.flux_gpu --device cuda --out benchmarks/results
    python -m benchmarks.flux_gpu --device cpu --model flux-tiny --out /tmp/r   # CPU smoke run

Random weights at the published config (FLUX.1-dev by default), bf16 on CUDA, batch 1,
1024x1024 = 4,096 image + 512 text tokens (DESIGN.md's reference shape). Strategies:

- eager:              FluxTransformer2DModel as diffusers builds it, no compile;
- diffusers_regional: the same model + `transformer.compile_repeated_blocks(fullgraph=True)`;
- magi_zoo:           `magi_zoo.load(model, weights="random", gpu=<detected>)` -- the real
                      load path (whole pipeline incl. T5-XXL, built on the GPU), its spec
                      applied; timed on `handle.pipe.transformer`. Also times one eager VAE
                      decode at the same resolution (the spec keeps it eager; this is the
                      number that says whether it should be compiled).

Each strategy runs in a fresh subprocess on CUDA (so compile caches in memory and
allocator state do not leak between them; `--no-isolate` runs in-process). Per strategy:
cold first call (wall, includes compile), then warm-up, then >= 5 timed forwards with CUDA
events: median / min / max ms, peak GiB (torch.cuda.max_memory_allocated) and the GiB
resident before the first forward (magi_zoo also holds the text encoders and VAE), and
dynamo frame / recompile counts. A failing strategy records its error; the rest go on.
Writes flux_<model>_<card>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

STRATEGIES = ("eager", "diffusers_regional", "magi_zoo")
# DESIGN.md reference numbers (H200, torch 2.11, diffusers 0.42.1), for the table only.
REFERENCE_MS = {"h200": {"eager": 173.0, "diffusers_regional": 133.0}}


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except Exception:
        return None


def _card(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")


def _shim_pipe(transformer, variant):
    """What `FluxAdapter.denoiser_inputs` reads from a pipeline, for strategies that build
    only the transformer (eager, diffusers_regional): the VAE scale factor of the variant's
    published VAE and the pipeline's position-id helper."""
    from diffusers import FluxPipeline

    vae_levels = len(variant.config["vae"]["block_out_channels"])
    return types.SimpleNamespace(transformer=transformer, vae_scale_factor=2 ** (vae_levels - 1),
                                 _prepare_latent_image_ids=FluxPipeline._prepare_latent_image_ids)


def _bare_transformer(variant, dtype, device):
    from diffusers import FluxTransformer2DModel

    from magi_zoo.adapters.base import init_on

    import torch

    torch.manual_seed(0)
    with init_on(device, dtype):
        return FluxTransformer2DModel(**variant.config["transformer"]).eval()


def _time_forward(fn, device, warmup: int, iters: int) -> dict:
    """Cold first call (wall), warm-up, then `iters` timed calls (CUDA events on GPU)."""
    import torch

    t0 = time.perf_counter()
    fn()
    _sync(device)
    cold_s = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):  # the cold call counts as the first warm-up
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"first_call_s": round(cold_s, 3), "median_ms": round(statistics.median(times), 3),
            "min_ms": round(min(times), 3), "max_ms": round(max(times), 3), "iters": iters,
            "times_ms": [round(t, 3) for t in times]}


def run_strategy(name: str, args) -> dict:
    """Build, compile (per strategy) and time one transformer forward; returns a result row."""
    import torch

    import magi_zoo
    from magi_zoo import adapters
    from magi_zoo.engine import _torch_compat as compat

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    adapter, variant = adapters.lookup(args.model)
    gpu = magi_zoo.get_profile("auto" if device.type == "cuda" else "cpu").name
    row: dict = {"strategy": name, "status": "ok"}
    # In-process runs (CPU smoke, --no-isolate) must not reuse the previous strategy's
    # compiled code: start each strategy from an empty dynamo cache.
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_build = time.perf_counter()
    handle = None
    if name in ("eager", "diffusers_regional"):
        transformer = _bare_transformer(variant, dtype, device)
        pipe = _shim_pipe(transformer, variant)
        if name == "diffusers_regional":
            kw = {"fullgraph": True}
            if args.backend != "inductor":
                kw["backend"] = args.backend
            transformer.compile_repeated_blocks(**kw)
    elif name == "magi_zoo":
        override = None
        if args.backend != "inductor":  # CPU smoke runs: keep the spec, swap the backend
            override = {k: {"backend": args.backend} for k in ("FluxTransformerBlock", "FluxSingleTransformerBlock")}
        handle = magi_zoo.load(args.model, weights="random", gpu=gpu, dtype=dtype, device=device, compile=override)
        pipe = handle.pipe
        transformer = pipe.transformer
        row["spec"] = [r for r in handle.report().rows() if r["region"].startswith("Flux")]
    else:
        raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")
    _sync(device)
    row["build_s"] = round(time.perf_counter() - t_build, 3)
    row["gpu_profile"] = gpu
    inputs = adapter.denoiser_inputs(pipe, variant, height=args.height, width=args.width)
    row["image_tokens"] = inputs["hidden_states"].shape[1]
    row["text_tokens"] = inputs["encoder_hidden_states"].shape[1]
    if device.type == "cuda":
        row["resident_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)

    before = compat.snapshot()
    with torch.no_grad():
        row.update(_time_forward(lambda: transformer(**inputs), device, args.warmup, args.iters))
    counters = compat.delta(before)
    row["frames_compiled"] = counters.frames
    row["recompiles"] = len(counters.recompiles)
    if device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if handle is not None:
        rep = handle.report()
        row["region_frames"] = {r.label: r.counters.frames for r in rep.regions if r.counters.frames}
        if not args.skip_vae:
            row["vae_decode"] = _time_vae_decode(pipe, inputs, device)
    return row


def _time_vae_decode(pipe, inputs, device) -> dict:
    """One eager VAE decode at the benchmark resolution (what FluxPipeline does once per image)."""
    import torch

    vae = pipe.vae
    n_img = inputs["hidden_states"].shape[1]
    f = pipe.vae_scale_factor
    gh = gw = int(n_img ** 0.5)  # square images: latent grid is 2*gh x 2*gw
    lat = torch.randn(1, vae.config.latent_channels, 2 * gh, 2 * gw, device=device, dtype=vae.dtype)
    with torch.no_grad():
        res = _time_forward(lambda: vae.decode(lat, return_dict=False), device, warmup=1, iters=3)
    res["pixels"] = f"{2 * gh * f}x{2 * gw * f}"
    return res


def _isolated(name: str, args) -> dict:
    """Run one strategy in a fresh interpreter; its row comes back through a JSON file."""
    with tempfile.TemporaryDirectory() as tmp:
        res_file = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "benchmarks.flux_gpu", "--device", args.device, "--model", args.model,
               "--height", str(args.height), "--width", str(args.width), "--warmup", str(args.warmup),
               "--iters", str(args.iters), "--backend", args.backend, "--only", name, "--row-file", str(res_file)]
        if args.skip_vae:
            cmd.append("--skip-vae")
        root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=root, env=env)
        except subprocess.TimeoutExpired:
            return {"strategy": name, "status": "error", "error": f"timed out after {args.timeout} s"}
        if res_file.is_file():
            return json.loads(res_file.read_text())
        tail = (proc.stderr or proc.stdout or "")[-3000:]
        return {"strategy": name, "status": "error", "error": f"exit {proc.returncode}: {tail}"}


def _one(name: str, args) -> dict:
    try:
        return run_strategy(name, args)
    except Exception as e:  # a failing strategy is recorded, the benchmark goes on
        return {"strategy": name, "status": "error", "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:]}


def _markdown(meta: dict, rows: list[dict]) -> str:
    ref = REFERENCE_MS.get(meta.get("gpu_profile") or "", {})
    base = next((r for r in rows if r["strategy"] == "eager" and r["status"] == "ok"), None)
    lines = [f"# Flux transformer forward: {meta['model']} {meta['height']}x{meta['width']}, {meta['dtype']}",
             "", f"card: {meta['card']} | torch {meta['torch']} | diffusers {meta['diffusers']} | "
             f"transformers {meta['transformers']} | commit {meta['commit']}", "",
             "| strategy | median ms | min | max | speedup vs eager | first call s | frames compiled | "
             "recompiles | peak GiB | resident GiB | DESIGN.md ref ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['strategy']} | error: {r['error'].splitlines()[0][:120]} |||||||||| ")
            continue
        speed = f"{base['median_ms'] / r['median_ms']:.2f}x" if base else "-"
        lines.append(f"| {r['strategy']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} | {speed} | "
                     f"{r['first_call_s']:.1f} | {r['frames_compiled']} | {r['recompiles']} | "
                     f"{r.get('peak_gib', '-')} | {r.get('resident_gib', '-')} | {ref.get(r['strategy'], '-')} |")
    for r in rows:
        if r.get("vae_decode"):
            v = r["vae_decode"]
            lines += ["", f"VAE decode (eager, {v['pixels']}, once per image): median {v['median_ms']:.1f} ms, "
                      f"first call {v['first_call_s']:.2f} s."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--model", default="flux.1-dev", help="a flux variant (flux.1-dev, flux.1-schnell, flux-tiny)")
    p.add_argument("--height", type=int, default=None, help="default: the variant's call default (1024)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--backend", default="inductor", help="compile backend for both compiled strategies "
                   "(CPU smoke runs use eager/aot_eager)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--no-isolate", action="store_true", help="run strategies in this process (default on CPU)")
    p.add_argument("--skip-vae", action="store_true", help="do not time the VAE decode")
    p.add_argument("--timeout", type=int, default=300, help="seconds per isolated strategy")
    p.add_argument("--only", help=argparse.SUPPRESS)  # internal: one strategy, in a subprocess
    p.add_argument("--row-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.iters < 1:
        p.error("--warmup and --iters must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from magi_zoo import adapters

    _, variant = adapters.lookup(args.model)
    if variant.family != "flux":
        raise SystemExit(f"{args.model} is not a Flux variant")
    args.model = variant.name
    args.height = args.height or variant.call_defaults["height"]
    args.width = args.width or variant.call_defaults["width"]
    if args.only:  # child process of an isolated run
        row = _one(args.only, args)
        Path(args.row_file).write_text(json.dumps(row))
        return {"rows": [row]}

    import diffusers
    import torch
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here; use --device cpu --model flux-tiny")
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    isolate = device.type == "cuda" and not args.no_isolate
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = _isolated(name, args) if isolate else _one(name, args)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("times_ms", "traceback", "spec")}), flush=True)
    from magi_zoo.specs.gpu_profiles import detect_profile_name

    meta = {"model": args.model, "height": args.height, "width": args.width,
            "dtype": "bfloat16" if device.type == "cuda" else "float32", "device": args.device,
            "card": _card(device), "gpu_profile": detect_profile_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "diffusers": diffusers.__version__,
            "transformers": transformers.__version__, "commit": _git_commit(), "warmup": args.warmup,
            "iters": args.iters, "backend": args.backend, "isolated": isolate}
    result = {"meta": meta, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"flux_{args.model}_{meta['gpu_profile']}".replace(".", "_")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2, default=str))
    md = _markdown(meta, rows)
    (out / f"{stem}.md").write_text(md)
    print(md)
    return result


if __name__ == "__main__":
    main()
