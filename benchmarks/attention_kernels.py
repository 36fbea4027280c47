"""Attention kernels at real model shapes, and what FA3 does to a whole Wan forward.

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.attention_kernels                                     # both parts
    python -m benchmarks.attention_kernels --part kernels                      # kernels only
    python -m benchmarks.attention_kernels --part model --model wan2.1-i2v-14b-480p
    python -m benchmarks.attention_kernels --smoke --out /tmp/ak               # CPU, tiny, seconds

Part "kernels": one attention call, bf16, at the Wan-1.3B shape (B=1, S=32,760 tokens =
21 latent frames x 30 x 52 patches of 480x832x81, H=12, D=128), the Wan-14B shape (H=40) and
Flux.1 at 1024² (S=4,096 image + 512 text = 4,608, H=24). Inputs are (B, S, H, D), the
layout diffusers' attention layers produce; the SDPA rows get the (B, H, S, D) transposed
views diffusers' native backend passes, the FA3 rows the tensors themselves. Kernels:
torch SDPA's own dispatch ("sdpa", what backend='native' runs), SDPA forced to cuDNN /
flash / efficient, the fa3 backend called directly ("fa3") and through diffusers'
`dispatch_attention_fn` as a model calls it ("fa3_dispatch": the registry path adds
nothing if it times the same). TFLOP/s counts 4*B*H*S*S*D (QK^T and PV, 2 flops per MAC);
the error is relative L2 against fp32 SDPA of the same inputs.

Part "model": one transformer forward of the model (random weights at the published
config, bf16) under the shipped magi_zoo plan (regional compile), with the library's
attention ("shipped") and with ``overrides={"attention": {"transformer": {"backend":
"fa3"}}}``, on the same weights and inputs. Reports median ms, first call (compile) s,
the compile counters, and the error against the shipped plan's output.

Timing: CUDA events, warm-up, >= 5 timed runs, median (docs/methodology.md). `--smoke` runs on
CPU at tiny sizes with wan2.1-tiny (compile backend "eager"), skipping what cannot run
there (cuDNN/flash, fa3): a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import traceback
from pathlib import Path

from benchmarks import common

# name -> (B, S, H, D)
SHAPES = {"wan-1.3b": (1, 32760, 12, 128), "wan-14b": (1, 32760, 40, 128), "flux-1024": (1, 4608, 24, 128)}
SMOKE_SHAPES = {"wan-1.3b": (1, 512, 2, 64), "wan-14b": (1, 512, 4, 64), "flux-1024": (1, 256, 3, 64)}
KERNELS = ("sdpa", "cudnn", "flash", "efficient", "fa3", "fa3_dispatch")

# common.markdown_table was renamed results_table; accept either while both are in use.
_table = getattr(common, "results_table", None) or getattr(common, "markdown_table")


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float(f"{float((a - b).norm() / b.norm()):.2e}")


def _fa3_missing(device) -> str | None:
    if device.type != "cuda":
        return "fa3 needs CUDA"
    from magi_zoo.engine.kernels import fa3

    return fa3.missing_reason()


def _kernel_fn(name: str, q, k, v):
    """(a zero-argument call, a context manager to run it under) for one kernel."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views, as diffusers' native
    forced = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2), contextlib.nullcontext()
    if name in forced:
        return lambda: F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2), sdpa_kernel(forced[name])
    from magi_zoo.engine.kernels import fa3

    member = fa3.register()
    if name == "fa3":
        return lambda: fa3.fa3_attention(q, k, v), contextlib.nullcontext()
    if name == "fa3_dispatch":
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return lambda: dispatch_attention_fn(q, k, v, backend=member), contextlib.nullcontext()
    raise SystemExit(f"unknown kernel {name!r}; kernels: {', '.join(KERNELS)}")


def bench_kernels(device, shapes: dict, kernels: list[str], runs: int, warmup: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    rows = []
    fa3_missing = _fa3_missing(device)
    for shape_name, (b, s, h, d) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(3))
        # fp32 yardstick: SDPA's own dispatch in fp32 (efficient kernel on CUDA, no S x S matrix)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        flops = 4 * b * h * s * s * d
        for name in kernels:
            row = {"shape": shape_name, "B": b, "S": s, "H": h, "D": d, "kernel": name}
            if name.startswith("fa3") and fa3_missing:
                row["status"] = f"skipped: {fa3_missing}"
                rows.append(row)
                print("[bench]", row, flush=True)
                continue
            try:
                fn, ctx = _kernel_fn(name, q, k, v)
                with ctx, torch.no_grad():
                    out = fn()
                    row["rel_err_vs_fp32"] = _rel(out, ref)
                    del out
                    row.update(common.time_calls(fn, device, warmup=warmup, runs=runs))
                row["tflops"] = float(f"{flops / (row['median_ms'] / 1e3) / 1e12:.4g}")
                row["status"] = "ok"
            except Exception as e:  # e.g. no cuDNN / flash kernel for these inputs here
                row["status"] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            print("[bench]", {k_: v_ for k_, v_ in row.items() if k_ != "times_ms"}, flush=True)
        del q, k, v, ref
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def bench_model(device, model: str, runs: int, warmup: int, compile_backend: str | None,
                gpu: str | None = None) -> list[dict]:
    import torch

    import magi_zoo
    from magi_zoo.engine import remove
    from magi_zoo.specs.plan import PlanLayer, with_backend

    gpu = gpu or ("auto" if device.type == "cuda" else "cpu")
    fa3 = {"attention": {"transformer": {"backend": "fa3"}}}
    # compile=False: build once, apply each plan below to the same weights
    h = magi_zoo.load(model, gpu=gpu, weights="random", device=device, compile=False, overrides=fa3)
    base = [(n, layer) for n, layer in h.layers if n != "user"]  # the shipped spec for this profile
    if compile_backend:
        base = with_backend(base, compile_backend)
    shipped = base
    with_fa3 = [*base, ("user", PlanLayer(**fa3))]
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    t = h.pipe.transformer
    rows, ref = [], None
    fa3_missing = _fa3_missing(device)
    for label, layers in (("shipped", shipped), ("fa3", with_fa3)):
        row = {"model": model, "attention": label, "dtype": str(h.dtype).replace("torch.", "")}
        if label == "fa3" and fa3_missing:
            row["status"] = f"skipped: {fa3_missing}"
            rows.append(row)
            print("[bench]", row, flush=True)
            continue
        try:
            torch.compiler.reset()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            rep = magi_zoo.apply(h.modules, layers=layers, gpu=h.profile,
                                 preparations=h.adapter.preparations(h.pipe))
            row["attention_step"] = rep.step("attention").did.split("; custom ops")[0]
            with torch.no_grad():
                out, first = common.first_call(lambda: t(**kw)[0], device)
                row["first_call_s"] = round(first, 2)
                row.update(common.time_calls(lambda: t(**kw), device, warmup=warmup, runs=runs))
            row.update(frames=rep.frames, graph_breaks=rep.graph_breaks,
                       recompiles=sum(len(r.counters.recompiles) for r in rep.regions))
            if device.type == "cuda":
                row["peak_gib"] = common.gib(torch.cuda.max_memory_allocated())
            out = out.float()
            ref = out if ref is None else ref
            row["rel_err_vs_shipped"] = _rel(out, ref)
            row["status"] = "ok"
        except Exception as e:
            row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        finally:
            remove(h.modules)
        rows.append(row)
        print("[bench]", {k_: v_ for k_, v_ in row.items() if k_ != "times_ms"}, flush=True)
    base = rows[0].get("median_ms")
    for r in rows:
        if base and r.get("median_ms"):
            r["speedup_vs_shipped"] = round(base / r["median_ms"], 3)
    del h, t, kw
    gc.collect()
    return rows


def main(argv=None):
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("kernels", "model", "both"), default="both")
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated, from: " + ", ".join(KERNELS))
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, from: " + ", ".join(SHAPES))
    p.add_argument("--model", default=None, help="part 'model': a variant (default wan2.1-t2v-1.3b; "
                                                  "wan2.1-tiny with --smoke)")
    p.add_argument("--compile-backend", default=None,
                   help="part 'model': replace the shipped plan's compile backend (default: as shipped)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--gpu", default=None, help="part 'model': the GPU profile planned for (default: "
                                               "detected on cuda, 'cpu' on cpu)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU-sized check that the script runs")
    p.add_argument("--out", default=common.results_dir("attention"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.runs < 5:
        raise SystemExit("--runs >= 5 (docs/methodology.md: warm-up, >= 5 timed runs, median)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    shapes_all = SMOKE_SHAPES if args.smoke else SHAPES
    unknown = [s for s in args.shapes.split(",") if s not in shapes_all]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; shapes: {', '.join(shapes_all)}")
    shapes = {s: shapes_all[s] for s in args.shapes.split(",")}
    kernels = args.kernels.split(",")
    bad = [k for k in kernels if k not in KERNELS]
    if bad:
        raise SystemExit(f"unknown kernels {bad}; kernels: {', '.join(KERNELS)}")
    model = args.model or ("wan2.1-tiny" if args.smoke else "wan2.1-t2v-1.3b")
    runs, warmup = (5, 1) if args.smoke else (args.runs, args.warmup)
    compile_backend = args.compile_backend or ("eager" if args.smoke else None)

    record: dict = {"smoke": args.smoke, "env": common.environment(device), "kernels": [], "model": []}
    if args.part in ("kernels", "both"):
        record["kernels"] = bench_kernels(device, shapes, kernels, runs, warmup)
    if args.part in ("model", "both"):
        record["model"] = bench_model(device, model, runs if args.smoke else max(5, runs // 2), warmup,
                                      compile_backend, args.gpu)

    import magi_zoo

    card = magi_zoo.get_profile("auto").name if device.type == "cuda" else "cpu"
    md = [f"# Attention kernels{' (smoke: tiny sizes, not a measurement)' if args.smoke else ''}", "",
          common.env_line(record["env"]), ""]
    if record["kernels"]:
        md += ["## One attention call, bf16, inputs (B, S, H, D); TFLOP/s = 4*B*H*S*S*D / time", "",
               _table(record["kernels"], ["shape", "S", "H", "D", "kernel", "status", "median_ms", "min_ms",
                                          "max_ms", "tflops", "rel_err_vs_fp32"]), ""]
    if record["model"]:
        md += [f"## {model}: one transformer forward under the shipped plan"
               + (f" (compile backend {compile_backend})" if compile_backend else ""), "",
               _table(record["model"], ["attention", "dtype", "status", "median_ms", "min_ms", "max_ms",
                                        "speedup_vs_shipped", "first_call_s", "frames", "graph_breaks",
                                        "recompiles", "peak_gib", "rel_err_vs_shipped", "attention_step"]), ""]
    paths = common.write_results(Path(args.out), f"attention_kernels_{card}", record, "\n".join(md))
    print("\n".join(md))
    print("wrote", *map(str, paths))
    return record


if __name__ == "__main__":
    main()
