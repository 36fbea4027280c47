"""The benchmark harness: one denoiser forward of a zoo model under several strategies.

    python -m benchmarks.run --model wan2.1-t2v-1.3b \
        --strategies eager,torch_compile,diffusers_regional,magi_zoo \
        --height 480 --width 832 --frames 81 --device cuda --out benchmarks/results/wan-1.3b
    python -m benchmarks.run --model wan2.1-tiny --strategies eager,torch_compile,magi_zoo \
        --device cpu --out /tmp/bench

Setup: random weights at the published config (`weights="random"`), bf16 on GPU (fp32 on
CPU), batch 1. Strategies are the real thing:

- eager:              the adapter's denoiser as the library builds it;
- torch_compile:      `torch.compile(denoiser)`;
- diffusers_regional: `denoiser.compile_repeated_blocks(fullgraph=True)` (diffusers' own);
- magi_zoo:           `magi_zoo.load(model, weights="random", gpu=<card>)` with its shipped
                      spec, timed on the same denoiser.

Each strategy runs in its own process with fresh inductor and Triton cache directories, so
cold compile times and memory peaks are honest. A second process then measures the
warm-start first call: for magi_zoo, again with *fresh* inductor/Triton dirs, so only its
own artifact cache (`cache_dir`) carries compiled code over; for torch_compile and
diffusers_regional, with the inductor/Triton dirs of their cold run (torch's own on-disk
caches are their warm start). Per strategy: cold and warm first-call seconds; ms per
forward (CUDA events, >= 2 warm-up, >= 5 timed: median, min, max); peak GiB over the timed
runs; relative error against eager on the same inputs; FLOPs of one forward from torch's
flop counter, achieved TFLOP/s and % of the matmul rate measured on the same card in the
same run. `--cfg` adds seconds per denoising step with classifier-free guidance (two
forwards, as the diffusers pipelines run cond and uncond). Output: JSON, a markdown table
and a PNG chart under --out. A strategy that fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import traceback
from pathlib import Path
from typing import Any

from benchmarks import common

STRATEGIES = ("eager", "torch_compile", "diffusers_regional", "magi_zoo")


# -- worker (one strategy, one process) ------------------------------------------------------

def _progress(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def _build(args, strategy: str):
    import torch

    import magi_zoo

    device = torch.device(args.device)
    gpu = "cpu" if device.type == "cpu" else "auto"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compile_arg = None if strategy == "magi_zoo" else False
    handle = magi_zoo.load(args.model, gpu=gpu, weights="random", dtype=dtype, device=device,
                           compile=compile_arg, cache_dir=args.zoo_cache if strategy == "magi_zoo" else None)
    module = handle.adapter.denoiser(handle.pipe)
    inputs = handle.adapter.denoiser_inputs(handle.pipe, handle.variant, height=args.height, width=args.width,
                                            frames=args.frames, seed=0)
    return handle, module, inputs, device, dtype


def _prepare(strategy: str, module):
    """The callable each strategy times (compilation itself happens on the first call)."""
    import torch

    if strategy in ("eager", "magi_zoo"):
        return module
    if strategy == "torch_compile":
        return torch.compile(module)
    if strategy == "diffusers_regional":
        if not hasattr(module, "compile_repeated_blocks"):
            raise TypeError(f"{type(module).__name__} is not a diffusers model with _repeated_blocks")
        module.compile_repeated_blocks(fullgraph=True)
        return module
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def _first_tensor(out):
    import torch

    while not isinstance(out, torch.Tensor):
        out = out[0] if isinstance(out, (tuple, list)) else out.sample
    return out


def _fp32_reference(module, inputs: dict[str, Any], tmp: Path) -> None:
    """One forward of the same weights and inputs in fp32 (see common.fp32_forward)."""
    import torch

    out = common.fp32_forward(module, lambda up: _first_tensor(module(**up)), inputs)
    torch.save(out.float().cpu(), tmp / "fp32.pt")


def worker(args) -> dict[str, Any]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from magi_zoo.engine import counters

    strategy, phase = args.worker, args.phase
    rec: dict[str, Any] = {"strategy": strategy, "phase": phase, "status": "ok"}
    _progress(f"{strategy}/{phase}: building {args.model} (random weights) ...")
    handle, module, inputs, device, dtype = _build(args, strategy)
    rec["resident_gib"] = common.gib(torch.cuda.memory_allocated()) if device.type == "cuda" else None
    if handle.cache is not None:
        rec["cache_status"], rec["cache_load_s"] = handle.cache.status, round(handle.cache.load_s, 3)
    fn = _prepare(strategy, module)
    call = lambda: fn(**inputs)  # noqa: E731
    before = counters.snapshot()
    with torch.no_grad():
        if strategy == "eager" and phase == "cold":
            with FlopCounterMode(display=False) as fc:
                module(**inputs)
            rec["flops"] = int(fc.get_total_flops())
            rec["matmul_tflops"] = common.matmul_peak_tflops(device, dtype)
            if args.fp32_reference and dtype != torch.float32:
                _fp32_reference(module, inputs, Path(args.tmp))
        _progress(f"{strategy}/{phase}: first call (compiles) ...")
        out, first_s = common.first_call(call, device)
        rec["first_call_s"] = round(first_s + rec.get("cache_load_s", 0.0), 3)
        d = counters.delta(before)
        rec.update(frames_compiled=d.frames, graph_breaks=d.n_graph_breaks, recompiles=len(d.recompiles),
                   compile_s=round(d.compile_s, 3), compile_breakdown_s=d.breakdown())
        if strategy == "magi_zoo" and phase == "cold":
            handle.save_compile_cache()
        if phase == "cold":
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _progress(f"{strategy}/{phase}: timing {args.warmup} warm-up + {args.runs} runs ...")
            rec.update(common.time_calls(call, device, warmup=args.warmup, runs=args.runs))
            rec["peak_gib"] = common.gib(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
            rec["recompiles_after_first_call"] = len(counters.delta(before).recompiles) - rec["recompiles"]
            torch.save(_first_tensor(out).float().cpu(), Path(args.tmp) / f"{strategy}.pt")
    if handle.report() is not None:
        rec["regions"] = handle.report().to_dict()["regions"]
    return rec


# -- parent (all strategies, fresh processes) ------------------------------------------------

def _strategy_env(tmp: Path, strategy: str, phase: str, repeat: int = 0) -> dict[str, str]:
    """Fresh compile caches per process; see the module docstring for the warm rules."""
    run = "cold" if (phase == "cold" or strategy != "magi_zoo") else f"warm{repeat}"
    base = tmp / f"{strategy}-{run}"
    return {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "TRITON_CACHE_DIR": str(base / "triton")}


def _worker_args(args, strategy: str, phase: str, tmp: Path, result: Path) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--worker", strategy, "--phase", phase,
           "--warmup", str(args.warmup), "--runs", str(args.runs), "--tmp", str(tmp), "--result", str(result),
           "--zoo-cache", str(tmp / "zoo-cache")]
    for k in ("height", "width", "frames"):
        if getattr(args, k) is not None:
            out += [f"--{k}", str(getattr(args, k))]
    if args.fp32_reference:
        out.append("--fp32-reference")
    return out


def _relative_error(tmp: Path, strategy: str, reference: str = "eager") -> float | None:
    import torch

    ref, mine = tmp / f"{reference}.pt", tmp / f"{strategy}.pt"
    if not (ref.is_file() and mine.is_file()):
        return None
    a, b = torch.load(ref), torch.load(mine)
    return float((b - a).norm() / a.norm())


def _chart(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r.get("status") == "ok" and r.get("median_ms") is not None]
    if not ok:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["strategy"] for r in ok]
    a1.bar(names, [r["median_ms"] for r in ok], yerr=[[r["median_ms"] - r["min_ms"] for r in ok],
                                                      [r["max_ms"] - r["median_ms"] for r in ok]], color="#4c72b0")
    a1.set_ylabel("ms per forward (median)")
    a2.bar(names, [r.get("first_call_s") or 0 for r in ok], color="#dd8452", label="cold")
    a2.bar(names, [r.get("warm_first_call_s") or 0 for r in ok], color="#55a868", label="warm", width=0.4)
    a2.set_ylabel("first call s")
    a2.legend()
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


COLUMNS = ["strategy", "status", "median_ms", "min_ms", "max_ms", "first_call_s", "warm_first_call_s",
           "peak_gib", "rel_err_vs_eager", "rel_err_vs_fp32", "tflops", "pct_of_matmul_peak", "frames_compiled", "graph_breaks",
           "recompiles", "s_per_step_cfg"]


def parent(args) -> dict[str, Any]:
    import torch

    from magi_zoo import adapters

    defaults = adapters.lookup(args.model)[1].call_defaults  # record the shape actually run
    args.height = args.height or defaults.get("height")
    args.width = args.width or defaults.get("width")
    args.frames = args.frames or defaults.get("num_frames")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if "eager" in strategies:
        strategies.remove("eager")
    strategies.insert(0, "eager")  # the reference for errors and FLOPs runs first
    out_dir = Path(args.out)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="magi-bench-") as tmp_s:
        tmp = Path(tmp_s)
        for i, strategy in enumerate(strategies, 1):
            warm = 0 if strategy == "eager" or args.no_warm_start else args.warm_repeats
            phases = [("cold", 0)] + [("warm", k) for k in range(warm)]
            row: dict[str, Any] = {"strategy": strategy}
            warm_s: list[float] = []
            for phase, k in phases:
                label = f"{phase} process" + (f" {k + 1}/{warm}" if phase == "warm" and warm > 1 else "")
                print(f"[{i}/{len(strategies)}] {strategy} ({label})", flush=True)
                result = tmp / f"{strategy}-{phase}{k}.json"
                rec = common.run_isolated("benchmarks.run", _worker_args(args, strategy, phase, tmp, result),
                                          env=_strategy_env(tmp, strategy, phase, k), timeout=args.timeout,
                                          result_file=result)
                if phase == "cold":
                    row.update(rec)
                    row["strategy"] = strategy
                else:
                    warm_s.append(rec.get("first_call_s"))
                    # the median over repeated warm processes (each with fresh torch caches)
                    row["warm_first_call_s"] = round(statistics.median([w for w in warm_s if w is not None] or [0]), 3)
                    row["warm_first_call_s_all"] = list(warm_s)
                    row["warm_status"] = rec.get("status")
                    row["warm_cache_status"] = rec.get("cache_status")
                    row.setdefault("warm_detail", []).append(
                        {key: rec.get(key) for key in ("cache_load_s", "compile_s", "compile_breakdown_s")})
                    if rec.get("status") != "ok":
                        row["warm_error"] = rec.get("error")
                if rec.get("status") != "ok":
                    print(f"    {strategy}/{phase} failed: {str(rec.get('error'))[-400:]}", flush=True)
                    break
            row["rel_err_vs_eager"] = _relative_error(tmp, strategy)
            if args.fp32_reference:
                row["rel_err_vs_fp32"] = _relative_error(tmp, strategy, "fp32")
            rows.append(row)
    eager = rows[0]
    flops, peak = eager.get("flops"), eager.get("matmul_tflops")
    for r in rows:
        if r.get("status") == "ok" and flops and r.get("median_ms"):
            r["tflops"] = float(f"{flops / (r['median_ms'] / 1e3) / 1e12:.3g}")
            r["pct_of_matmul_peak"] = float(f"{100 * r['tflops'] / peak:.3g}") if peak else None
        if args.cfg and r.get("median_ms"):
            r["s_per_step_cfg"] = round(2 * r["median_ms"] / 1e3, 3)
        for key in ("rel_err_vs_eager", "rel_err_vs_fp32"):
            if r.get(key) is not None:
                r[key] = float(f"{r[key]:.2e}")
    device = torch.device(args.device)
    env = common.environment(device)
    record = {"model": args.model, "shape": {"height": args.height, "width": args.width, "frames": args.frames},
              "batch": 1, "dtype": "bfloat16" if device.type == "cuda" else "float32", "cfg": args.cfg,
              "flops_per_forward": flops, "matmul_tflops_measured": peak, "env": env,
              "command": "python -m benchmarks.run " + " ".join(args.argv), "results": rows}
    stem = args.stem or f"{args.model}"
    md = [f"# {args.model}: one denoiser forward", "",
          common.env_line(env), "",
          f"shape: {args.height}x{args.width}, frames {args.frames}, batch 1, {record['dtype']}; "
          f"FLOPs/forward {flops / 1e12 if flops else float('nan'):.4g} TFLOP; measured matmul peak {peak} TFLOP/s",
          "", f"command: `{record['command']}`", "", common.results_table(rows, COLUMNS)]
    errors = [f"- {r['strategy']}: {str(r.get('error'))[-600:]}" for r in rows if r.get("status") != "ok"]
    errors += [f"- {r['strategy']} (warm): {str(r.get('warm_error'))[-600:]}" for r in rows if r.get("warm_error")]
    if errors:
        md += ["", "Failures:", *errors]
    paths = common.write_results(out_dir, stem, record, "\n".join(md))
    chart = _chart(rows, out_dir / f"{stem}.png", f"{args.model} on {env['card']} (torch {env['torch']})")
    print("\n".join(md), flush=True)
    print("wrote " + ", ".join(str(p) for p in paths + ([chart] if chart else [])), flush=True)
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--stem", default=None, help="file name stem of the results (default: the model)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--cfg", action="store_true", help="also report s/step with CFG (2 forwards)")
    p.add_argument("--no-warm-start", action="store_true", help="skip the warm-start processes")
    p.add_argument("--warm-repeats", type=int, default=1,
                   help="warm-start processes per strategy; the table shows their median")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also compare every strategy with an fp32 forward of the same weights")
    p.add_argument("--timeout", type=float, default=900, help="seconds per strategy process")
    # internal: one strategy in this process
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--zoo-cache", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.warmup < 2 or args.runs < 5:
        raise SystemExit("--warmup must be >= 2 and --runs >= 5 (DESIGN.md §5)")
    if args.worker is None:
        return parent(args)
    try:
        rec = worker(args)
    except Exception as e:  # recorded, so the table shows the failure and its error
        rec = {"strategy": args.worker, "phase": args.phase, "status": "error",
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    Path(args.result).write_text(json.dumps(rec, default=str))
    return rec


if __name__ == "__main__":
    main()
