"""PSNR of an 8-step decoded Wan video, fp8 against bf16 (issue 9's quality gate).

    python -m benchmarks.fp8_quality --model wan2.1-t2v-1.3b --weights random --steps 8 \
        --device cuda --gpu h100
    python -m benchmarks.fp8_quality --weights /path/to/Wan2.1-T2V-1.3B-Diffusers --gpu h100 ...
    python -m benchmarks.fp8_quality --smoke --out /tmp/fp8_quality     # CPU plumbing, see below

Two generations with the same seed, prompt and shape (default: the variant's, 480x832x81
for Wan2.1-T2V-1.3B, CFG on): `magi_zoo.load(model, gpu=...)` with the shipped spec (bf16)
and `magi_zoo.load(..., precision="fp8")`, built one after the other (the first is freed
before the second is built). Each runs the whole pipeline to latents, then the VAE decode.
Recorded: relative L2 of the fp8 latents against the bf16 ones; PSNR (dB) and SSIM of the
decoded video per frame and their means (benchmarks/video_quality.py); the seconds of each
generation (informative: one run, compile included); what the precision step did.

With random weights the numbers say how far fp8 moved the output through 8 steps of a
random network, not how a real video looks: recorded and printed. `--smoke` runs
wan2.1-tiny on CPU, where fp8 is refused (no fp8 matmuls on the CPU profile): it compares
bf16 against bf16 to test the plumbing only, and says so in every output.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.video_quality import RANDOM_WEIGHTS_NOTE, compare_videos, decode_wan, rel_l2

SMOKE_NOTE = ("SMOKE / PLUMBING ONLY: fp8 is refused on CPU (the cpu profile has no fp8 matmuls), so the "
              "'fp8' run here is bf16 again and the two must be identical; run on a GPU with fp8 for the measurement")


def _generate(handle, call: dict[str, Any], steps: int, seed: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    common.sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        latents = handle(**call, num_inference_steps=steps, generator=g, output_type="latent").frames
    common.sync(device)
    gen_s = time.perf_counter() - t0
    video = decode_wan(handle.pipe, latents)
    return latents, video, gen_s


def run(args) -> dict[str, Any]:
    import torch

    import magi_zoo

    device = torch.device(args.device)
    env = common.environment(device)
    print(f"[bench] {common.env_line(env)}", flush=True)
    runs = [("bf16", None), ("fp8", None if args.smoke else "fp8")]
    out: dict[str, Any] = {}
    call = None
    for label, precision in runs:
        h = magi_zoo.load(args.model, gpu=args.gpu, weights=args.weights, device=args.device, precision=precision)
        if h.adapter.family != "wan":
            raise SystemExit(f"benchmarks.fp8_quality decodes Wan videos; {args.model} is {h.adapter.family}")
        if call is None:
            call = {**h.call_defaults(), "prompt": args.prompt}
            for k, v in (("height", args.height), ("width", args.width), ("num_frames", args.frames),
                         ("guidance_scale", args.guidance)):
                if v is not None:
                    call[k] = v
            call.pop("num_inference_steps", None)
        latents, video, gen_s = _generate(h, call, args.steps, args.seed, device)
        rep = h.report()
        out[label] = {"latents": latents.cpu(), "video": video.cpu(), "gen_s": round(gen_s, 2),
                      "precision_step": rep.step("precision").did if rep is not None else "not applied",
                      "random": h.variant.tiny or args.weights == "random"}
        print(f"[bench] {label}: generation {gen_s:.1f} s; precision step: {out[label]['precision_step']}", flush=True)
        del h, rep, latents, video
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ref, test = out["bf16"], out["fp8"]
    quality = compare_videos(test["video"].to(device), ref["video"].to(device))
    rec = {
        "what": "8-step (by default) Wan generation decoded to video, fp8 (precision='fp8') against bf16 "
                "(the shipped spec), same seed",
        "model": args.model, "weights": args.weights or ("random" if out["bf16"]["random"] else "hub"),
        "shape": {"height": call["height"], "width": call["width"], "frames": call["num_frames"]},
        "steps": args.steps, "guidance_scale": call.get("guidance_scale"), "seed": args.seed,
        "smoke": args.smoke, "note": SMOKE_NOTE if args.smoke else None,
        "quality_note": RANDOM_WEIGHTS_NOTE if ref["random"] else "checkpoint weights",
        "latent_rel_l2": round(rel_l2(test["latents"], ref["latents"]), 6),
        **quality,
        "gen_s": {"bf16": ref["gen_s"], "fp8": test["gen_s"]},
        "precision_step": {"bf16": ref["precision_step"], "fp8": test["precision_step"]},
        "env": env,
    }
    return rec


def markdown(rec: dict[str, Any]) -> str:
    s = rec["shape"]
    lines = [f"# fp8 vs bf16, decoded video: {rec['model']} {s['height']}x{s['width']}x{s['frames']}, "
             f"{rec['steps']} steps, CFG {rec['guidance_scale']}, seed {rec['seed']}", "",
             common.env_line(rec["env"]), ""]
    if rec["note"]:
        lines += [f"**{rec['note']}**", ""]
    lines += [f"**{rec['quality_note']}**", "",
              "| latent rel. L2 | PSNR mean (dB) | PSNR min (dB) | identical frames | SSIM mean | SSIM min |",
              "|---|---|---|---|---|---|",
              f"| {rec['latent_rel_l2']} | {rec['psnr_mean_db']} | {rec['psnr_min_db']} | {rec['identical_frames']} "
              f"| {rec['ssim_mean']} | {rec['ssim_min']} |", "",
              "PSNR per frame (dB; None = identical): " + ", ".join(str(v) for v in rec["psnr_per_frame_db"]), "",
              f"precision step: bf16: {rec['precision_step']['bf16']}; fp8: {rec['precision_step']['fp8']}", "",
              f"generation seconds (one run each, compile included): {rec['gen_s']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="wan2.1-t2v-1.3b")
    p.add_argument("--weights", default="random", help="'random' (published config) or a local checkpoint dir")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the variant's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a corgi surfing a wave at sunset, cinematic")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu", default="auto")
    p.add_argument("--smoke", action="store_true", help="wan2.1-tiny on CPU, bf16 vs bf16: plumbing only")
    p.add_argument("--out", default=common.results_dir("quality"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.smoke:
        args.model, args.weights, args.device, args.gpu, args.steps = "wan2.1-tiny", None, "cpu", "cpu", 4
    rec = run(args)
    s = rec["shape"]
    stem = f"fp8_quality_{args.model}_{s['height']}x{s['width']}x{s['frames']}_{rec['steps']}steps"
    if args.smoke:
        stem += "_smoke"
    elif args.gpu not in ("auto", "cpu"):
        stem += f"_{args.gpu}"
    common.publish(Path(args.out), stem, rec, markdown(rec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
