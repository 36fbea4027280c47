"""One eager VAE decode at a model's benchmark resolution: the number behind a spec's choice
to keep its VAE eager (it runs once per image or video, against every denoising step).

    python -m benchmarks.vae_decode --model flux.1-dev --device cuda
    python -m benchmarks.vae_decode --model flux-tiny --device cpu --out /tmp/r   # CPU smoke run

Works for any zoo model whose pipeline has a `.vae` (Flux, Wan, BAGEL): random weights at
the published config (bf16 on CUDA, fp32 on CPU; a VAE the adapter keeps in fp32 stays so),
a random latent of the shape the VAE decodes at --height x --width (x --frames for video
VAEs; default: the variant's call defaults), batch 1. Cold first call, then >= 2 warm-up
and >= 5 timed decodes (CUDA events): median / min / max ms, peak GiB. Writes
vae_decode_<model>.json and .md under --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import common


def latent_shape(vae, height: int, width: int, frames: int | None) -> tuple[int, ...]:
    """(1, C, [F,] H/f, W/f): diffusers' image VAEs downsample 2x per extra block level; the
    video VAEs (Wan) name their spatial and temporal factors and keep the first frame apart."""
    cfg = vae.config
    channels = cfg.get("latent_channels") or cfg["z_dim"]
    f = cfg.get("scale_factor_spatial") or 2 ** (len(cfg["block_out_channels"]) - 1)
    if height % f or width % f:
        raise ValueError(f"height and width must be divisible by the VAE factor {f}; got {height}x{width}")
    t = cfg.get("scale_factor_temporal")
    lat_frames = () if t is None else ((((frames or 1) - 1) // t) + 1,)
    return (1, channels, *lat_frames, height // f, width // f)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="flux.1-dev")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None, help="video VAEs only")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=common.results_dir("vae_decode"))
    common.add_commit_argument(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known

    import torch

    import magi_zoo

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    handle = magi_zoo.load(args.model, gpu="auto" if device.type == "cuda" else "cpu", weights="random",
                           dtype=dtype, device=device, compile=False)
    vae = getattr(handle.pipe, "vae", None)
    if vae is None:
        raise SystemExit(f"{args.model}'s pipeline has no .vae")
    d = handle.variant.call_defaults
    height, width = args.height or d["height"], args.width or d["width"]
    frames = args.frames or d.get("num_frames")
    shape = latent_shape(vae, height, width, frames)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(*shape, generator=g).to(device=device, dtype=vae.dtype)
    decode = lambda: vae.decode(z, return_dict=False)[0]  # noqa: E731

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        image, first_s = common.first_call(decode, device)
        row = {"model": handle.variant.name, "latent": list(shape), "pixels": list(image.shape[2:]),
               "vae_dtype": str(vae.dtype), "first_call_s": round(first_s, 3),
               **common.time_calls(decode, device, warmup=args.warmup, runs=args.runs)}
    row["peak_gib"] = common.gib(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
    env = common.environment(device)
    record = {"env": env, "command": "python -m benchmarks.vae_decode " + " ".join(argv), "results": [row]}
    md = [f"# {row['model']}: one eager VAE decode", "", common.env_line(env), "",
          common.results_table([row], ["model", "latent", "pixels", "vae_dtype", "median_ms", "min_ms", "max_ms",
                                       "first_call_s", "peak_gib"])]
    common.write_results(Path(args.out), f"vae_decode_{row['model']}", record, "\n".join(md))
    print("\n".join(md), flush=True)
    return record


if __name__ == "__main__":
    main()
