"""The denoising loop as a user runs it: seconds per iteration with CFG, scheduler included.

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.denoise_loop --model wan2.1-i2v-14b-480p --steps 40
    python -m benchmarks.denoise_loop --model wan2.1-i2v-14b-480p --precision fp8 --steps 40
    python -m benchmarks.denoise_loop --smoke --out /tmp/loop       # CPU, tiny: the script works

What LightX2V's table reports (s/it, 40 steps, CFG, 1 GPU) measured the same way here: the
pipeline is called with `output_type="latent"`, and a step-end callback synchronises and
stamps the time after every step, so one iteration = both CFG forwards + the scheduler
step + the pipeline's own per-step work. Reported: the median and mean s/it over steps 2..N
(step 1 also carries the prompt / image encoding, reported as `pre_loop_s`), the loop total,
and the VAE decode of the latents, timed separately. Random weights at the published config
(`weights="random"`), bf16, the shipped plan for the card (`gpu="auto"`), optionally
`precision="fp8"`. A first call with 2 steps compiles before anything is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks import common


def _image(h, w):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def main(argv=None):
    import torch

    import magi_zoo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-i2v-14b-480p")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=None,
                    help="results folder (default: benchmarks/results/<the model's topic>)")
    common.add_commit_argument(ap)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.model, args.steps, args.height, args.width, args.frames = "wan2.1-tiny", 4, 32, 32, 5
    kw = {"precision": "fp8"} if args.precision == "fp8" else {}
    t0 = time.perf_counter()
    h = magi_zoo.load(args.model, gpu="auto" if cuda else "cpu", weights="random", device=device,
                      **({} if cuda else {"compile": {"": {"backend": "eager"}}}), **kw)
    build_s = time.perf_counter() - t0
    call = dict(prompt="a cat surfing a wave at sunset", height=args.height, width=args.width,
                num_frames=args.frames, guidance_scale=args.guidance, output_type="latent")
    if h.variant.config.get("image_encoder"):  # image-to-video: the first frame
        call["image"] = _image(args.height, args.width)
    h.pipe.set_progress_bar_config(disable=True)
    stamps: list[float] = []

    def on_step_end(pipe, i, t, kwargs):
        common.sync(device)
        stamps.append(time.perf_counter())
        return kwargs

    with torch.no_grad():
        _, first_s = common.first_call(lambda: h(**call, num_inference_steps=2,
                                                 generator=torch.Generator("cpu").manual_seed(0)), device)
        stamps.clear()
        common.sync(device)
        start = time.perf_counter()
        out = h(**call, num_inference_steps=args.steps, generator=torch.Generator("cpu").manual_seed(0),
                callback_on_step_end=on_step_end)
        common.sync(device)
        total = time.perf_counter() - start
        latents = out.frames if hasattr(out, "frames") else out[0]
        per_step = [b - a for a, b in zip(stamps, stamps[1:])]
        vae = h.pipe.vae
        lat = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(lat)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(lat)
        _, decode_s = common.first_call(lambda: vae.decode(lat / std + mean, return_dict=False)[0], device)
    rep = h.report()
    env = common.environment(device)
    row = {"model": args.model, "precision": args.precision, "steps": args.steps, "cfg": args.guidance,
           "shape": f"{args.height}x{args.width}x{args.frames}",
           "s_per_it_median": round(statistics.median(per_step), 3) if per_step else None,
           "s_per_it_mean": round(statistics.mean(per_step), 3) if per_step else None,
           "pre_loop_s": round(stamps[0] - start, 3) if stamps else None,
           "loop_total_s": round(total, 2), "vae_decode_s": round(decode_s, 2),
           "first_call_2_steps_s": round(first_s, 2), "build_s": round(build_s, 1),
           "peak_gib": common.gib(torch.cuda.max_memory_allocated()) if cuda else None,
           "frames_compiled": rep.frames, "graph_breaks": rep.graph_breaks,
           "recompiles": sum(len(r.counters.recompiles) for r in rep.regions)}
    print("[bench]", row, flush=True)
    tag = common.card_tag(env, cuda)
    stem = f"denoise_loop_{args.model}_{args.precision}_{args.steps}steps_{tag}"
    cols = list(row)
    md = (f"# Denoising loop: {args.model}, {args.steps} steps, CFG {args.guidance}\n\n{common.env_line(env)}\n\n"
          f"command: `python -m benchmarks.denoise_loop {' '.join(argv or sys.argv[1:])}`\n\n"
          f"{common.results_table([row], cols)}\n\nper-step seconds: {[round(s, 3) for s in per_step]}\n")
    out = args.out or common.results_dir(common.model_topic(args.model))
    for p in common.write_results(out, stem, {"environment": env, "row": row, "per_step_s": per_step}, md):
        print("wrote", p)


if __name__ == "__main__":
    main()
