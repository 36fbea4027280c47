"""A whole image-to-video generation at LightX2V's benchmark workload, timed phase by phase.

    pip install -e ".[hopper,lora]"     # on a CUDA machine (FA3 forward kernel; torchao for no row here)
    python -m benchmarks.whole_generation                                   # every row, 480P, 40 steps
    python -m benchmarks.whole_generation --model wan2.1-i2v-14b-720p       # 720P (no distilled row)
    python -m benchmarks.whole_generation --steps 4 --frames 21             # a short GPU smoke run
    python -m benchmarks.whole_generation --smoke --out /tmp/wg             # CPU, tiny: the script works

The workload is LightX2V's (ModelTC/LightX2V docs/EN/source/getting_started/benchmark_source.md,
configs/bench/lightx2v_*.json): Wan2.1-I2V-14B-480P, 832x480, 81 frames, 40 steps, CFG 5, shift
5 -- its distilled rows 4 steps without CFG (configs/bench/lightx2v_5_distill.json). One call of
the pipeline per row, as a user makes it (prompt and image in, an .mp4 out), after a 2-step call
at the same shape that compiles. Per phase, synchronised: the text encoder, the image encoder,
the VAE encode of the first frame, every denoising step (both CFG forwards and the scheduler:
a step-end callback stamps each), the VAE decode, writing the frames; and the whole call.

Rows (each in a fresh process, so one row's memory and compile caches never reach the next):
- ``bf16``: the shipped plan for the card (`gpu="auto"`), random weights at the published config;
- ``fp8``: the same with `precision="fp8"`;
- ``fp8_cache``: fp8 and a step cache (`--cache`, diffusers' hooks through the plan), with the
  PSNR / SSIM of its decoded frames against the uncached fp8 row's (same seed, same weights);
- ``distill``: LightX2V's 4-step distilled variant (`--distill-model`), fp8, its call defaults;
- ``diffusers``: the diffusers pipeline itself, the baseline: regional compile of the repeated
  blocks on the same FA3 kernel (`benchmarks/baselines.py`), bf16.

Random weights (`--weights random`, the default) make a video of noise but the same work as the
checkpoint; the step cache's quality numbers need the checkpoint (`--weights DIR`, and for the
distilled row `--distill-weights DIR`) to mean anything, and the table says which was used.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

ROWS = ("bf16", "fp8", "fp8_cache", "distill", "diffusers")
PROMPT = ("Summer beach vacation style, a white cat wearing sunglasses sits on a surfboard. The fluffy-furred "
          "feline gazes directly at the camera with a relaxed expression.")  # LightX2V's I2V example prompt


def _image(h: int, w: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


class PhaseTimer:
    """Synchronised wall time of named calls (`wrap(obj, method, phase)`), with a timeline."""

    def __init__(self, device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.pre_loop_end = 0.0  # when the last phase other than the decode ended: the loop starts after it
        self.decode_start = self.decode_end = 0.0  # the VAE decode's bounds: what comes after it is post-processing
        self._undo: list = []

    def wrap(self, obj, method: str, phase: str) -> None:
        if obj is None:
            return
        fn = getattr(obj, method)

        def timed(*a, **kw):
            common.sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            common.sync(self.device)
            end = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + end - t0
            if phase != "vae_decode_s":
                self.pre_loop_end = end
            else:
                self.decode_start, self.decode_end = t0, end
            return out

        setattr(obj, method, timed)
        self._undo.append((obj, method))

    def reset(self) -> None:
        self.seconds.clear()
        self.pre_loop_end = self.decode_start = self.decode_end = 0.0

    def remove(self) -> None:
        for obj, method in self._undo:
            obj.__dict__.pop(method, None)


def _build(row: str, args, device, cuda: bool):
    """(handle or None, pipeline, call defaults, what was done) for one row."""
    import magi_zoo

    gpu = "auto" if cuda else "cpu"
    plan: dict[str, Any] = {} if cuda else {"compile": {"WanTransformerBlock": {"backend": "eager"}}}  # CPU smoke
    if row == "diffusers":
        from benchmarks import baselines

        why = baselines.missing_reason("diffusers_regional_fa3", device.type)
        if why is not None:
            raise RuntimeError(f"refused: {why}")
        h = magi_zoo.load(args.model, gpu=gpu, weights=args.weights, device=device, compile=False)
        done = baselines.prepare("diffusers_regional_fa3", h.pipe.transformer, {})
        return None, h.pipe, h.call_defaults(), f"diffusers pipeline, {done['attention']}, regional compile"
    model, weights = args.model, args.weights
    kw: dict[str, Any] = {"precision": "fp8"} if row != "bf16" and cuda else {}
    if row == "fp8_cache":
        from magi_zoo.specs.step_cache_spec import parse_cli

        kw["overrides"] = {"step_cache": {"transformer*": parse_cli(args.cache)}}
    if row == "distill":
        model, weights = args.distill_model, args.distill_weights
    h = magi_zoo.load(model, gpu=gpu, weights=weights, device=device, **({"compile": plan["compile"]} if plan else {}),
                      **kw)
    defaults = h.call_defaults()
    if row == "distill" and "distill" not in h.variant.config:  # the CPU smoke's tiny model: LightX2V's sampler
        from magi_zoo.adapters.wan import distill

        distill.install(h.pipe, distill.CONFIG)
        defaults.update(distill.CALL)
    return h, h.pipe, defaults, f"magi_zoo {h.variant.name}, {h.report().step('precision').did}"


def run_row(row: str, args) -> dict[str, Any]:
    """One row: build, a 2-step compile call, the timed call with its phases, the frames saved."""
    import numpy as np
    import torch

    from magi_zoo.adapters.base import Output
    from magi_zoo.cli.writers import write_output

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    handle, pipe, defaults, what = _build(row, args, device, cuda)
    build_s = time.perf_counter() - t0
    pipe.set_progress_bar_config(disable=True)
    call = {k: defaults[k] for k in ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
                                     "guidance_scale_2", "max_sequence_length") if k in defaults}
    if args.frames:
        call["num_frames"] = args.frames
    if args.steps and row != "distill":  # the distilled model runs its own 4 steps
        call["num_inference_steps"] = args.steps
    call["prompt"] = PROMPT
    if getattr(pipe, "image_encoder", None) is not None:  # image-to-video: the first frame
        call["image"] = _image(call["height"], call["width"])
    timer = PhaseTimer(device)
    timer.wrap(pipe.text_encoder, "forward", "text_encoder_s")
    timer.wrap(getattr(pipe, "image_encoder", None), "forward", "image_encoder_s")
    timer.wrap(pipe.vae, "encode", "vae_encode_s")
    timer.wrap(pipe.vae, "decode", "vae_decode_s")
    stamps: list[float] = []

    def on_step_end(p, i, t, kwargs):
        common.sync(device)
        stamps.append(time.perf_counter())
        return kwargs

    fn = handle if handle is not None else pipe
    with torch.no_grad():
        _, warm_s = common.first_call(lambda: fn(**{**call, "num_inference_steps": 2}, output_type="np",
                                                 generator=torch.Generator("cpu").manual_seed(0)), device)
        timer.reset()
        common.sync(device)
        start = time.perf_counter()
        out = fn(**call, output_type="np", generator=torch.Generator("cpu").manual_seed(args.seed),
                 callback_on_step_end=on_step_end)
        frames = list(out.frames[0])
        common.sync(device)
        t_write = time.perf_counter()
        if not args.no_write:
            tmp = Path(tempfile.mkdtemp(prefix="whole_generation_"))
            write_output(Output("video", frames, fps=16), tmp / f"{row}.mp4")
        end = time.perf_counter()
    # step 1 starts when the last phase before the loop ended (the VAE encode of the first frame
    # for I2V, else the text encoder; the latents' set-up counts to step 1), every later step at
    # the previous step's stamp
    loop_start = timer.pre_loop_end or start
    steps_s = [b - a for a, b in zip([loop_start, *stamps], stamps)]
    row_rec: dict[str, Any] = {
        "row": row, "what": what, "steps": len(stamps), "guidance": call.get("guidance_scale"),
        "shape": f"{call['height']}x{call['width']}x{call['num_frames']}",
        "whole_s": round(end - start, 2),
        **{k: round(v, 3) for k, v in timer.seconds.items()},
        "denoise_s": round(sum(steps_s), 2),
        # the call's time outside every timed phase, before the loop (image and prompt
        # preprocessing, latents set-up), between the last step and the decode (latents
        # unscaled), and after the decode (the frames converted to numpy and copied to the host)
        "untimed_before_loop_s": round(loop_start - start - sum(v for k, v in timer.seconds.items()
                                                               if k != "vae_decode_s"), 3),
        "untimed_before_decode_s": round(timer.decode_start - stamps[-1], 3) if stamps and timer.decode_start else None,
        "untimed_after_decode_s": round(t_write - timer.decode_end, 3) if timer.decode_end else None,
        "s_per_step_median": round(float(np.median(steps_s)), 3) if steps_s else None,
        "write_frames_s": None if args.no_write else round(end - t_write, 3),
        "steps_s": [round(s, 3) for s in steps_s],
        "warmup_call_s": round(warm_s, 1), "build_s": round(build_s, 1),
        "peak_gib": common.gib(torch.cuda.max_memory_allocated()) if cuda else None,
    }
    rep = handle.report() if handle is not None else None
    if rep is not None:
        row_rec.update(frames_compiled=rep.frames, graph_breaks=rep.graph_breaks, recompiles=rep.recompiles)
    frames_file = Path(args.frames_dir) / f"{row}.npy"
    np.save(frames_file, (np.stack(frames) * 255).round().astype(np.uint8))
    row_rec["frames_file"] = str(frames_file)
    timer.remove()
    return row_rec


def _quality(rows: dict[str, dict]) -> None:
    """fp8_cache's decoded frames against the uncached fp8 row's (and bf16's): PSNR / SSIM."""
    import numpy as np
    import torch

    from benchmarks.video_quality import compare_videos

    def video(r):
        return torch.from_numpy(np.load(r["frames_file"])).permute(0, 3, 1, 2).float() / 255

    cached = rows.get("fp8_cache")
    if not cached or cached.get("status") != "ok":
        return
    for ref in ("fp8", "bf16"):
        # the record is written after every row: a distance once computed is kept, not
        # recomputed from two 81-frame videos at each later row
        if rows.get(ref, {}).get("status") == "ok" and f"psnr_vs_{ref}_db" not in cached:
            q = compare_videos(video(cached), video(rows[ref]))
            # every frame equal (the cache skipped nothing): PSNR is infinite, written "inf"
            cached[f"psnr_vs_{ref}_db"] = "inf" if q["psnr_mean_db"] is None else q["psnr_mean_db"]
            cached[f"ssim_vs_{ref}"] = q["ssim_mean"]


def _publish(args, argv, env, out: Path, stem: str, rows: list[str], results: dict[str, dict], *,
             complete: bool) -> None:
    """The record of the rows run so far (the cached row's distance to the uncached ones where
    both ran), as JSON and markdown; `complete` False marks a run still going or cut short."""
    _quality(results)
    ordered = [results[r] for r in rows if r in results]
    cols = ["row", "status", "whole_s", "text_encoder_s", "image_encoder_s", "vae_encode_s", "denoise_s",
            "s_per_step_median", "steps", "vae_decode_s", "untimed_before_loop_s", "untimed_before_decode_s",
            "untimed_after_decode_s", "write_frames_s", "psnr_vs_fp8_db", "ssim_vs_fp8",
            "psnr_vs_bf16_db", "recompiles", "peak_gib"]
    md = (f"# Whole generation: {args.model}, LightX2V's workload\n\n{common.env_line(env)}\n\n"
          f"command: `python -m benchmarks.whole_generation {' '.join(argv if argv is not None else sys.argv[1:])}`"
          + ("" if complete else f" (incomplete: {len(ordered)} of {len(rows)} rows run so far)")
          + f"\n\nweights: {args.weights or 'random (tiny)'}; distilled: {args.distill_model} ({args.distill_weights})"
          + ("; frames not written (--no-write): `whole_s` has no write phase" if args.no_write else "")
          + f"\n\n{common.results_table(ordered, cols)}\n\n"
          + "\n".join(f"- {r['row']}: {r.get('what') or r.get('error')}" for r in ordered) + "\n")
    record = {"what": "one whole I2V generation per row, per phase (docs: benchmarks/whole_generation.py)",
              "complete": complete, "model": args.model, "weights": args.weights,
              "distill_model": args.distill_model, "distill_weights": args.distill_weights, "cache": args.cache,
              "seed": args.seed, "smoke": args.smoke,
              "frames_written": not args.no_write, "environment": env, "rows": ordered}
    common.publish(out, stem, record, md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-i2v-14b-480p")
    ap.add_argument("--weights", default="random", help="'random' (published config) or a checkpoint directory")
    ap.add_argument("--distill-model", default="wan2.1-i2v-14b-480p-distill")
    ap.add_argument("--distill-weights", default="random")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the variant's, 40)")
    ap.add_argument("--frames", type=int, default=None, help="frames (default: the variant's, 81)")
    ap.add_argument("--cache", default="first_block:0.1", help="the fp8_cache row's step cache (--step-cache syntax)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: the model's topic)")
    ap.add_argument("--label", default=None,
                    help="a word in the results file's name, so runs of different rows do not overwrite each other")
    ap.add_argument("--no-write", action="store_true",
                    help="do not write the .mp4 (a machine without an H.264 encoder); the record says so")
    ap.add_argument("--smoke", action="store_true", help="CPU, wan2.1-tiny, rows in this process")
    ap.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child process: this row only
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--frames-dir", default=None, help=argparse.SUPPRESS)
    common.add_commit_argument(ap)
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = sorted(set(rows) - set(ROWS))
    if bad:
        raise SystemExit(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    if args.smoke:
        args.model, args.distill_model, args.weights, args.distill_weights = "wan2.1-tiny", "wan2.1-tiny", None, None
    if args.row is not None:  # the child: one row, its record to --result-file
        import json

        try:
            rec = {"status": "ok", **run_row(args.row, args)}
        except Exception as e:  # the parent records the row as failed or refused, and goes on
            msg = f"{type(e).__name__}: {e}"
            rec = {"row": args.row, "status": "refused" if msg.startswith("RuntimeError: refused") else "error",
                   "error": msg[:500]}
        Path(args.result_file).write_text(json.dumps(rec, default=str))
        return 0
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.label is not None and not args.label.replace("-", "").isalnum():
        raise SystemExit(f"--label {args.label!r}: letters, digits and '-' only (it names the results file)")
    from magi_zoo.cli import writers

    if not args.no_write and (why := writers.mp4_writer_missing()) is not None:  # before any model is built
        raise SystemExit(f"the rows end by writing an .mp4, which {why}; install it, or pass --no-write "
                         "(the record then says the frames were not written)")
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    env = common.environment(device)
    print(f"[bench] {common.env_line(env)}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="whole_generation_"))
    args.frames_dir = str(work)
    tag = common.card_tag(env, cuda)
    # named by the undistilled rows' step count (the distilled row runs its own 4), known before
    # any row runs: the file is rewritten after every row under the same name
    from magi_zoo.adapters import lookup

    adapter, variant = lookup(args.model)
    steps = args.steps or adapter.call_defaults(variant).get("num_inference_steps", "default")
    stem = f"whole_generation_{args.model}_{steps}steps{'_' + args.label if args.label else ''}_{tag}"
    out = args.out or common.results_dir(common.model_topic(args.model))
    results: dict[str, dict] = {}
    for i, row in enumerate(rows):
        print(f"[bench] [{i + 1}/{len(rows)}] {row}", flush=True)
        if args.smoke:  # in this process: the plumbing, quickly
            args.row, args.result_file = row, str(work / f"{row}.json")
            main_args = [a for a in (argv if argv is not None else sys.argv[1:])]
            main([*main_args, "--row", row, "--result-file", args.result_file, "--frames-dir", str(work)])
            import json

            results[row] = json.loads(Path(args.result_file).read_text())
        else:
            child = [*(argv if argv is not None else sys.argv[1:]), "--row", row,
                     "--result-file", str(work / f"{row}.json"), "--frames-dir", str(work)]
            results[row] = common.run_isolated("benchmarks.whole_generation", child, timeout=3600,
                                               result_file=work / f"{row}.json")
            results[row].setdefault("row", row)
        print(f"[bench] {row}: {results[row].get('whole_s', results[row].get('error'))}", flush=True)
        # Written after every row: a run cut short (a time limit, a crash) keeps the rows it
        # finished, marked incomplete; the last write is the whole run.
        _publish(args, argv, env, out, stem, rows, results, complete=i + 1 == len(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
