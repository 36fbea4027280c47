"""Multi-GPU inference: one CFG denoising step (Wan2.1-I2V-14B-480P) and one transformer
forward (Wan2.1-T2V-1.3B), on 1, 2 (and 4) GPUs, through the plan's parallel section.

Each configuration runs in its own `torchrun` job (fresh processes, fresh compile caches):

    python -m benchmarks.parallel --gpus 2            # 1-GPU baselines + every 2-GPU configuration
    python -m benchmarks.parallel --gpus 4            # ... + the 4-GPU ones
    python -m benchmarks.parallel --smoke             # CPU, 2 gloo processes, wan2.1-tiny: plumbing only
    python -m benchmarks.parallel --gpus 4 --profile  # + where each configuration's step goes (step_profile)

What is timed (CUDA events, rank 0; warm-up, then >= 5 runs, median), with the shipped
spec for the card (regional compile, its attention backend) plus the parallel section:

- ``cfg-step``: the denoiser's two calls of one CFG step, marked as diffusers' pipelines
  mark them (``cache_context("cond")`` / ``("uncond")``), and the guidance combine: what
  one step of the pipeline costs minus the scheduler (microseconds). s/it = this.
- ``forward``: one transformer forward (no CFG).

Rank 0 prints one ``[bench]`` row per configuration and writes
``benchmarks/results/parallel/parallel_<card>_<N>gpu.json`` / ``.md`` (speed-up against the 1-GPU row of
the same workload, and the output's relative L2 distance to the 1-GPU output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (add_commit_argument, card_tag, env_line, environment, first_call, gib,
                               measured_commit, results_dir, results_table, run_isolated, time_calls, write_results)

WORKLOADS = {
    # name: (model, mode, height, width, frames)
    "i2v-14b-cfg": ("wan2.1-i2v-14b-480p", "cfg-step", 480, 832, 81),
    "t2v-1.3b-forward": ("wan2.1-t2v-1.3b", "forward", 480, 832, 81),
}
GUIDANCE = 5.0  # Wan's default guidance scale (the combine's arithmetic, not its cost, depends on it)


def configs(world: int, mode: str, which: str = "all") -> list[dict[str, Any]]:
    """The parallel configurations measured at one GPU count (the first is what
    `magi-zoo run --nproc N` picks; which="default" measures only that one)."""
    from magi_zoo.specs.parallel_spec import default_parallel

    if world == 1:
        return [{}]
    out = [default_parallel(world, runs_cfg=mode == "cfg-step")]
    if which == "default":
        return out
    for alt in ({"ulysses_degree": world}, {"ring_degree": world, "attention": "_native_cudnn"}):
        if alt not in out:
            out.append(alt)
    return out


# -- where a step's time goes (--profile) -----------------------------------------------------------
# Kernel names -> category, first match wins. Collectives first: NCCL's kernels (ncclDevKernel_*,
# ncclKernel_*) and gloo's ops on CPU; then attention (FA3's and torch's flash / cuDNN / efficient
# kernels); then matmuls (cuBLAS, CUTLASS, Hopper's sm90 / nvjet GEMMs).
PROFILE_CATEGORIES = (
    ("communication", ("nccl", "all_to_all", "alltoall", "all_gather", "allgather", "c10d::", "gloo")),
    ("attention", ("flash", "fmha", "attention", "cudnn_sdpa", "sdpa", "mha")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "aten::mm", "aten::addmm")),
)


def categorise(name: str) -> str:
    """The category of a profiler event's name (`PROFILE_CATEGORIES`), else "other"."""
    low = name.lower()
    return next((cat for cat, keys in PROFILE_CATEGORIES if any(k in low for k in keys)), "other")


def step_profile(step, device_type: str) -> dict[str, float]:
    """One `step()` under torch.profiler: milliseconds of self time per category, summed over
    kernels (device time on CUDA, CPU time on CPU). Kernels on different streams overlap (NCCL
    runs beside compute), so the categories can add up to more than the step's wall time; the
    sum over "communication" is what the collectives cost if nothing hid them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device_type == "cuda":
            torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if device_type == "cuda":
            us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        else:
            # CPU: the aten / c10d ops themselves (their self time), not the Python frames around them
            us = ev.self_cpu_time_total if "::" in ev.key else 0
        if us:
            cat = categorise(ev.key)
            out[cat] = out.get(cat, 0.0) + us / 1e3
    return {k: round(v, 2) for k, v in sorted(out.items())}


# -- one rank of one configuration -------------------------------------------------------------
def worker(args) -> None:
    import torch

    import magi_zoo
    from magi_zoo import distributed

    device_type = "cpu" if args.smoke else "cuda"
    distributed.init(device_type)
    rank, world = distributed.rank(), distributed.world_size()
    par = json.loads(args.parallel)
    attention = par.pop("attention", None)
    overrides: dict[str, Any] = {}
    if par:
        overrides["parallel"] = {"WanTransformer3DModel": par}
    if attention:
        overrides["attention"] = {"WanTransformer3DModel": attention}
    if args.backend:  # the spec's compiled blocks on another torch.compile backend, nothing else changed
        overrides["compile"] = {"WanTransformerBlock": {"backend": args.backend}}
    gpu = "cpu" if args.smoke else "auto"
    t_build = time.perf_counter()
    h = magi_zoo.load(args.model, gpu=gpu, weights=None if args.smoke else "random", overrides=overrides or None)
    build_s = time.perf_counter() - t_build
    t = h.pipe.transformer
    dev = next(t.parameters()).device
    shape = dict(height=args.height, width=args.width, frames=args.frames) if not args.smoke else {}
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise", **shape)
    g = torch.Generator(device="cpu").manual_seed(1)
    neg = torch.randn(kw["encoder_hidden_states"].shape, generator=g).to(kw["encoder_hidden_states"])
    kw_u = dict(kw, encoder_hidden_states=neg)

    branches: dict[str, torch.Tensor] = {}

    if args.mode == "cfg-step":
        def step():
            with t.cache_context("cond"):
                c = t(**kw)[0]
            with t.cache_context("uncond"):
                u = t(**kw_u)[0]
            # Kept for the comparison with one GPU: each branch as well as the combine, so a
            # difference can be told apart from the guidance scale magnifying it.
            branches["cond"], branches["uncond"] = c, u
            return u + GUIDANCE * (c - u)
    else:
        def step():
            return t(**kw)[0]

    with torch.inference_mode():
        out, first_s = first_call(step, dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timing = time_calls(step, dev, warmup=args.warmup, runs=args.runs)
        profile_ms = step_profile(step, dev.type) if args.profile else None
        out = step()
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else None
    rec = next(s for s in h.report().steps if s.step == "parallel")
    attn = next(s for s in h.report().steps if s.step == "attention")
    row = {"workload": args.workload, "model": args.model, "mode": args.mode, "gpus": world,
           "degrees": {k: rec.details[k] for k in ("ulysses_degree", "ring_degree", "cfg") if k in rec.details},
           "config": _label(par, attention), "attention": attn.did, "parallel_step": rec.did,
           "ms": timing["median_ms"], "min_ms": timing["min_ms"], "max_ms": timing["max_ms"],
           "times_ms": timing["times_ms"], "first_call_s": round(first_s, 2), "build_s": round(build_s, 1),
           "peak_gib": gib(peak), "shape": [args.height, args.width, args.frames]}
    if profile_ms is not None:  # rank 0's kernels of one step, by category (step_profile)
        row["profile_ms"] = profile_ms
    if rank == 0:
        ref = Path(args.ref)
        mine = {"out": out, **branches}
        if world == 1:
            torch.save({k: v.float().cpu() for k, v in mine.items()}, ref)
        elif ref.is_file():
            saved = torch.load(ref, weights_only=True)
            for k, v in mine.items():
                if k in saved:
                    r, o = saved[k], v.float().cpu()
                    row["rel_l2_vs_1gpu" if k == "out" else f"rel_l2_{k}_vs_1gpu"] = float((o - r).norm() / r.norm())
        row["env"] = environment(dev)
        print(f"[bench] {args.workload} gpus={world} {row['config']}: {row['ms']:.1f} ms "
              f"(first call {row['first_call_s']} s, peak {row['peak_gib']} GiB)"
              + (f", rel L2 vs 1 GPU {row['rel_l2_vs_1gpu']:.2e}" if "rel_l2_vs_1gpu" in row else "")
              + "".join(f", {b} {row[f'rel_l2_{b}_vs_1gpu']:.2e}" for b in ("cond", "uncond")
                        if f"rel_l2_{b}_vs_1gpu" in row), flush=True)
        Path(args.result).write_text(json.dumps(row, default=str))
    distributed.shutdown()


def _label(par: dict[str, Any], attention: str | None) -> str:
    parts = [f"{k.replace('_degree', '')} {v}" for k, v in par.items() if k not in ("cfg", "attention")]
    parts += ["cfg 2"] if par.get("cfg") else []
    return (" x ".join(parts) or "1 GPU") + (f", attention {attention}" if attention else "")


# -- the driver: one torchrun job per configuration ------------------------------------------------
def run_config(workload: str, world: int, par: dict[str, Any], args, ref: Path, smoke: bool) -> dict[str, Any]:
    model, mode, height, width, frames = WORKLOADS[workload] if not smoke else ("wan2.1-tiny", "cfg-step", 0, 0, 0)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        job = ["--standalone", f"--nproc-per-node={world}",
               "-m", "benchmarks.parallel", "--worker", "--workload", workload, "--model", model, "--mode", mode,
               "--height", str(height), "--width", str(width), "--frames", str(frames),
               "--warmup", str(args.warmup), "--runs", str(args.runs), "--parallel", json.dumps(par),
               "--ref", str(ref), "--result", str(result)] + (["--smoke"] if smoke else []) \
            + (["--profile"] if args.profile else []) + (["--backend", args.backend] if args.backend else [])
        print(f"$ torchrun --standalone --nproc-per-node={world} -m benchmarks.parallel --worker --workload "
              f"{workload} --parallel '{json.dumps(par)}' ...", flush=True)
        # past the timeout the whole job goes (torchrun and its workers, which would otherwise
        # hold the GPUs through the next configuration) and the row says so
        rec = run_isolated("torch.distributed.run", job, result_file=result, timeout=args.timeout, echo_prefix="",
                           env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        if result.is_file():  # the job's own row, whatever it says
            return rec
    print(rec["error"], file=sys.stderr)
    last = rec["error"].strip().splitlines()
    return {"workload": workload, "gpus": world, "config": _label(par, par.get("attention")),
            "status": "error", "error": last[-1] if last else rec["error"]}


def _write(rows: list[dict[str, Any]], args, argv, counts: list[int], quiet: bool = False) -> None:
    """The results files for the rows so far (speed-ups against each workload's 1-GPU row)."""
    base = {r["workload"]: r["ms"] for r in rows if r.get("gpus") == 1 and "ms" in r}
    for r in rows:
        if "ms" in r and r["workload"] in base:
            r["vs_1gpu"] = round(r["ms"] / base[r["workload"]], 3)
            r["speedup"] = round(base[r["workload"]] / r["ms"], 2)
    env = next((r["env"] for r in rows if "env" in r), {})
    card = card_tag(env, cuda=not args.smoke)
    for r in rows:  # the profile's categories as columns of their own
        for cat, ms in (r.get("profile_ms") or {}).items():
            r[f"{cat}_ms"] = ms
    cols = ["workload", "gpus", "config", "ms", "speedup", "vs_1gpu", "rel_l2_vs_1gpu", "rel_l2_cond_vs_1gpu",
            "rel_l2_uncond_vs_1gpu", "first_call_s", "peak_gib", "status", "error"]
    if any(r.get("profile_ms") for r in rows):
        cols += [f"{cat}_ms" for cat in (*(c for c, _ in PROFILE_CATEGORIES), "other")]
    md = "\n".join([
        "# Multi-GPU inference (benchmarks/parallel.py)", "", env_line(env) if env else "", "",
        "ms = one CFG step (cond + uncond forward + combine; = s/it) for `cfg-step`, one transformer forward for "
        "`forward`; median of the timed runs on rank 0. 480x832, 81 frames (32,760 tokens), bf16, random weights "
        "at the published configs, the shipped spec (regional compile, its attention backend) plus the parallel "
        "section; `rel_l2_vs_1gpu`: the output against the 1-GPU run's.", "",
        "command: `python -m benchmarks.parallel " + " ".join(argv if argv is not None else sys.argv[1:]) + "`", "",
        results_table(rows, cols)])
    stem = "parallel_smoke_cpu" if args.smoke else f"parallel_{card}_{max(counts)}gpu"
    record = {"rows": rows, "env": env, "command": " ".join(["python -m benchmarks.parallel", *(argv or sys.argv[1:])])}
    for path in write_results(Path(args.out), stem, record, md):
        if not quiet:
            print(f"wrote {path}")
    if not quiet:
        print(md)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="largest GPU count to measure (1, 2, 4, ...)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--timeout", type=float, default=1500)
    p.add_argument("--out", default=results_dir("parallel"))
    add_commit_argument(p)
    p.add_argument("--configs", choices=("all", "default"), default="all",
                   help="per GPU count: every configuration, or only the one `--nproc N` picks")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo processes, wan2.1-tiny (plumbing only)")
    p.add_argument("--backend", default=None,
                   help="the Wan blocks' torch.compile backend instead of the spec's (e.g. eager: dynamo alone, for "
                        "a smoke run that checks the processes and the split, not generated code)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step per configuration on rank 0: ms of communication, attention, "
                        "matmul and other kernels (the row's profile_ms)")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("workload", "model", "mode", "parallel", "ref", "result"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    for name in ("height", "width", "frames"):
        p.add_argument(f"--{name}", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.worker:
        worker(args)
        return 0

    rows: list[dict[str, Any]] = []
    counts = [n for n in (1, 2, 4, 8) if n <= args.gpus]
    with tempfile.TemporaryDirectory() as refs:
        if args.smoke:
            ref = Path(refs) / "smoke.pt"
            rows.append(run_config("smoke", 1, {}, args, ref, True))
            rows.append(run_config("smoke", 2, {"cfg": True}, args, ref, True))
        else:
            for w in args.workloads.split(","):
                if w not in WORKLOADS:
                    raise SystemExit(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
                ref = Path(refs) / f"{w}.pt"
                for n in counts:
                    for par in configs(n, WORKLOADS[w][1], args.configs):
                        rows.append(run_config(w, n, par, args, ref, False))
                        _write(rows, args, argv, counts, quiet=True)  # a row is kept even if a later one hangs
    _write(rows, args, argv, counts)
    return 0 if all("ms" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
