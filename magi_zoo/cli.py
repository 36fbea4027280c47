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
    from .engine import STEP_ORDER, preview
    from .engine.report import format_table
    from .specs import SECTIONS, get_profile
    from .zoo import spec_layers

    adapter, variant = adapters.lookup(args.model)
    profile = get_profile(args.gpu)
    layers = spec_layers(adapter, profile, spec_file=args.spec_file)
    # The meta device gives the real module tree at published sizes without allocating.
    native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    plan = preview(nn.ModuleDict(adapter.components(native)), layers, adapter.preparations(native))
    _print(f"{variant.name} on {profile.name} ({profile.device}, default dtype {profile.default_dtype}); "
           f"spec {adapter.spec_file}, layers: {' < '.join(n for n, _ in layers)}")
    _print(f"apply steps, in order: {' -> '.join(STEP_ORDER)}")
    for p in adapter.preparations(native):
        _print(f"  prepare: {p.name}: {p.why}")
    for name in sorted(SECTIONS, key=lambda n: STEP_ORDER.index(n) if n in STEP_ORDER else len(STEP_ORDER)):
        rows = plan.section(name).table()
        _print(f"[{name}]")
        _print(format_table([{k: v for k, v in r.items() if k != "section"} for r in rows]) if rows
               else "  (nothing set: library default)")
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


def write_wav(path: str | Path, audio, sample_rate: int) -> Path:
    """16-bit PCM mono WAV with the standard library's `wave`."""
    import wave

    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pcm = (np.clip(np.nan_to_num(np.asarray(audio, dtype=np.float32)), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return path


def write_output(output, out: str | Path, audio_out: str | Path | None = None) -> list[Path]:
    """Write an adapter's `Output` to `out` (and its speech to `audio_out`); returns the paths."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if output.kind == "video":
        from diffusers.utils import export_to_video

        export_to_video(list(output.value), str(out), fps=output.fps or 16)
    elif output.kind == "image":
        output.value.save(out)
    elif output.kind == "text":
        out.write_text(output.value + "\n", encoding="utf-8")
    else:
        raise ValueError(f"unknown output kind {output.kind!r}")
    written = [out]
    if audio_out is not None:
        if output.audio is None:
            raise ValueError("--audio-out given but the model returned no speech")
        written.append(write_wav(audio_out, output.audio, output.sample_rate))
    return written


def generate_to(handle, *, prompt: str, out: str | Path, progress: bool = True, **options) -> list[Path]:
    """`magi-zoo run` after the build: check the options, generate through the handle, write."""
    given = handle.adapter.check_run(handle.variant, options, Path(out))
    output = handle.adapter.generate(handle, prompt=prompt, progress=progress, **given)
    if output.note and progress:
        _print(output.note)
    return write_output(output, out, given.get("audio_out"))


def cmd_run(args) -> int:
    from . import adapters, load

    opts = dict(image=args.image, audio_out=args.audio_out, num_inference_steps=args.steps, height=args.height,
                width=args.width, num_frames=args.frames, max_new_tokens=args.max_new_tokens, seed=args.seed)
    adapter, variant = adapters.lookup(args.model)
    adapter.check_run(variant, opts, Path(args.out))  # before the build: a bad option costs nothing
    handle = load(args.model, gpu=args.gpu, weights=args.weights, dtype=args.dtype,
                  compile=None if args.compile else False, precision="fp8" if args.fp8 else None)
    if handle.report() is not None:
        _print(f"compiling on the first call ({len(handle.report().regions)} regions of spec "
               f"{handle.adapter.spec_file}, [gpu.{handle.profile.name}]); later steps reuse the code")
    for path in generate_to(handle, prompt=args.prompt, out=args.out, progress=True, **opts):
        _print(f"wrote {path}")
    if handle.report() is not None:
        _print(handle.report().table())
        details = handle.report().details()  # graph-break and recompile reasons, one per line
        if details:
            _print(details)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .specs.gpu_profiles import GPU_CHOICES

    p = argparse.ArgumentParser(prog="magi-zoo", description=__doc__.split("\n")[0])
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="models and their variants").set_defaults(fn=cmd_list)

    s = sub.add_parser("spec", help="the resolved plan for a model on a GPU, as a table")
    s.add_argument("model")
    s.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
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
    r.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    r.add_argument("--dtype", default=None)
    r.add_argument("--steps", type=int, default=None)
    r.add_argument("--height", type=int, default=None)
    r.add_argument("--width", type=int, default=None)
    r.add_argument("--frames", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=None)
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--no-compile", dest="compile", action="store_false", help="run eager")
    r.add_argument("--fp8", action="store_true",
                   help="fp8 matmuls in the regions the spec declares (cards with fp8 matmuls only)")
    r.set_defaults(fn=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, OSError, KeyError, RuntimeError) as e:
        # User errors (unknown model, bad spec, bad option, missing CUDA, unreadable
        # weights): one clear line, exit 2; --debug shows the traceback.
        if args.debug:
            raise
        if isinstance(e, (ValueError, TypeError, KeyError)):
            print(f"magi-zoo: error: {e}", file=sys.stderr)
        else:
            print(f"magi-zoo: error: {type(e).__name__}: {e} (magi-zoo --debug ... shows the traceback)",
                  file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
