"""Step caching on a whole Wan generation: speed-up and quality against no caching.

    python -m benchmarks.step_cache --model wan2.1-t2v-1.3b --weights random \
        --height 480 --width 832 --frames 81 --steps 30 --device cuda --gpu h100 \
        --method first_block:0.05 --method first_block:0.1 \
        --method taylorseer:use_lite_mode=true,cache_interval=3
    python -m benchmarks.step_cache --smoke --out /tmp/step_cache     # wan2.1-tiny on CPU

One process builds the model once (`magi_zoo.load` with the shipped spec for the card,
compile regions included) and applies the plan again per method with a ``step_cache``
section on the transformer (`magi_zoo.apply`; the compiled blocks' code is reused, and
the counters say whether anything recompiled). Per method, with the same seed and prompt:

- the denoising loop (text encoding, every step with CFG, the scheduler) is timed as one
  whole generation with ``output_type="latent"``, synchronised, `--runs` times (median);
- the VAE decode of those latents is timed apart (it is the same work for every method);
- the block calls the engine booked (the repeated blocks' compiled region): the fraction
  of block work the cache really skipped;
- quality against the no-cache generation: relative L2 of the latents, PSNR and SSIM of
  the decoded video per frame and their means (benchmarks/video_quality.py).

Before the timed runs one short generation (2 steps) at the same shape compiles the
blocks, so no method's time contains the cold compile. With random weights the quality
numbers say how far caching moved the output, not how a real video looks (printed and
recorded); pass a checkpoint with --weights for real quality. Output: JSON + markdown
under --out (`step_cache_<model>_<shape>[_<gpu>]`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.video_quality import RANDOM_WEIGHTS_NOTE, compare_videos, decode_wan, rel_l2

DEFAULT_METHODS = ("first_block:0.05", "first_block:0.1", "taylorseer:use_lite_mode=true,cache_interval=3")


def _layers(handle, step_cache: dict | None, backend: str | None):
    """The handle's spec layers, on `backend` if given, with a user step_cache section."""
    from magi_zoo.specs import PlanLayer, with_backend

    layers = list(handle.layers)
    if backend:
        layers = with_backend(layers, backend)
    if step_cache is None:
        return layers
    top = PlanLayer(step_cache={"transformer": step_cache})
    if layers and layers[-1][0] == "user":
        return [*layers[:-1], ("user", top.merged_over(layers[-1][1]))]
    return [*layers, ("user", top)]


def _block_calls(report) -> int:
    """Calls of the compiled repeated-block regions (the transformer's blocks)."""
    return sum(r.calls for r in report.regions if "Block" in (r.cls_name or ""))


def run(args) -> dict[str, Any]:
    import torch

    import magi_zoo
    from magi_zoo.engine import counters
    from magi_zoo.specs.step_cache_spec import parse_cli

    device = torch.device(args.device)
    methods = ["none", *(args.method or DEFAULT_METHODS)]
    specs = {m: (None if m == "none" else parse_cli(m)) for m in methods}  # validated before the build
    handle = magi_zoo.load(args.model, gpu=args.gpu, weights=args.weights, compile=False, device=args.device)
    if handle.adapter.family != "wan":
        raise SystemExit(f"benchmarks.step_cache measures Wan generations; {args.model} is {handle.adapter.family}")
    env = common.environment(device)
    print(f"[bench] {common.env_line(env)}", flush=True)
    call = dict(prompt=args.prompt, height=args.height, width=args.width, num_frames=args.frames,
                guidance_scale=args.guidance, output_type="latent")
    call = {**handle.call_defaults(), **{k: v for k, v in call.items() if v is not None}}
    call.pop("num_inference_steps", None)

    def generate(steps: int) -> tuple[torch.Tensor, float]:
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        common.sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = handle(**call, num_inference_steps=steps, generator=g)
        common.sync(device)
        return out.frames, time.perf_counter() - t0

    rows, ref_latents, ref_video = [], None, None
    for m in methods:
        rep = magi_zoo.apply(handle.modules, layers=_layers(handle, specs[m], args.backend), gpu=handle.profile,
                             preparations=handle.adapter.preparations(handle.pipe))
        row: dict[str, Any] = {"method": m, "step_cache": rep.step("step_cache").did}
        if m == "none":
            _, cold = generate(2)  # compiles the blocks at this shape; every method reuses the code
            row["compile_warmup_s"] = round(cold, 2)
        before = counters.snapshot()
        calls0 = _block_calls(rep)
        times, latents = [], None
        for _ in range(args.runs):
            latents, s = generate(args.steps)
            times.append(s)
        d = counters.delta(before)
        row.update(gen_s=round(statistics.median(times), 3), gen_s_all=[round(t, 3) for t in times],
                   block_calls_per_gen=(_block_calls(rep) - calls0) // args.runs,
                   frames_compiled=d.frames, graph_breaks=sum(d.graph_breaks.values()), recompiles=len(d.recompiles))
        common.sync(device)
        t0 = time.perf_counter()
        video = decode_wan(handle.pipe, latents)
        common.sync(device)
        row["decode_s"] = round(time.perf_counter() - t0, 3)
        if m == "none":
            ref_latents, ref_video = latents, video
            row.update(speedup=1.0, latent_rel_l2=0.0)
        else:
            row["speedup"] = round(rows[0]["gen_s"] / row["gen_s"], 3)
            row["latent_rel_l2"] = round(rel_l2(latents, ref_latents), 5)
            row.update(compare_videos(video, ref_video))
        full = rows[0]["block_calls_per_gen"] if rows else row["block_calls_per_gen"]
        row["block_work"] = round(row["block_calls_per_gen"] / max(1, full), 3)
        rows.append(row)
        print(f"[bench] {m}: {row['gen_s']} s/generation ({row.get('speedup')}x), block work "
              f"{row['block_work']:.0%}, PSNR {row.get('psnr_mean_db', '-')} dB, SSIM {row.get('ssim_mean', '-')}, "
              f"recompiles {row['recompiles']}", flush=True)
    magi_zoo.remove(handle.modules)
    random = handle.variant.tiny or args.weights == "random"
    return {
        "what": "whole Wan generation (denoising loop with CFG, scheduler, text encoder; VAE decode timed apart) "
                "with diffusers' step caching through the step_cache plan section, against no caching",
        "model": args.model, "weights": args.weights or ("random" if handle.variant.tiny else "hub"),
        "shape": {"height": call["height"], "width": call["width"], "frames": call["num_frames"]},
        "steps": args.steps, "guidance_scale": args.guidance, "seed": args.seed, "runs": args.runs,
        "smoke": args.smoke, "backend": args.backend, "gpu_profile": handle.profile.name,
        "quality_note": RANDOM_WEIGHTS_NOTE if random else "checkpoint weights",
        "env": env, "rows": rows,
    }


def markdown(rec: dict[str, Any]) -> str:
    cols = ["method", "gen_s", "speedup", "block_work", "decode_s", "latent_rel_l2", "psnr_mean_db", "psnr_min_db",
            "ssim_mean", "ssim_min", "frames_compiled", "recompiles"]
    shape = rec["shape"]
    head = [f"# Step caching: {rec['model']} {shape['height']}x{shape['width']}x{shape['frames']}, "
            f"{rec['steps']} steps, CFG {rec['guidance_scale']}",
            "", common.env_line(rec["env"]), "",
            f"gen_s: one whole generation to latents, median of {rec['runs']} run(s); speedup vs method none; "
            "block_work: block calls / no-cache block calls; quality against the no-cache generation, same seed.",
            "", f"**{rec['quality_note']}**", ""]
    if rec["smoke"]:
        head += ["**smoke run (tiny model, CPU): plumbing only, not a measurement**", ""]
    return "\n".join(head) + common.results_table(rec["rows"], cols) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="wan2.1-t2v-1.3b")
    p.add_argument("--weights", default="random", help="'random' (published config) or a local checkpoint dir")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a corgi surfing a wave at sunset, cinematic")
    p.add_argument("--method", action="append", default=None, metavar="METHOD[:THRESHOLD|:K=V,...]",
                   help=f"a --step-cache value, repeatable (default: {', '.join(DEFAULT_METHODS)}); "
                        "'none' always runs first as the reference")
    p.add_argument("--runs", type=int, default=1, help="timed generations per method (median)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu", default="auto")
    p.add_argument("--backend", default=None, help="put every compiled region on this backend (e.g. eager)")
    p.add_argument("--smoke", action="store_true", help="wan2.1-tiny on CPU, 6 steps, eager backend: plumbing")
    p.add_argument("--out", default=common.results_dir("step_cache"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.smoke:
        args.model, args.weights, args.device, args.gpu = "wan2.1-tiny", None, "cpu", "cpu"
        args.steps, args.backend = min(args.steps, 6), args.backend or "eager"
        args.method = args.method or ["first_block:0.2", "taylorseer:use_lite_mode=true,cache_interval=2"]
    rec = run(args)
    shape = rec["shape"]
    stem = f"step_cache_{args.model}_{shape['height']}x{shape['width']}x{shape['frames']}"
    if args.gpu not in ("auto", "cpu"):
        stem += f"_{args.gpu}"
    common.publish(Path(args.out), stem, rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
