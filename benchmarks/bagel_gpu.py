"""BAGEL-7B-MoT: one text-to-image denoising step with CFG (three KV contexts), eager vs
the magi_zoo spec. Random weights at the published config (bf16 on CUDA).

    python -m benchmarks.bagel_gpu --device cuda --out benchmarks/results
    python -m benchmarks.bagel_gpu --device cpu --model bagel-tiny --out /tmp/bagel   # smoke run

At 1024x1024 the query block is 64x64 = 4,096 latent tokens (+2 markers) per context; the
full and no-image contexts hold a `--text-len`-token prompt, the no-text context is empty.
cfg_img_scale 1.5 (the inferencer's default) makes all three branches run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import common

# (header, result key): the markdown table's columns.
COLUMNS = [("strategy", "strategy"), ("median ms", "median_ms"), ("min ms", "min_ms"), ("max ms", "max_ms"),
           ("first call s", "first_call_s"), ("peak GiB", "peak_gib"),
           ("max abs diff vs eager", "max_abs_diff_vs_eager"), ("rel err vs eager", "rel_err_vs_eager"),
           ("rel err vs fp32", "rel_err_vs_fp32"),
           ("error", "error")]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="bagel-7b-mot")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--height", type=int, default=None, help="default: the variant's (1024 for the 7B)")
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--text-len", type=int, default=32, help="prompt tokens in the full / no-image contexts")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--backend", default=None, help="override every region's backend (e.g. eager for smoke runs)")
    ap.add_argument("--fp32-reference", action="store_true",
                    help="also compare both strategies with the step run in fp32 (TF32 off)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)

    import magi_zoo
    from magi_zoo.specs.plan import with_backend
    from magi_zoo.zoo import spec_layers

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available; use --device cpu --model bagel-tiny")
    gpu = "auto" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    adapter, variant = magi_zoo.adapters.lookup(args.model)
    handle = magi_zoo.load(args.model, gpu=gpu, weights=None if variant.tiny else "random", dtype=dtype,
                           device=device, compile=False)
    build_s = time.perf_counter() - t0
    pipe = handle.pipe
    model = adapter.denoiser(pipe)
    inputs = adapter.denoiser_inputs(pipe, variant, height=args.height, width=args.width, text_len=args.text_len)
    n_gen = inputs["x_t"].shape[0]
    layers = spec_layers(adapter, handle.profile)
    if args.backend:  # smoke runs: every compiled region on a cheaper backend
        layers = with_backend(layers, args.backend)

    def step():
        with torch.inference_mode():
            return model(**inputs)

    ref32 = None
    if args.fp32_reference:
        def step32(up):
            with torch.inference_mode():
                return model(**up).float()
        ref32 = common.fp32_forward(model, step32, inputs)

    results, ref = [], None
    for name in ("eager", "magi_zoo"):
        row: dict = {"strategy": name, "error": None}
        try:
            if name == "magi_zoo":
                torch.compiler.reset()
                report = magi_zoo.apply(handle.modules, layers=layers, gpu=handle.profile,
                                        preparations=adapter.preparations(pipe))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            out, first_s = common.first_call(step, device)
            row["first_call_s"] = round(first_s, 3)
            row.update(common.time_calls(step, device, warmup=args.warmup, runs=args.runs))
            if cuda:
                row["peak_gib"] = common.gib(torch.cuda.max_memory_allocated())
            out = out.float()  # the velocity: same inputs every call, so the first call's is every call's
            if ref is None:
                ref = out
            else:
                row["max_abs_diff_vs_eager"] = float((out - ref).abs().max())
                row["rel_err_vs_eager"] = float((out - ref).norm() / ref.norm())
            if ref32 is not None:
                row["rel_err_vs_fp32"] = float((out - ref32).norm() / ref32.norm())
            if name == "magi_zoo":
                row["regions"] = report.to_dict()["regions"]
                row["plan_table"] = report.table()
            del out
        except Exception as e:  # a failing strategy is recorded; the script goes on
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-4000:]
        results.append(row)
        print(f"{name}: {({k: v for k, v in row.items() if k not in ('regions', 'traceback', 'plan_table')})}",
              flush=True)

    env = common.environment(device)
    data = {"benchmark": "bagel one CFG denoise step (3 contexts)", "model": args.model, "env": env,
            "profile": handle.profile.name, "dtype": str(dtype), "gen_tokens": n_gen, "text_len": args.text_len,
            "height": args.height or variant.call_defaults["height"],
            "width": args.width or variant.call_defaults["width"], "build_s": round(build_s, 2),
            "command": "python -m benchmarks.bagel_gpu " + " ".join(argv), "results": results}
    shown = {"error": lambda e: e[:120], "rel_err_vs_eager": lambda x: float(f"{x:.2e}"),
             "rel_err_vs_fp32": lambda x: float(f"{x:.2e}")}
    table = [{h: (shown[k](r[k]) if k in shown and r.get(k) is not None else r.get(k)) for h, k in COLUMNS}
             for r in results]
    lines = [f"# BAGEL one denoise step with CFG (3 contexts): {args.model}, {data['height']}x{data['width']} "
             f"({n_gen} latent tokens), {dtype}", "", common.env_line(env), "",
             common.results_table(table, [h for h, _ in COLUMNS])]
    for r in results:
        if r.get("plan_table"):
            lines += ["", "magi_zoo regions:", "", r["plan_table"]]
    common.write_results(Path(args.out), "bagel_gpu", data, "\n".join(lines))
    print("\n".join(lines))
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
