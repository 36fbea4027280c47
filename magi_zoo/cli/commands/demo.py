"""`magi-zoo demo`: the offline CPU demo -- wan2.1-tiny (random weights) eager, then with its
plan applied and compiled, timed per denoising step and compared pixel by pixel."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from ... import zoo  # `zoo.load` looked up at call time: a patch of it reaches every command
from ...engine import format_table
from ..console import say

MODEL = "wan2.1-tiny"  # the embedded default: random weights, CPU, nothing downloaded


class Ticker:
    """Prints elapsed time every few seconds while a long first call (compile) runs."""

    def __init__(self, label: str, every: float = 5.0):
        self.label, self.every = label, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        t0 = time.perf_counter()
        while not self._stop.wait(self.every):
            say(f"  ... {self.label}: {time.perf_counter() - t0:.0f} s")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def timed_steps(handle, call: dict, seed: int):
    """Run the pipeline once; return (frames, per-step seconds)."""
    stamps = []

    def on_step(pipe, i, t, kw):
        stamps.append(time.perf_counter())
        return {}

    gen = torch.Generator(device="cpu").manual_seed(seed)
    t0 = time.perf_counter()
    out = handle(generator=gen, output_type="np", callback_on_step_end=on_step, **call)
    steps = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    return out.frames, steps


def repeat_steps(handle, call: dict, seed: int, repeats: int = 3):
    """The pipeline `repeats` times: (the last output, every step's seconds). More steps
    than one run has make the median steadier on a busy machine."""
    steps: list[float] = []
    for _ in range(repeats):
        out, s = timed_steps(handle, call, seed)
        steps += s
    return out, steps


def cmd_demo(args) -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    say(f"[1/4] building {MODEL} (random weights, offline) on CPU ...")
    handle = zoo.load(MODEL, gpu="cpu", compile=False)
    call = dict(handle.variant.call_defaults, prompt=args.prompt)
    n = call["num_inference_steps"]
    say(f"[2/4] eager run: {call['num_frames']} frames {call['height']}x{call['width']}, {n} steps, CFG")
    timed_steps(handle, call, args.seed)  # warm-up: first-call allocations, lazy init
    eager, eager_steps = repeat_steps(handle, call, args.seed)
    say(f"[3/4] applying the plan (spec {handle.adapter.spec_file}, section [gpu.cpu]) and compiling on first call ...")
    report = handle.apply_plan()
    for row in handle.plan.table():
        say(f"      {row['region']:<22} {row['method']:<8} {row['modules']:<26} {row['spec']}")
    t0 = time.perf_counter()
    with Ticker("compiling (inductor, C++ build on CPU)"):
        timed_steps(handle, call, args.seed)
    first = time.perf_counter() - t0
    say(f"      first compiled call: {first:.1f} s")
    compiled, comp_steps = repeat_steps(handle, call, args.seed)
    say("[4/4] results")
    say(report.table())
    details = report.details()
    if details:
        say(details)
    diff = float(np.max(np.abs(np.asarray(eager, dtype=np.float64) - np.asarray(compiled, dtype=np.float64))))
    e, c = float(np.median(eager_steps)), float(np.median(comp_steps))
    say(format_table([
        {"run": "eager", "s/step (median)": f"{e:.3f}", "first call s": "-"},
        {"run": "magi_zoo plan", "s/step (median)": f"{c:.3f}", "first call s": f"{first:.1f}"},
    ]))
    say(f"speedup per step: {e / c:.2f}x (median of {len(eager_steps)} steps each)   "
        f"max |eager - compiled| over output pixels: {diff:.2e}")
    say("(a tiny model's step is mostly Python and launch overhead, so this ratio says little about "
        "speed and moves with machine load; it shows the plumbing works -- GPU tables are in the README)")
    return 0
