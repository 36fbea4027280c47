"""`magi-zoo`: list models, show a resolved spec, run the demo, generate.

    magi-zoo list
    magi-zoo spec wan2.1 --gpu h100
    magi-zoo demo
    magi-zoo run wan2.1-tiny --prompt "a corgi surfing" --out corgi.mp4
    magi-zoo explain wan2.1-tiny --gpu cpu --out explain/

Errors in what the user gave (flags, paths, weights, CUDA) print one line,
`magi-zoo: error: ...`, and exit 2; `--debug` shows the traceback.
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
    if args.memory_budget is not None:
        from .specs.offload_spec import with_memory_budget

        layers = with_memory_budget(layers, args.memory_budget)
    recompute = None
    if args.recompute is not None:  # the plan a training load applies
        from .train import parse_recompute, training_layers

        recompute = parse_recompute(args.recompute)
        layers = training_layers(layers, recompute)
    # The meta device gives the real module tree at published sizes without allocating.
    native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    plan = preview(nn.ModuleDict(adapter.components(native)), layers, adapter.preparations(native))
    _print(f"{variant.name} on {profile.name} ({profile.device}, default dtype {profile.default_dtype}); "
           f"spec {adapter.spec_file}, layers: {' < '.join(n for n, _ in layers)}")
    _print(f"apply steps, in order: {' -> '.join(STEP_ORDER)}")
    for p in adapter.preparations(native):
        _print(f"  prepare: {p.name}: {p.why}")
    ops = family_custom_ops(adapter)
    _print(f"custom ops of this model: {', '.join(ops) or 'none'}")
    for name in sorted(SECTIONS, key=lambda n: STEP_ORDER.index(n) if n in STEP_ORDER else len(STEP_ORDER)):
        rows = plan.section(name).table()
        _print(f"[{name}]")
        _print(format_table([{k: v for k, v in r.items() if k != "section"} for r in rows]) if rows
               else "  (nothing set: library default)")
    from .engine.offload import describe_plan

    _print(describe_plan(nn.ModuleDict(adapter.components(native)), plan, profile))
    if recompute is not None:
        from .train import spec_recompute_lines

        for line in spec_recompute_lines(args.model, args.gpu, recompute, args.measure):
            _print(line)
    return 0


def family_custom_ops(adapter) -> list[str]:
    """Names of the registered custom ops defined by the adapter's own modules (its package,
    or its module for a one-file family): the registry itself is process-wide."""
    from .engine.compat import torch as compat
    from .engine.custom_ops import list_custom_ops

    mod = type(adapter).__module__
    pkg = getattr(sys.modules.get(mod), "__package__", None) or mod
    prefix = mod if pkg == __package__ + ".adapters" else pkg
    return [i.name for i in list_custom_ops()
            if (compat.custom_op_module(i.op) or "").split(".")[:len(prefix.split("."))] == prefix.split(".")]


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


def _repeat_steps(handle, call: dict, seed: int, repeats: int = 3):
    """The pipeline `repeats` times: (the last output, every step's seconds). More steps
    than one run has make the median steadier on a busy machine."""
    steps: list[float] = []
    for _ in range(repeats):
        out, s = _timed_steps(handle, call, seed)
        steps += s
    return out, steps


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
    eager, eager_steps = _repeat_steps(handle, call, args.seed)
    _print(f"[3/4] applying the plan (spec {handle.adapter.spec_file}, section [gpu.cpu]) and compiling on first call ...")
    report = handle.apply_plan()
    for row in handle.plan.table():
        _print(f"      {row['region']:<22} {row['method']:<8} {row['modules']:<26} {row['spec']}")
    t0 = time.perf_counter()
    with _Ticker("compiling (inductor, C++ build on CPU)"):
        _timed_steps(handle, call, args.seed)
    first = time.perf_counter() - t0
    _print(f"      first compiled call: {first:.1f} s")
    compiled, comp_steps = _repeat_steps(handle, call, args.seed)
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
    _print(f"speedup per step: {e / c:.2f}x (median of {len(eager_steps)} steps each)   "
           f"max |eager - compiled| over output pixels: {diff:.2e}")
    _print("(a tiny model's step is mostly Python and launch overhead, so this ratio says little about "
           "speed and moves with machine load; it shows the plumbing works -- GPU tables are in the README)")
    return 0


def write_wav(path: str | Path, audio, sample_rate: int) -> Path:
    """16-bit PCM mono WAV with the standard library's `wave`, written atomically."""
    import wave

    import numpy as np

    from .io import atomic_write

    pcm = (np.clip(np.nan_to_num(np.asarray(audio, dtype=np.float32)), -1.0, 1.0) * 32767.0).astype("<i2")

    def write(tmp: Path) -> None:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm.tobytes())

    atomic_write(Path(path), write)
    return Path(path)


def write_gif(frames, path: str | Path, fps: int) -> None:
    """Frames (H x W x 3 floats in [0, 1]) as an animated GIF with Pillow alone (no ffmpeg),
    through diffusers' own `numpy_to_pil` and `export_to_gif`."""
    import numpy as np
    from diffusers.utils import export_to_gif, numpy_to_pil

    if len(frames) == 0:
        raise ValueError("no frames to write")
    export_to_gif(numpy_to_pil(np.clip(np.stack([np.asarray(f) for f in frames]), 0.0, 1.0)), str(path), fps=fps)


def write_output(output, out: str | Path, audio_out: str | Path | None = None) -> list[Path]:
    """Write an adapter's `Output` to `out` (and its speech to `audio_out`); returns the paths.
    Each file is written to a temporary name and renamed into place: a failure mid-write
    never leaves a torn file, and an existing file is replaced whole or not at all."""
    from .io import atomic_write, atomic_write_text

    out = Path(out)
    if audio_out is not None and output.audio is None:
        raise ValueError("--audio-out given but the model returned no speech")
    if output.kind == "video" and out.suffix.lower() == ".gif":
        atomic_write(out, lambda tmp: write_gif(list(output.value), tmp, fps=output.fps or 16))
    elif output.kind == "video":
        from diffusers.utils import export_to_video

        def mp4(tmp):
            try:
                export_to_video(list(output.value), str(tmp), fps=output.fps or 16)
            except (AttributeError, ImportError, RuntimeError) as e:
                if "ffmpeg" not in str(e):
                    raise
                raise RuntimeError(f"writing {out.name} needs ffmpeg (pip install imageio-ffmpeg); or write "
                                   f"{out.with_suffix('.gif').name}, which needs only Pillow") from e

        atomic_write(out, mp4)
    elif output.kind == "image":
        atomic_write(out, lambda tmp: output.value.save(tmp))
    elif output.kind == "text":
        atomic_write_text(out, output.value + "\n")
    else:
        raise ValueError(f"unknown output kind {output.kind!r}")
    written = [out]
    if audio_out is not None:
        written.append(write_wav(audio_out, output.audio, output.sample_rate))
    return written


def generate_to(handle, *, prompt: str, out: str | Path, progress: bool = True, write: bool = True,
                **options) -> list[Path]:
    """`magi-zoo run` after the build: check the options, generate through the handle, write
    (`write=False`: generate only -- the ranks other than 0 of a multi-process run)."""
    given = handle.adapter.check_run(handle.variant, options, Path(out))
    output = handle.adapter.generate(handle, prompt=prompt, progress=progress, **given)
    if not write:
        return []
    if output.note and progress:
        _print(output.note)
    return write_output(output, out, given.get("audio_out"))


def parse_compile_overrides(items: list[str] | None) -> dict | None:
    """`--compile KEY=JSON` (repeatable) -> a compile override {key: spec}, every spec
    validated now (unknown field, bad value: the error names the flag), before any build."""
    import json

    from .specs.compile_spec import TorchCompileSpec

    if not items:
        return None
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--compile {item!r}: expected KEY=JSON, e.g. "
                             "--compile 'WanTransformerBlock={\"dynamic\": false}'")
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--compile {key}: the value is not JSON ({e.msg} at column {e.colno}): {text!r}; "
                             "e.g. '{\"dynamic\": false}' or false") from None
        if isinstance(spec, bool):  # KEY=false: the enabled switch alone
            spec = {"enabled": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"--compile {key}: expected a JSON object of TorchCompileSpec fields "
                             f"(or true/false), got {text!r}")
        fields = set(TorchCompileSpec.model_fields)
        methods = spec if spec and not fields & set(spec) and all(isinstance(v, dict) for v in spec.values()) else None
        try:
            for one in (methods.values() if methods else [spec]):  # {method: spec} or one spec
                TorchCompileSpec.model_validate(one)
        except Exception as e:  # pydantic's ValidationError names the field and the choices
            errors = getattr(e, "errors", None)
            text = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}" for x in errors()) \
                if callable(errors) else _one_line(e)
            if "extra" in text.lower() or "not permitted" in text:
                text += f" (fields: {', '.join(TorchCompileSpec.model_fields)})"
            raise ValueError(f"--compile {key}: {text}") from None
        out[key.strip()] = spec
    return out


def _one_line(e: object) -> str:
    return " ".join(str(e).split())


def step_cache_override(args, adapter) -> dict:
    """`--step-cache METHOD[:THRESHOLD|:NAME=VALUE,...]` as a plan layer's step_cache section,
    keyed on the pipeline's denoiser(s) (`transformer`, and Wan2.2's `transformer_2` by the
    glob); {} without the flag. Validated here, before anything is built."""
    text = getattr(args, "step_cache", None)
    if text is None:
        return {}
    from .specs.step_cache_spec import parse_cli

    if "transformer" not in getattr(adapter, "component_names", ()):
        raise ValueError(f"--step-cache uses diffusers' caching hooks on a pipeline's transformer; "
                         f"{args.model} has none (Wan and Flux models do)")
    if not args.compile:
        raise ValueError("--step-cache is part of the plan, which --no-compile does not apply; drop --no-compile "
                         "(to run the blocks eager, e.g. for pab: --compile 'WanTransformerBlock=false')")
    return {"step_cache": {"transformer*": parse_cli(text)}}


def cmd_run(args) -> int:
    from . import distributed

    # --nproc N: check what is cheap here, then run this same command in N processes (torchrun).
    if (args.nproc or 1) > 1 and not distributed.is_launched():
        _check_run(args)
        return distributed.launch(args.nproc, args.argv)
    if distributed.init("cpu" if args.gpu == "cpu" else None):
        distributed.check_same(args.argv, "command lines")
    with distributed.quiet_unless_rank0():
        code = _cmd_run(args)
    distributed.shutdown()
    return code


def _check_run(args):
    """Everything about `run`'s arguments that can be checked before a build (a bad option
    costs nothing): (adapter, options, compile overrides, parallel-section fields or None)."""
    from . import adapters, distributed

    opts = dict(image=args.image, audio_out=args.audio_out, num_inference_steps=args.steps, height=args.height,
                width=args.width, num_frames=args.frames, max_new_tokens=args.max_new_tokens, seed=args.seed)
    opts.update(task=args.task, think=args.think or None)  # BAGEL: which task; reason first
    opts.update(audio=args.audio, voice=args.voice)  # Qwen3-Omni: audio prompt, speech voice
    adapter, variant = adapters.lookup(args.model)
    adapter.check_run(variant, opts, Path(args.out))
    overrides = parse_compile_overrides(args.compile_overrides)
    step_cache_override(args, adapter)  # validated before the build
    if overrides is not None and not args.compile:
        raise ValueError("--compile and --no-compile contradict each other; pass one")
    if args.spec_file is not None and not Path(args.spec_file).is_file():
        raise ValueError(f"--spec-file {args.spec_file!r}: no such file")
    world = distributed.world_size()
    if distributed.is_launched() and args.nproc not in (None, world):
        raise ValueError(f"--nproc {args.nproc} but this torchrun job has {world} processes; drop --nproc or match it")
    runs_cfg = getattr(adapter, "runs_cfg", lambda call: False)({**adapter.call_defaults(variant), **opts})
    par = distributed.run_parallel_fields(world if distributed.is_launched() else args.nproc,
                                          ulysses=args.ulysses, ring=args.ring, cfg=args.cfg_parallel,
                                          uneven=args.uneven, runs_cfg=runs_cfg)
    if par and args.gpu == "cpu" and (par.get("ulysses_degree", 1) > 1 or par.get("ring_degree", 1) > 1):
        raise ValueError("--ulysses / --ring use diffusers' context parallelism, which runs on GPUs; on --gpu cpu "
                         "only --cfg-parallel splits the work")
    if par is not None:  # the spec's [*.parallel] keys get the degrees (and --no-compile fences every compile key)
        par = distributed.parallel_overrides(args.spec_file or str(adapter.spec_path()), par, eager=not args.compile)
    return adapter, opts, overrides, par


def _cmd_run(args) -> int:
    from . import distributed, load

    adapter, opts, overrides, par = _check_run(args)
    compile_arg = False if not args.compile else overrides
    if par is not None:
        # The parallel section is part of the plan; --no-compile then fences off every compile key.
        compile_arg = overrides if args.compile else par.pop("compile")
        opts["seed"] = distributed.broadcast_seed(args.seed)  # one initial noise for every rank
    handle = load(args.model, gpu=args.gpu, weights=args.weights, dtype=args.dtype, compile=compile_arg,
                  overrides={**(par or {}), **step_cache_override(args, adapter)} or None,
                  precision="fp8" if args.fp8 else None, spec_file=args.spec_file,
                  cache_dir=args.cache_dir, memory_budget_gib=args.memory_budget)
    report = handle.report()
    if report is not None:
        n = sum(1 for r in report.regions if r.spec.enabled)
        _print(f"compiling {n} region(s) on the first call (spec {args.spec_file or handle.adapter.spec_file}, "
               f"[gpu.{handle.profile.name}]); later steps reuse the code")
        if args.step_cache is not None:
            _print(f"step cache: {report.step('step_cache').did}")
        offload = next((r for r in report.steps if r.step == "offload" and r.undo is not None), None)
        if offload is not None:  # weights stream: say what stays and what the copies cost
            _print(f"offload: {offload.did}")
    rank0 = distributed.rank() == 0  # rank 0 writes; the others compute their share, quietly
    written = generate_to(handle, prompt=args.prompt, out=args.out, progress=rank0, write=rank0, **opts)
    for path in written:
        _print(f"wrote {path}")
    if report is not None:  # after the output is written: a report problem never costs it
        _print(report.table())
        details = report.details()  # graph-break and recompile reasons, one per line
        if details:
            _print(details)
    return 0


def cmd_explain(args) -> int:
    from . import load

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory; pass a directory")
    handle = load(args.model, gpu=args.gpu, weights=args.weights, spec_file=args.spec_file)
    if args.entry is not None:
        handle.adapter.check_entry(args.entry)
    _print(f"explaining {handle.variant.name}: one call of its "
           f"{args.entry or handle.adapter.entry_points[0]!r} entry point on example inputs, compile trace on ...")
    ex = handle.explain(out, entry=args.entry)
    _print(ex.summary)
    _print(f"wrote {out}/ (start with {out / 'summary.md'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .specs.gpu_profiles import GPU_CHOICES

    from . import __version__

    p = argparse.ArgumentParser(prog="magi-zoo", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"magi-zoo {__version__}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="models and their variants").set_defaults(fn=cmd_list)

    s = sub.add_parser("spec", help="the resolved plan for a model on a GPU, as a table")
    s.add_argument("model")
    s.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    s.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    s.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="device memory budget for the offload plan (default: the GPU profile's memory)")
    s.add_argument("--recompute", default=None, metavar="POLICY",
                   help="the plan for training with this recompute policy: full, selective, none, auto:GIB")
    s.add_argument("--measure", action="store_true",
                   help="with --recompute auto:GIB: build the model here (random weights) and show auto's measured choice")
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
    r.add_argument("--audio", default=None, help="input audio .wav (Qwen3-Omni: through its audio encoder)")
    r.add_argument("--voice", default=None, help="speech voice (Qwen3-Omni: Ethan, Chelsie or Aiden)")
    r.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    r.add_argument("--dtype", default=None)
    r.add_argument("--steps", type=int, default=None)
    r.add_argument("--height", type=int, default=None)
    r.add_argument("--width", type=int, default=None)
    r.add_argument("--frames", type=int, default=None)
    r.add_argument("--max-new-tokens", type=int, default=None)
    r.add_argument("--task", default=None, type=str.lower,
                   help="BAGEL: generate (default without --image), edit (default with --image) or understand")
    r.add_argument("--think", action="store_true", default=None,
                   help="BAGEL: the model writes its reasoning before the answer or image")
    r.add_argument("--seed", type=int, default=None)
    r.add_argument("--no-compile", dest="compile", action="store_false", help="run eager")
    r.add_argument("--fp8", action="store_true",
                   help="fp8 matmuls in the regions the spec declares (cards with fp8 matmuls only)")
    r.add_argument("--step-cache", default=None, metavar="METHOD[:THRESHOLD]",
                   help="reuse work across denoising steps (diffusers' caching hooks): none, first_block, "
                        "mag_cache, taylorseer, pab, sea_cache; e.g. first_block:0.1 or "
                        "taylorseer:cache_interval=4,use_lite_mode=true")
    r.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    r.add_argument("--compile", dest="compile_overrides", action="append", default=None, metavar="KEY=JSON",
                   help="override one compile key (repeatable), e.g. 'WanTransformerBlock={\"dynamic\": false}'")
    r.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="device memory for weights + activations; what does not fit streams from host memory")
    r.add_argument("--cache-dir", default=None,
                   help="warm-start cache of compile artifacts (default: $MAGI_ZOO_CACHE_DIR)")
    r.add_argument("--nproc", type=int, default=None,
                   help="processes (GPUs) to spread the denoiser over; re-runs this command under torchrun")
    r.add_argument("--ulysses", type=int, default=None, help="Ulysses sequence-parallel degree (with --nproc)")
    r.add_argument("--ring", type=int, default=None, help="ring-attention sequence-parallel degree (with --nproc)")
    r.add_argument("--cfg-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="cond and uncond guidance branches on two processes (default with --nproc: on where "
                        "the model runs CFG)")
    r.add_argument("--uneven", action="store_true",
                   help="allow token counts that do not divide by the sequence degree (uneven shards)")
    r.set_defaults(fn=cmd_run)

    e = sub.add_parser("explain", help="one call with torch's compile trace on: graphs, breaks, guards, code")
    e.add_argument("model")
    e.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    e.add_argument("--out", default="magi-zoo-explain", help="folder to write (default: ./magi-zoo-explain)")
    e.add_argument("--entry", default=None, help="the entry point to call (default: the family's first)")
    e.add_argument("--weights", default=None, help="a local directory, a hub id, or 'random'")
    e.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    e.set_defaults(fn=cmd_explain)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what --nproc re-runs under torchrun
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("magi-zoo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # Every error ends as one line and exit 2, never a traceback (--debug shows it).
        # User errors (bad flag, path, weights, spec, no CUDA) carry a message that says
        # what to do; anything else is named by its type so a bug report can start there.
        if args.debug:
            raise
        from .distributed import rank_tag

        tag = rank_tag()  # "[rank 1/2] " in a multi-process run: which process failed
        text = e.args[0] if isinstance(e, KeyError) and e.args else e  # KeyError's str() adds quotes
        msg = _one_line(text) or type(e).__name__
        if isinstance(e, (ValueError, TypeError, KeyError, OSError, RuntimeError, NotImplementedError, ImportError)):
            print(f"magi-zoo: error: {tag}{msg}", file=sys.stderr)
        else:
            print(f"magi-zoo: error: {tag}{type(e).__name__}: {msg} (magi-zoo --debug ... shows the traceback)",
                  file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
