"""One eager VAE decode at a model's benchmark resolution: the number behind a spec's choice
to keep its VAE eager (it runs once per image or video, against every denoising step).

    python -m benchmarks.vae_decode --model flux.1-dev --device cuda
    python -m benchmarks.vae_decode --model flux-tiny --device cpu --out /tmp/r   # CPU smoke run

Works for any zoo model whose pipeline has a `.vae` (Flux, Wan, BAGEL): random weights at
the published config (bf16 on CUDA, fp32 on CPU; a VAE the adapter keeps in fp32 stays so),
a random latent of the shape the VAE decodes at --height x --width (x --frames for video
VAEs; default: the variant's call defaults), batch 1. Cold first call, then >= 2 warm-up
and >= 5 timed decodes (CUDA events): median / min / max ms, peak GiB. Writes
vae_decode_<model>[_<label>]_<card>.json and .md under --out (on the CPU without the card).

`--layouts as_loaded,channels_last` adds a row with the convolution weights channels-last
(the plan's memory_format step); `--vae-dtypes float32,bfloat16` rows in another dtype than
the adapter keeps; `--encode` times the encode of a video of the decoded size too. Each
row's `rel_err` is its output's distance to the first row of the same op. `--passes
as_built,fused` adds rows with the adapter's VAE preparation and the precision step's
`fuse_norm_act` (the Wan VAE: norm + SiLU in one kernel, padding inside the convolution,
upsampling in the VAE's dtype; adapters/wan/vae.py) beside the VAE as diffusers builds it.

    python -m benchmarks.vae_decode --model wan2.1-t2v-1.3b --layouts as_loaded,channels_last \\
        --vae-dtypes float32,bfloat16 --encode --warmup 1 --runs 3 --label layouts
    python -m benchmarks.vae_decode --model wan2.1-t2v-1.3b --layouts channels_last --passes as_built,fused \
        --vae-dtypes float32,bfloat16 --encode --label passes
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
    p.add_argument("--layouts", default="as_loaded",
                   help="comma-separated: as_loaded, channels_last (the plan's memory_format step on the VAE)")
    p.add_argument("--passes", default="as_built",
                   help="comma-separated: as_built (diffusers' modules), fused (the adapter's VAE preparation and "
                        "the precision step's fuse_norm_act)")
    p.add_argument("--vae-dtypes", default=None,
                   help="comma-separated torch dtypes to run the VAE in (default: the one the adapter keeps, "
                        "e.g. float32 for Wan); rows beyond the first show what another choice would cost or save")
    p.add_argument("--encode", action="store_true",
                   help="also time vae.encode of a video of the decoded size (an I2V pipeline's condition)")
    p.add_argument("--label", default=None, help="a word in the results file's name (after the model)")
    p.add_argument("--out", default=common.results_dir("vae_decode"))
    common.add_commit_argument(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = sorted(set(layouts) - set(LAYOUTS))
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; choose from {', '.join(LAYOUTS)}")
    passes = [x.strip() for x in args.passes.split(",") if x.strip()]
    bad = sorted(set(passes) - set(PASSES))
    if bad:
        raise SystemExit(f"--passes: unknown {bad}; choose from {', '.join(PASSES)}")
    common.measured_commit()  # refused before anything is measured where the commit cannot be known

    import torch

    import magi_zoo

    dtypes = [getattr(torch, x.strip(), None) for x in (args.vae_dtypes or "").split(",") if x.strip()]
    if any(not isinstance(d, torch.dtype) for d in dtypes):
        raise SystemExit(f"--vae-dtypes {args.vae_dtypes!r}: torch dtype names, e.g. float32,bfloat16")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    handle = magi_zoo.load(args.model, gpu="auto" if device.type == "cuda" else "cpu", weights="random",
                           dtype=dtype, device=device, compile=False)
    vae = getattr(handle.pipe, "vae", None)
    if vae is None:
        raise SystemExit(f"{args.model}'s pipeline has no .vae")
    from magi_zoo.adapters.wan.vae import PREPARATION_NAME

    preparations = [p for p in handle.adapter.preparations(handle.pipe) if p.name == PREPARATION_NAME]
    if "fused" in passes and not preparations:
        raise SystemExit(f"--passes fused: {args.model}'s adapter declares no {PREPARATION_NAME!r} preparation")
    d = handle.variant.call_defaults
    height, width = args.height or d["height"], args.width or d["width"]
    frames = args.frames or d.get("num_frames")
    shape = latent_shape(vae, height, width, frames)
    g = torch.Generator().manual_seed(0)
    z32 = torch.randn(*shape, generator=g)
    rows: list[dict[str, Any]] = []
    reference: dict[str, Any] = {}  # op -> the first row's output (the adapter's dtype, as loaded)
    for vae_dtype in dtypes or [vae.dtype]:
        vae.to(vae_dtype)
        for layout in layouts:
            for passes_ in passes:
                rows += _rows(vae, z32, layout, passes_, preparations, args, device, handle.variant.name, reference)
    env = common.environment(device)
    record = {"env": env, "command": "python -m benchmarks.vae_decode " + " ".join(argv), "results": rows}
    what = "decode" + (" and encode" if args.encode else "")
    md = [f"# {handle.variant.name}: one eager VAE {what}", "", common.env_line(env), "",
          "rel_err: against the first row of the same op (the dtype the adapter keeps, weights as loaded)", "",
          common.results_table(rows, ["model", "op", "latent", "pixels", "vae_dtype", "layout", "passes", "median_ms",
                                      "min_ms", "max_ms", "first_call_s", "peak_gib", "rel_err"])]
    # named by model, label and card (a CPU run keeps the plain name its smoke test reads)
    stem = (f"vae_decode_{handle.variant.name}" + (f"_{args.label}" if args.label else "")
            + (f"_{common.card_tag(env)}" if device.type == "cuda" else ""))
    common.write_results(Path(args.out), stem, record, "\n".join(md))
    print("\n".join(md), flush=True)
    return record


LAYOUTS = ("as_loaded", "channels_last")
PASSES = ("as_built", "fused")


def _rows(vae, z32, layout: str, passes: str, preparations: list, args, device, model: str,
          reference: dict) -> list[dict[str, Any]]:
    """The decode (and encode) rows of one dtype, weight layout and set of passes; the layout
    through the plan's own memory_format step, the fused passes through the adapter's
    preparation and the precision step, removed afterwards."""
    import torch

    import magi_zoo

    report = None
    plan: dict[str, Any] = {"compile": {"": {"enabled": False}}}
    if layout == "channels_last":
        plan["memory_format"] = {"": True}
    if passes == "fused":
        plan["precision"] = {"": {"fuse_norm_act": True}}
    if len(plan) > 1:
        report = magi_zoo.apply(vae, plan, gpu="auto" if device.type == "cuda" else "cpu",
                                preparations=preparations if passes == "fused" else ())
    z = z32.to(device=device, dtype=vae.dtype)
    ops = {"decode": lambda: vae.decode(z, return_dict=False)[0]}
    out: list[dict[str, Any]] = []
    try:
        with torch.no_grad():
            for op in ("decode", "encode") if args.encode else ("decode",):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                result, first_s = common.first_call(ops[op], device)
                if op == "decode" and args.encode:
                    # the video every encode row reads: the first row's decode (the decoded size, in
                    # [-1, 1]), so the encode rows differ by their own dtype and layout alone
                    video = reference.setdefault("video", result.clamp(-1, 1).float()).to(vae.dtype)
                    ops["encode"] = lambda: vae.encode(video).latent_dist.mode()
                row = {"model": model, "op": op, "latent": list(z.shape), "pixels": list(video.shape[2:] if op ==
                       "encode" else result.shape[2:]), "vae_dtype": str(vae.dtype).replace("torch.", ""),
                       "layout": layout, "passes": passes, "first_call_s": round(first_s, 3),
                       **common.time_calls(ops[op], device, warmup=args.warmup, runs=args.runs)}
                row["peak_gib"] = common.gib(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
                ref = reference.setdefault(op, result.float())
                row["rel_err"] = float(f"{float((result.float() - ref).norm() / ref.norm()):.3g}")
                out.append(row)
    finally:
        if report is not None:
            magi_zoo.remove(vae)
    return out


if __name__ == "__main__":
    main()
