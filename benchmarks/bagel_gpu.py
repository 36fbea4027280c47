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
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch


def _versions() -> dict:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in ("diffusers", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:  # pragma: no cover - missing library is recorded, not fatal
            out[mod] = f"unavailable: {e}"
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                           cwd=Path(__file__).resolve().parent, timeout=10).stdout.strip()
    except Exception:
        out["git_commit"] = "unknown"
    return out


def _timed_runs(fn, device: torch.device, warmup: int, runs: int) -> tuple[list[float], object]:
    out = None
    for _ in range(warmup):
        out = fn()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times, out


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
    args = ap.parse_args(argv)

    import magi_zoo
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
    override = None
    if args.backend:
        b = {"backend": args.backend}
        override = {"BagelMoTLayer": b, "model.vit_model": b, "model": {"denoise_step": b, "decode_step": b}}

    def step():
        with torch.inference_mode():
            return model(**inputs)

    results, ref = [], None
    for name in ("eager", "magi_zoo"):
        row: dict = {"strategy": name, "error": None}
        try:
            if name == "magi_zoo":
                torch.compiler.reset()
                report = magi_zoo.apply(handle.modules, layers=spec_layers(adapter, handle.profile, compile=override))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t1 = time.perf_counter()
            first = step()
            if cuda:
                torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t1, 3)
            times, out = _timed_runs(step, device, args.warmup, args.runs)
            row.update(median_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3),
                       max_ms=round(max(times), 3), runs=len(times))
            if cuda:
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            out = out.float()
            if ref is None:
                ref = out
            else:
                row["max_abs_diff_vs_eager"] = float((out - ref).abs().max())
                row["rel_err_vs_eager"] = float((out - ref).norm() / (ref.norm() + 1e-12))
            if name == "magi_zoo":
                row["regions"] = report.to_dict()["regions"]
                row["plan_table"] = report.table()
            del first
        except Exception as e:  # a failing strategy is recorded; the script goes on
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-4000:]
        results.append(row)
        print(f"{name}: {({k: v for k, v in row.items() if k not in ('regions', 'traceback', 'plan_table')})}",
              flush=True)

    card = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    data = {"benchmark": "bagel one CFG denoise step (3 contexts)", "model": args.model, "card": card,
            "profile": handle.profile.name, "dtype": str(dtype), "gen_tokens": n_gen, "text_len": args.text_len,
            "height": args.height or variant.call_defaults["height"],
            "width": args.width or variant.call_defaults["width"], "build_s": round(build_s, 2),
            "versions": _versions(), "results": results}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bagel_gpu.json").write_text(json.dumps(data, indent=2, default=str))
    lines = [f"# BAGEL one denoise step with CFG (3 contexts): {args.model}, {data['height']}x{data['width']} "
             f"({n_gen} latent tokens), {dtype}", "",
             f"card: {card}; torch {data['versions']['torch']}; commit {data['versions']['git_commit'][:10]}", "",
             "| strategy | median ms | min ms | max ms | first call s | peak GiB | max abs diff vs eager | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['strategy']} | {r.get('median_ms', '-')} | {r.get('min_ms', '-')} | {r.get('max_ms', '-')} "
                     f"| {r.get('first_call_s', '-')} | {r.get('peak_gib', '-')} | {r.get('max_abs_diff_vs_eager', '-')} "
                     f"| {(r['error'] or '')[:120]} |")
    for r in results:
        if r.get("plan_table"):
            lines += ["", "magi_zoo regions:", "", r["plan_table"]]
    (out_dir / "bagel_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return data


if __name__ == "__main__":
    main(sys.argv[1:])
