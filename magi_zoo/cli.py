"""`magi-zoo`: list models, show a resolved spec, run the demo, generate.

    magi-zoo list
    magi-zoo spec wan2.1 --gpu h100
    magi-zoo demo
    magi-zoo run wan2.1-tiny --prompt "a corgi surfing" --out corgi.mp4
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path


def _print(*a):
    print(*a, flush=True)


def cmd_list(args) -> int:
    from . import adapters
    from .engine.report import format_table

    rows = []
    for a in adapters.all_adapters():
        inv = {}
        for alias, target in a.aliases.items():
            inv.setdefault(target, []).append(alias)
        for v in a.variants.values():
            rows.append({"model": v.name, "family": a.family, "aliases": ", ".join(inv.get(v.name, [])),
                         "weights": "random (tiny)" if v.tiny else (v.hub_id or "random"),
                         "description": v.description})
    _print(format_table(rows))
    return 0


def cmd_spec(args) -> int:
    """Resolve the plan against the real module tree (built on the meta device: no memory)."""
    import torch
    import torch.nn as nn

    from . import adapters
    from .engine.report import format_table
    from .engine.resolve import resolve
    from .specs import get_profile
    from .zoo import spec_layers

    adapter, variant = adapters.lookup(args.model)
    profile = get_profile(args.gpu)
    layers = spec_layers(adapter, profile, spec_file=args.spec_file)
    # The meta device gives the real module tree at published sizes without allocating.
    native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    plan = resolve(nn.ModuleDict(adapter.components(native)), layers)
    _print(f"{variant.name} on {profile.name} ({profile.device}, default dtype {profile.default_dtype})")
    _print(format_table(plan.table()))
    return 0


class _Ticker:
    """Prints elapsed time every few seconds while a long first call (compile) runs."""

    def __init__(self, label: str, every: float = 5.0):
        self.label, self.every = label, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.wait(self.every):
            _print(f"  ... {self.label}: {time.perf_counter() - t0:.0f} s")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _timed_steps(handle, call: dict, seed: int):
    """Run the pipeline once; return (frames, per-step seconds)."""
    import torch

    stamps = []

    def on_step(pipe, i, t, kw):
        stamps.append(time.perf_counter())
        return {}

    gen = torch.Generator(device="cpu").manual_seed(seed)
    t0 = time.perf_counter()
    out = handle(generator=gen, output_type="np", callback_on_step_end=on_step, **call)
    steps = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    return out.frames, steps


def cmd_demo(args) -> int:
    import numpy as np
    import torch

    from . import load
    from .engine.report import format_table

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = "wan2.1-tiny"  # the embedded default: offline, CPU, about 30 s
    _print(f"[1/4] building {model} (random weights, offline) on CPU ...")
    handle = load(model, gpu="cpu", compile=False)
    call = dict(handle.variant.call_defaults, prompt=args.prompt)
    n = call["num_inference_steps"]
    _print(f"[2/4] eager run: {call['num_frames']} frames {call['height']}x{call['width']}, {n} steps, CFG")
    _timed_steps(handle, call, args.seed)  # warm-up: first-call allocations, lazy init
    eager, eager_steps = _timed_steps(handle, call, args.seed)
    _print(f"[3/4] applying the plan (spec {handle.adapter.spec_file}, section [gpu.cpu]) and compiling on first call ...")
    report = handle.apply_plan()
    for row in handle.plan.table():
        _print(f"      {row['region']:<22} {row['method']:<8} {row['modules']:<26} {row['spec']}")
    t0 = time.perf_counter()
    with _Ticker("compiling (inductor, C++ build on CPU)"):
        _timed_steps(handle, call, args.seed)
    first = time.perf_counter() - t0
    _print(f"      first compiled call: {first:.1f} s")
    compiled, comp_steps = _timed_steps(handle, call, args.seed)
    _print("[4/4] results")
    _print(report.table())
    details = report.details()
    if details:
        _print(details)
    diff = float(np.max(np.abs(np.asarray(eager, dtype=np.float64) - np.asarray(compiled, dtype=np.float64))))
    e, c = float(np.median(eager_steps)), float(np.median(comp_steps))
    _print(format_table([
        {"run": "eager", "s/step (median)": f"{e:.3f}", "first call s": "-"},
        {"run": "magi_zoo plan", "s/step (median)": f"{c:.3f}", "first call s": f"{first:.1f}"},
    ]))
    _print(f"speedup per step: {e / c:.2f}x   max |eager - compiled| over output pixels: {diff:.2e}")
    return 0


def cmd_run(args) -> int:
    from . import load

    handle = load(args.model, gpu=args.gpu, weights=args.weights, dtype=args.dtype,
                  compile=None if args.compile else False)
    opts = dict(image=args.image, audio_out=args.audio_out, num_inference_steps=args.steps, height=args.height,
                width=args.width, num_frames=args.frames, max_new_tokens=args.max_new_tokens, seed=args.seed)
    out = handle.adapter.run(handle, prompt=args.prompt, out=Path(args.out), progress=True, **opts)
    _print(f"wrote {out}")
    if handle.report() is not None:
        _print(handle.report().table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .specs.gpu_profiles import GPU_CHOICES

    p = argparse.ArgumentParser(prog="magi-zoo", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="models and their variants").set_defaults(fn=cmd_list)

    s = sub.add_parser("spec", help="the resolved plan for a model on a GPU, as a table")
    s.add_argument("model")
    s.add_argument("--gpu", default="auto", choices=GPU_CHOICES)
    s.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    s.set_defaults(fn=cmd_spec)

    d = sub.add_parser("demo", help="offline CPU demo: wan2.1-tiny eager vs its plan")
    d.add_argument("--prompt", default="a corgi surfing a wave at sunset")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(fn=cmd_demo)

    r = sub.add_parser("run", help="generate with a model and write the result")
    r.add_argument("model")
    r.add_argument("--weights", default=None, help="a local directory, a hub id, or 'random'")
    r.add_argument("--prompt", required=True)
    r.add_argument("--out", required=True, help="output file (.mp4 video, .png image, .txt text)")
    r.add_argument("--image", default=None, help="input image (image-conditioned models)")
    r.add_argument("--audio-out", default=None, help="write speech to this .wav (models with audio)")
    r.add_argument("--gpu", default="auto", choices=GPU_CHOICES)
    r.add_argument("--dtype", default=None)
    r.add_argument("--steps", type=int, default=None)
    r.add_argument("--height", type=int, default=None)
    r.add_argument("--width", type=int, default=None)
    r.add_argument("--frames", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=None)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--no-compile", dest="compile", action="store_false", help="run eager")
    r.set_defaults(fn=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as e:
        # User errors (unknown model, bad spec, bad option): one clear line, exit 2.
        if getattr(args, "debug", False):
            raise
        print(f"magi-zoo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
