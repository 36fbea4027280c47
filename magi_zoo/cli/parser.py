"""`magi-zoo`'s command line: one subcommand per `commands` module (`args.cmd` names it;
`magi_zoo.cli.main` imports its `cmd_<name>` only after parsing, so `--help` and
`--version` load no torch)."""

from __future__ import annotations

import argparse

from .. import __version__
from ..specs.gpu_profiles import GPU_CHOICES
from .serve_parser import add_serve

DESCRIPTION = "`magi-zoo`: list models, show a resolved spec, run the demo, generate."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magi-zoo", description=DESCRIPTION)
    p.add_argument("--version", action="version", version=f"magi-zoo {__version__}")
    p.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # --debug after the subcommand too: SUPPRESS leaves the top level's value unless given here
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", parents=[common], help="models and their variants")

    s = sub.add_parser("spec", parents=[common], help="the resolved plan for a model on a GPU, as a table")
    s.add_argument("model")
    s.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    s.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    s.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="device memory budget for the offload plan (default: the GPU profile's memory)")
    s.add_argument("--recompute", default=None, metavar="POLICY",
                   help="the plan for training with this recompute policy: full, selective, none, auto:GIB "
                        "(GIB: the training step's peak)")
    s.add_argument("--lora", action="append", default=None, metavar="[COMPONENT=]PATH[:SCALE]",
                   help="check a LoRA against the model (repeatable): which layers it adapts, at what scale")
    s.add_argument("--measure", action="store_true",
                   help="with --recompute auto:GIB: build the model here (random weights) and show auto's measured choice")

    d = sub.add_parser("demo", parents=[common], help="offline CPU demo: wan2.1-tiny eager vs its plan")
    d.add_argument("--prompt", default="a corgi surfing a wave at sunset")
    d.add_argument("--seed", type=int, default=0)

    r = sub.add_parser("run", parents=[common], help="generate with a model and write the result")
    r.add_argument("model")
    r.add_argument("--weights", default=None, help="a local directory, a hub id, or 'random'")
    r.add_argument("--prompt", required=True)
    r.add_argument("--out", required=True, help="output file (.mp4 video, .png image, .txt text)")
    r.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out / --audio-out file (without it, an existing file is refused)")
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
    r.add_argument("--lora", action="append", default=None, metavar="[COMPONENT=]PATH[:SCALE]",
                   help="a LoRA to merge (repeatable): a .safetensors file or hub id, :SCALE its strength (default 1), "
                        "transformer_2= the low-noise expert of Wan2.2 A14B; e.g. --lora distill.safetensors:1.0")
    r.add_argument("--step-cache", default=None, metavar="METHOD[:THRESHOLD]",
                   help="reuse work across denoising steps (diffusers' caching hooks): none, first_block, "
                        "mag_cache, taylorseer, pab, sea_cache; e.g. first_block:0.1 or "
                        "taylorseer:cache_interval=4,use_lite_mode=true")
    r.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    r.add_argument("--compile", dest="compile_overrides", action="append", default=None, metavar="KEY=JSON",
                   help="override one compile key (repeatable), e.g. 'WanTransformerBlock={\"dynamic\": false}'")
    r.add_argument("--memory-budget", type=float, default=None, metavar="GIB",
                   help="offload budget: device memory for weights + activations; what does not fit streams "
                        "from host memory")
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

    e = sub.add_parser("explain", parents=[common],
                       help="one call with torch's compile trace on: graphs, breaks, guards, code")
    e.add_argument("model")
    e.add_argument("--gpu", default="auto", type=str.lower, choices=GPU_CHOICES)
    e.add_argument("--out", default="magi-zoo-explain", help="folder to write (default: ./magi-zoo-explain)")
    e.add_argument("--overwrite", action="store_true",
                   help="write into a --out folder that is not empty (files of the same names are replaced)")
    e.add_argument("--entry", default=None, help="the entry point to call (default: the family's first)")
    e.add_argument("--weights", default=None, help="a local directory, a hub id, or 'random'")
    e.add_argument("--spec-file", default=None, help="a TOML spec replacing the shipped one")
    e.add_argument("--lora", action="append", default=None, metavar="[COMPONENT=]PATH[:SCALE]",
                   help="a LoRA to merge (repeatable): a .safetensors file or hub id, :SCALE its strength (default 1), "
                        "transformer_2= the low-noise expert of Wan2.2 A14B; e.g. --lora distill.safetensors:1.0")
    add_serve(sub, common)
    return p

