"""Weight offload under a memory cap: magi_zoo's planner + streaming against resident compiled
and diffusers group offload, one transformer forward, at several budgets.

    python -m benchmarks.offload                                          # the GPU table (H100)
    python -m benchmarks.offload --models flux.1-dev                      # one model
    python -m benchmarks.offload --models ltx-2 --strategies resident,magi_zoo_fp8 --label fp8
                                                                          # other rows, a file of their own
    python -m benchmarks.offload --pipeline                               # whole Wan I2V generation
    python -m benchmarks.offload --smoke --out /tmp/offload-smoke         # CPU, tiny model

GPU rows (random weights at the published configs, bf16, batch 1, regional compile):
- Wan2.1-I2V-14B-480P at 480x832x81, budgets 12 / 16 / 24 / 40 GiB;
- Flux.1-dev at 1024^2, budget 12 GiB;
- BAGEL-7B-MoT, one text-to-image denoising step with CFG (its denoise entry), 24 GiB;
- Qwen-Image at 1328^2 and FLUX.2-dev at 768x1360, 24 GiB.

Strategies, each in its own process (so peaks and caps are honest):
- resident:   `magi_zoo.load(model, gpu="auto")` with its shipped spec (everything on the card,
              no cap: the speed the others are measured against);
- magi_zoo:   the same with `memory_budget_gib=B`, under a hard cap of B GiB set *before* the
              build (`torch.cuda.set_per_process_memory_fraction`), so placing the weights is
              capped too;
- magi_zoo_fp8 (on request, `--strategies ...,magi_zoo_fp8`): the same with precision="fp8"
              (fp8 block linears: half the bytes to hold or stream; its error against the
              bf16 resident row is fp8's);
- magi_zoo_refit (on request): magi_zoo, then `offload.refit` on the first call: the plan
              re-made on the measured activation peak (x1.25, >= +0.25 GiB) instead of the
              spec's reserve, more units resident where it is lower;
- diffusers:  the transformer built in host memory, diffusers' `apply_group_offloading`
              (block level, one block per group, `use_stream=True`) and
              `compile_repeated_blocks(fullgraph=False)` (fullgraph=True fails: dynamo traces
              the onload hook), under the same cap. It streams every block and holds only the
              transformer (magi_zoo's plan also budgets the text encoder, image encoder and VAE);
- diffusers_fa3 (on request): the same with every attention processor on the FA3 kernel the
              resident and magi_zoo rows run (benchmarks/baselines.py): the same-kernel baseline,
              beside the SDPA one.

`--phase-residency`: the magi_zoo rows with the offload root's phase_residency = true (resident
blocks leave the card while another component needs the room; recorded per row).

`--pipeline`: the whole Wan2.1-I2V-14B-480P generation (text and image encoders, N denoising
steps with CFG, VAE decode; default 4 steps) resident vs magi_zoo at 24 GiB, under the cap
for the whole generation: seconds per step (median of steps 2..N) and the process's
max_memory_reserved (CFG included).

Every row records ms per forward (CUDA events, 2 warm-up, 5 timed, median), the measured
`torch.cuda.max_memory_reserved()` and `max_memory_allocated()` over the timed calls *and*
over the whole process (build, apply, compile), the plan's expected peak and copy time,
compile counters, and the relative error against the resident row's output. Output:
benchmarks/results/offload/offload_<card>[_<models>][_<budgets>gib][_<label>].json / .md (and
offload_smoke.* for --smoke). A command whose file would replace rows it does not measure
again (an fp8 run after a bf16 one of the same model) is refused before it measures anything:
`--label` gives it a file of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

from benchmarks import common

GPU_CASES = [  # (model, shape, budgets GiB)
    ("wan2.1-i2v-14b-480p", {"height": 480, "width": 832, "frames": 81}, [12, 16, 24, 40]),
    ("flux.1-dev", {"height": 1024, "width": 1024}, [12]),
    # The small Wan: its UMT5-XXL text encoder (11 GiB) is 4x the transformer (2.6 GiB); at
    # 12 GiB the plan streams the encoder (on the card only while it encodes) and keeps every
    # block resident: the transformer forward runs at resident speed (the VAE phase's 9 GiB
    # reserve sets the floor; `--models wan2.1-t2v-1.3b`).
    ("wan2.1-t2v-1.3b", {"height": 480, "width": 832, "frames": 81}, [12]),
    # BAGEL's denoise entry is one whole CFG step. Not a diffusers model: no diffusers row.
    # Both rows run the whole-graph entry points eager around the regional MoT layers (the
    # [gpu.rtx4090] plan; a whole-graph region over a streamed layer is refused), so the
    # ratio is the cost of streaming alone.
    ("bagel-7b-mot", {}, [24]),
    # The issue-33 families' largest published variants at their default sizes under 24 GiB
    # (`--models qwen-image`, `--models flux.2-dev`: one command each, docs/benchmarks.md has the
    # rows; every one is bound by its host-to-card copies). FLUX.2-dev's 64 GiB transformer plus
    # the 44 GiB encoder exceed an 80 GiB card: its "resident" row is the 80 GiB plan, which
    # streams the encoder and keeps every block resident (`magi-zoo spec flux.2-dev`).
    ("qwen-image", {"height": 1328, "width": 1328}, [24]),
    ("flux.2-dev", {"height": 768, "width": 1360}, [24]),
    # HunyuanVideo-1.5 (one 8.3B transformer for every variant; the 480p shape, whose L x L
    # attention mask is 2.4 GiB) and LTX-2 (19B transformer + Gemma-3-12B) under 24 GiB
    # (`--models hunyuanvideo-1.5-480p-t2v`, `--models ltx-2`). A streamed row of these builds the
    # random-weight model in host memory first: LTX-2's took 120 s, FLUX.2-dev's 186 s (H200 host,
    # 16 cores), which is why `--row-timeout` must leave a few minutes.
    ("hunyuanvideo-1.5-480p-t2v", {"height": 480, "width": 848, "frames": 121}, [24]),
    ("ltx-2", {"height": 512, "width": 768, "frames": 121}, [24]),
]
CASE_COMPILE = {"bagel-7b-mot": {"model": {"denoise_step": {"enabled": False}, "decode_step": {"enabled": False}}}}
NO_DIFFUSERS = {"bagel-7b-mot"}
# The tiny smoke model: no activation reserves (the spec's are for the published shapes).
NO_RESERVE = {"offload": {"": {"activation_gib": 0.0}, "vae.encoder": {"phase_activation_gib": 0.0},
                          "vae.decoder": {"phase_activation_gib": 0.0}}}
SMOKE_CASES = [("wan2.1-tiny", {}, [0.00025])]  # 256 KiB: most of the tiny model streams
PIPELINE_CASE = ("wan2.1-i2v-14b-480p", {"height": 480, "width": 832, "num_frames": 81}, [24])
SMOKE_PIPELINE_CASE = ("wan2.1-tiny", {}, [0.00025])
STRATEGIES = ("resident", "magi_zoo", "diffusers")  # the default
KNOWN_STRATEGIES = (*STRATEGIES, "magi_zoo_fp8", "magi_zoo_refit", "diffusers_fa3")
DIFFUSERS_ROWS = ("diffusers", "diffusers_fa3")


def _cap(budget_gib: float | None) -> None:
    import torch

    if budget_gib is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * 2**30 / total))


def worker(args) -> dict[str, Any]:
    import torch

    import magi_zoo
    from magi_zoo import adapters
    from magi_zoo.engine import offload as off

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    gpu = "auto" if cuda else "cpu"  # the plan of the card it runs on (h100, h200, ...)
    shape = json.loads(args.shape)
    budget = None if args.strategy == "resident" else args.budget
    _cap(budget)  # before anything touches the card: the cap must hold for the build too
    compile_kw = {} if cuda else {"compile": {"WanTransformerBlock": {"backend": "eager"}}}
    if args.model in CASE_COMPILE:
        compile_kw = {"compile": {**compile_kw.get("compile", {}), **CASE_COMPILE[args.model]}}
    over = None if cuda else NO_RESERVE
    residency = bool(args.phase_residency and args.strategy != "resident")
    if residency:
        section = (over or {}).get("offload", {})
        over = {"offload": {**section, "": {**section.get("", {}), "phase_residency": True}}}
    rec: dict[str, Any] = {"model": args.model, "strategy": args.strategy, "budget_gib": budget, "shape": shape,
                           "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "phase_residency": residency}
    adapter, variant = adapters.lookup(args.model)
    import time

    t_build = time.perf_counter()
    torch.manual_seed(0)  # every row builds its random weights from the same seed
    if args.strategy in ("resident", "magi_zoo", "magi_zoo_fp8", "magi_zoo_refit"):
        # magi_zoo_fp8: the same plan with the spec's fp8 linears (precision="fp8"): the
        # blocks stream half the bytes, so more of them stay resident at the same budget.
        fp8 = {"precision": "fp8"} if args.strategy == "magi_zoo_fp8" else {}
        h = magi_zoo.load(args.model, gpu=gpu, weights="random", overrides=over,
                          memory_budget_gib=budget, **compile_kw, **fp8)
        module, method = adapter.entry(h.pipe, "denoise")
        report = h.report()
        rt = off.runtime(h.modules)
        if rt is not None:
            rec["plan"] = rt.plan.to_dict()
        rec["offload_step"] = report.step("offload").did
    else:
        from diffusers.hooks import apply_group_offloading

        dt = torch.bfloat16 if cuda else torch.float32
        pipe = adapter.build(variant, weights="random", dtype=dt, device=torch.device("cpu"))
        module, method = adapter.entry(pipe, "denoise")
        apply_group_offloading(module, onload_device=dev, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=cuda)
        if args.strategy == "diffusers_fa3":
            from benchmarks import baselines

            why = baselines.missing_reason(args.strategy, dev.type)
            if why:
                raise RuntimeError(why)
            rec["attention_layers_on_fa3"] = baselines.set_attention_backend(module, baselines.fa3_member())
        module.compile_repeated_blocks(fullgraph=False, **({} if cuda else {"backend": "eager"}))
        h, report, rt = None, None, None
    rec["build_apply_s"] = round(time.perf_counter() - t_build, 1)  # build + plan + placement (+ pinning)
    if h is not None:
        rec["load_timings"] = h.timings
    print(f"[bench]   loaded in {rec['build_apply_s']} s {rec.get('load_timings', '')}", flush=True)
    rec["weights_fingerprint"] = _fingerprint(module)
    if args.pipeline:
        return {**rec, **_pipeline_row(h, shape, args.steps, dev)}
    inputs = adapter.example_inputs(h.pipe if h else pipe, variant, "denoise", **shape)
    inputs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    fn = getattr(module, method)

    def call():
        with torch.inference_mode():
            return fn(**inputs)

    out, first_s = common.first_call(call, dev)
    rec["first_call_s"] = round(first_s, 2)
    if args.strategy == "magi_zoo_refit" and rt is not None:
        t0 = time.perf_counter()
        generation = _refit_call(h, shape)
        fit = off.refit(h.modules, generation or call)
        rec["refit"] = {"measured_gib": fit.get("measured_gib"), "measured_on": "one 1-step generation"
                        if generation else "one forward", "reserve_gib": fit["reserve_gib"],
                        "made_resident": len(fit["made_resident"]), "made_streamed": len(fit["made_streamed"]),
                        "seconds": round(time.perf_counter() - t0, 2)}
        rec["plan"] = rt.plan.to_dict()
        print(f"[bench]   refit: {rec['refit']}", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rec.update(common.time_calls(call, dev, warmup=args.warmup, runs=args.runs))
    if cuda:
        rec["timed_max_reserved_gib"] = common.gib(torch.cuda.max_memory_reserved())
        rec["timed_max_allocated_gib"] = common.gib(torch.cuda.max_memory_allocated())
    out = call()
    out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "sample", out)
    torch.save(out.float().cpu(), Path(args.tmp) / f"{args.tag}.pt")
    if report is not None:
        rec["frames_compiled"], rec["graph_breaks"], rec["recompiles"] = report.frames, report.graph_breaks, report.recompiles
        reasons = [f"{r.name}: {why}" for r in report.regions for why in r.counters.recompiles]
        if reasons:  # what a recompile guarded on, so a row never shows a bare count
            rec["recompile_reasons"] = reasons
    if rt is not None:
        rec["offload_counters"] = rt.stats()
    if args.strategy == "resident" and args.predict and h is not None:
        rec["predicted"] = _predict(h, module, call, dev, gpu, [float(b) for b in args.predict.split(",")])
    return rec


def _generation_kwargs(h, shape: dict) -> dict[str, Any]:
    """A whole generation's call through the handle at `shape`: the prompt, the size the
    pipeline takes (a forward shape's `frames` as `num_frames`), a random input image where
    the pipeline wants one, numpy output, a seeded generator."""
    import inspect

    import numpy as np
    import torch
    from PIL import Image

    params = inspect.signature(h.pipe.__call__).parameters
    kw: dict[str, Any] = {k: v for k, v in shape.items() if k in params}
    if "frames" in shape and "num_frames" in params:
        kw["num_frames"] = shape["frames"]
    if "image" in params:
        w, hh = shape.get("width", 64), shape.get("height", 64)
        kw["image"] = Image.fromarray((np.random.default_rng(0).random((hh, w, 3)) * 255).astype("uint8"))
    return dict(prompt="a corgi surfing a wave at sunset", output_type="np",
                generator=torch.Generator().manual_seed(0), **kw)


def _refit_call(h, shape: dict):
    """refit's measuring call: one 1-step generation through a diffusers pipeline (every
    component runs, so each phase -- text encoder, denoiser, VAE -- gets its measured
    reserve); None for other pipelines (then one forward measures the denoiser's phase)."""
    import inspect

    if not {"prompt", "num_inference_steps"} <= set(inspect.signature(h.pipe.__call__).parameters):
        return None
    import torch

    kw = _generation_kwargs(h, shape)

    def call():
        # Under inference_mode like the timed forwards: a pipeline's own no_grad would hand
        # the compiled blocks normal tensors where they were compiled for inference tensors
        # (a dispatch-key guard: one recompile per block class, seen on H100 at cfac6fe).
        with torch.inference_mode():
            return h(num_inference_steps=1, **kw)
    return call


def _predict(h, module, call, dev, gpu: str, budgets: list[float]) -> dict[str, Any]:
    """The planner's prediction per budget from this (resident) process's measured per-block
    times: expected copy ms, simulated wait ms per forward and expected peak -- to set
    against what the magi_zoo rows measure."""
    from magi_zoo.engine import offload as off
    from magi_zoo.engine.cuda_graphs import bypassed
    from magi_zoo.engine.offload import OffloadPlanError
    from magi_zoo.specs import get_profile

    entry = next(p for p, m in h.modules.named_modules() if m is module)
    specs, _ = off.find_units(h.plan, h.modules)
    paths = [u.path for u in specs if u.path.startswith(entry + ".")]
    # The resident plan may replay the forward from a CUDA graph (a spec's cuda_graphs
    # section): a replay runs no hooks, so the blocks are timed on the method itself. A streamed
    # plan yields the graphs anyway, so these are the times it runs.
    with bypassed(h.modules):
        times = off.profile_units(h.modules, paths, call, dev)
    out: dict[str, Any] = {"block_ms": {p: round(t * 1e3, 3) for p, t in list(times.items())[:3]}}
    for b in budgets:
        try:
            plan, _, _, _ = off.plan_units(h.modules, h.plan, get_profile(gpu), budget_gib=b, times_s=times)
        except OffloadPlanError as e:
            out[str(b)] = {"refused": str(e)}
            continue
        out[str(b)] = {"copy_ms": round(plan.copy_s.get(entry, 0.0) * 1e3, 2),
                       "simulated_wait_ms": round(plan.stall_s.get(entry, 0.0) * 1e3, 2),
                       "expected_peak_gib": round(plan.expected_peak / 2**30, 3),
                       "streamed_units": len(plan.streamed)}
    return out


def _pipeline_row(h, shape: dict, steps: int, dev) -> dict[str, Any]:
    """One whole generation through the handle (encoders, `steps` CFG steps, VAE decode):
    seconds per step from the step callback, and the peaks over the whole process."""
    import time

    import numpy as np
    import torch

    from magi_zoo.engine import offload as off

    stamps: list[float] = []

    def on_step(pipe, i, t, kw):
        common.sync(dev)
        stamps.append(time.perf_counter())
        return {}

    call = dict(num_inference_steps=steps, callback_on_step_end=on_step, **_generation_kwargs(h, shape))
    t0 = time.perf_counter()
    out = h(**call)
    common.sync(dev)
    total = time.perf_counter() - t0
    per_step = [b - a for a, b in zip(stamps, stamps[1:])]  # steps 2..N: the first one compiles
    rec = {"steps": steps, "generation_s": round(total, 2),
           "s_per_step_median": round(float(np.median(per_step)), 4) if per_step else None,
           "frames_shape": list(np.asarray(out.frames).shape)}
    if dev.type == "cuda":
        rec["process_max_reserved_gib"] = common.gib(torch.cuda.max_memory_reserved())
        rec["process_max_allocated_gib"] = common.gib(torch.cuda.max_memory_allocated())
    rt = off.runtime(h.modules)
    if rt is not None:
        rec["offload_counters"] = rt.stats()
    return rec


def _chart(rows: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """Speed against budget (resident = 1.0), one line per strategy; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    pts: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("speed_vs_resident") and r.get("budget_gib"):
            pts.setdefault(r["strategy"], []).append((float(r["budget_gib"]), float(r["speed_vs_resident"])))
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, xy in sorted(pts.items()):
        by_budget: dict[float, list[float]] = {}
        for x, y in xy:
            by_budget.setdefault(x, []).append(y)
        xs = sorted(by_budget)
        line = ax.plot(xs, [sum(by_budget[x]) / len(by_budget[x]) for x in xs], marker="o", label=name)
        # A budget measured in several runs: every measurement drawn, the line through their mean.
        ax.scatter([x for x, _ in xy], [y for _, y in xy], s=12, color=line[0].get_color(), alpha=0.6)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="resident compiled")
    ax.set_xlabel("memory budget (GiB, hard cap)")
    ax.set_ylabel("speed vs resident compiled")
    ax.set_ylim(0, 1.1)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def merge(files: list[str], out: Path) -> list[Path]:
    """One table (and chart) from the JSONs of split runs of the same card.

    Every row keeps the file it came from and is compared with *that file's* resident row
    (measured in the same run, or the earlier run a `--reference` file names): two runs'
    resident speeds differ by a percent or two, and a ratio across runs would mix that in.
    A resident row that several files carry (a `--reference` copy) is listed once."""
    rows, env, seen, first_base, commits = [], None, set(), {}, []
    for f in files:
        rec = json.loads(Path(f).read_text())
        env = env or rec["environment"]
        commits.append(f"{Path(f).name} ({rec['environment'].get('commit', '?')})")
        base = {r["model"]: r.get("median_ms") for r in rec["rows"]
                if r["strategy"] == "resident" and r.get("status") == "ok"}
        for model, ms in base.items():
            first_base.setdefault(model, ms)
        # A file without a resident row (split off by hand before --reference existed) is
        # compared with the first file's: list that file first, from the same run.
        base = {**first_base, **base}
        for r in rec["rows"]:
            r = {**r, "source": Path(f).name, "resident_ms": base.get(r["model"])}
            if r["strategy"] == "resident":
                if (r["model"], r.get("median_ms")) in seen:
                    continue
                seen.add((r["model"], r.get("median_ms")))
            elif r["resident_ms"] and r.get("median_ms"):
                r["speed_vs_resident"] = round(r["resident_ms"] / r["median_ms"], 3)
            rows.append(r)
    cols = ["model", "strategy", "budget_gib", "status", "median_ms", "resident_ms", "speed_vs_resident",
            "timed_max_reserved_gib", "expected_peak_gib", "streamed_units", "predicted_ms", "source"]
    md = ["# Weight offload: one transformer forward under a memory cap (merged runs)", "",
          common.env_line(env), "",
          "Merged from (commit): " + ", ".join(commits) + ". Each row's speed_vs_resident is "
          "against resident_ms, the resident row of its own file (same run, or the run its --reference "
          "named; the first file's where a file has none); the chart draws each budget's mean where a budget was measured more than once.", "",
          common.results_table(sorted(rows, key=lambda r: (r["model"], r.get("budget_gib") or 0, r["strategy"])), cols)]
    card = common.card_tag(env)
    written = common.write_results(out, f"offload_{card}_merged", {"environment": env, "rows": rows}, "\n".join(md))
    for model in dict.fromkeys(r["model"] for r in rows):
        png = _chart([r for r in rows if r["model"] == model], out / f"offload_{card}_{model}.png",
                     f"{model}: one forward under a memory cap ({env.get('card')})")
        if png:
            written.append(png)
    return written


def _fingerprint(module) -> float:
    """A checksum of the denoiser's first large weight (wherever it lives): rows whose
    fingerprints differ were built with different random weights."""
    import torch

    w = max(module.parameters(), key=lambda p: p.numel())
    with torch.no_grad():
        return round(float(w.detach().float().flatten()[:65536].sum().cpu()), 4)


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=common.results_dir("offload"))
    common.add_commit_argument(p)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 1 warm-up / 2 runs")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--models", default=None, help="comma-separated subset of the cases' models")
    p.add_argument("--budgets", default=None, help="comma-separated budgets in GiB (default: each case's)")
    p.add_argument("--pipeline", action="store_true", help="whole generations instead of one forward")
    p.add_argument("--steps", type=int, default=4, help="--pipeline: denoising steps (CFG on)")
    p.add_argument("--row-timeout", type=float, default=3600,
                   help="seconds per row (one strategy at one budget, its own process); a row past it is recorded "
                        "as an error and the next one runs")
    p.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for every row (set before CUDA starts): "
                        "fewer reserved-but-unused blocks under the cap (the 24 GiB I2V generation failed with "
                        "2.97 GiB reserved but unallocated); recorded in every row")
    p.add_argument("--phase-residency", action="store_true",
                   help="the magi_zoo rows with the offload section's phase_residency = true (resident blocks "
                        "leave the card while another component, e.g. the VAE, needs the room); recorded per row")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="merge the results JSONs of split runs into one table and a speed-vs-budget chart")
    p.add_argument("--label", default=None,
                   help="a word in the results file's name, so runs of other strategies of one model do not "
                        "replace each other's file (e.g. --label fp8 for a run of its fp8 rows)")
    p.add_argument("--reference", default=None,
                   help="a results JSON of an earlier run whose resident rows serve as this run's baseline "
                        "(when this run has no resident strategy; same card)")
    # worker mode (one strategy in this process)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    for a in ("--model", "--strategy", "--shape", "--tmp", "--tag", "--result"):
        p.add_argument(a, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--runs", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--predict", default=None, help=argparse.SUPPRESS)
    p.set_defaults(pipeline=False)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if not args.one and not args.merge:
        import difflib

        for s in args.strategies.split(","):
            if s not in KNOWN_STRATEGIES:
                near = difflib.get_close_matches(s, KNOWN_STRATEGIES, n=1)
                p.error(f"unknown strategy {s!r}{f' (did you mean {near[0]!r}?)' if near else ''}; "
                        f"choose from {', '.join(KNOWN_STRATEGIES)}")
        if args.pipeline and any(s in args.strategies.split(",") for s in ("magi_zoo_fp8", "magi_zoo_refit")):
            p.error("--pipeline measures resident and magi_zoo only (a whole generation); drop magi_zoo_fp8 / "
                    "magi_zoo_refit or measure them on one forward (without --pipeline)")
    if args.expandable_segments:  # before any CUDA work; the rows' / ranks' processes inherit it
        common.use_expandable_segments()
    if args.one:
        try:
            rec = {"status": "ok", **worker(args)}
        except Exception as e:
            rec = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        Path(args.result).write_text(json.dumps(rec, default=str))
        return 0

    if args.merge:
        for path in merge(args.merge, Path(args.out)):
            print(f"wrote {path}")
        return 0

    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the offload benchmark needs CUDA (or --smoke for the CPU path)")
    cases = SMOKE_CASES if args.smoke else GPU_CASES
    if args.pipeline:
        cases = [SMOKE_PIPELINE_CASE if args.smoke else PIPELINE_CASE]
        strategies = [s for s in args.strategies.split(",") if s not in DIFFUSERS_ROWS]
        args.strategies = ",".join(strategies)
    if args.budgets:
        cases = [(m, shp, [float(b) for b in args.budgets.split(",")]) for m, shp, _ in cases]
    if args.models:
        cases = [c for c in cases if c[0] in args.models.split(",")]
    strategies = args.strategies.split(",")
    warm, runs = (1, 2) if args.smoke else (2, 5)
    # One spelling of a budget for every row: a worker records its --budget as a float (24.0) and
    # the resident row keys its predictions by str(float); a row that never reported back keeps
    # the plan's value, which must match them both.
    cases = [(m, shp, [float(b) for b in budgets]) for m, shp, budgets in cases]
    plans = {model: _row_plan(model, budgets, strategies) for model, _, budgets in cases}
    # A split run's file carries the reference's resident rows (`_publish`): those are kept too.
    kept = {(m, "resident", None) for m in plans} if args.reference and "resident" not in strategies else set()
    _refuse_losing_rows(Path(args.out) / f"{_stem(args, common.environment(torch.device(device)))}.json", plans, kept)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="offload-bench-"))
    for model, shape, budgets in cases:
        plan = plans[model]
        ref, ref_fp = None, None
        for strategy, budget in plan:
            tag = f"{model}-{strategy}-{budget}"
            result = tmp / f"{tag}.json"
            print(f"[bench] {model} {strategy} budget={budget} GiB ...", flush=True)
            rec = common.run_isolated("benchmarks.offload", [
                "--one", "--model", model, "--strategy", strategy, "--shape", json.dumps(shape),
                "--tmp", str(tmp), "--tag", tag, "--result", str(result), "--device", device,
                "--warmup", str(warm), "--runs", str(runs), *(["--budget", str(budget)] if budget else []),
                *(["--pipeline", "--steps", str(args.steps)] if args.pipeline else []),
                *(["--phase-residency"] if args.phase_residency else []),
                *(["--predict", ",".join(map(str, budgets))] if strategy == "resident" and not args.pipeline else [])],
                result_file=result, timeout=args.row_timeout)
            rec.setdefault("model", model)
            rec.setdefault("strategy", strategy)
            rec.setdefault("budget_gib", budget)
            out_file = tmp / f"{tag}.pt"
            if rec.get("status") == "ok" and out_file.is_file():
                out = torch.load(out_file, weights_only=True)
                if strategy == "resident":
                    ref, ref_fp = out, rec.get("weights_fingerprint")
                elif ref is not None and rec.get("weights_fingerprint") == ref_fp:
                    rec["rel_err_vs_resident"] = round(_rel(out, ref), 6)
                elif ref is not None:
                    # Random weights built on the card (resident) and in host memory (streamed
                    # rows) come from different generators: an error between them would be
                    # the distance between two random models, so none is reported.
                    rec["rel_err_vs_resident"] = "different random weights"
            rows.append(rec)
            print(f"[bench]   -> {rec.get('status')}: {rec.get('median_ms')} ms, {rec.get('s_per_step_median')} s/step, "
                  f"peak reserved {rec.get('timed_max_reserved_gib') or rec.get('process_max_reserved_gib')} GiB, "
                  f"build+apply {rec.get('build_apply_s')} s, first call {rec.get('first_call_s')} s "
                  f"{rec.get('error', '')[:200]}", flush=True)
            # Written after every row: a command cut short (a time limit) keeps the rows it measured.
            _publish(args, rows, device, quiet=True)
    for path in _publish(args, rows, device):
        print(f"wrote {path}")
    return 0


def _row_plan(model: str, budgets: list[float], strategies: list[str]) -> list[tuple[str, float | None]]:
    """The (strategy, budget) rows a command measures for `model`, in the order it runs them."""
    plan = [("resident", None)] if "resident" in strategies else []
    return plan + [(s, b) for b in budgets for s in ("magi_zoo", "magi_zoo_refit", "magi_zoo_fp8", *DIFFUSERS_ROWS)
                   if s in strategies and not (s in DIFFUSERS_ROWS and model in NO_DIFFUSERS)]


def _stem(args, env: dict[str, Any]) -> str:
    """The results file's name (without suffix): the card, the models and budgets when given, the label."""
    stem = f"offload{'_pipeline' if args.pipeline else ''}_{'smoke' if args.smoke else common.card_tag(env)}"
    if args.models and not args.pipeline:
        stem += "_" + args.models.replace(",", "_")
    if args.budgets:
        stem += "_" + args.budgets.replace(",", "_") + "gib"
    return stem + (f"_{args.label}" if args.label else "")


def _refuse_losing_rows(path: Path, plans: dict[str, list[tuple[str, float | None]]], kept=frozenset()) -> None:
    """Refuse, before anything is measured, a command whose results file would replace one that
    holds rows it does not measure again (another strategy's rows of the same model, say: an
    fp8 run after a bf16 one): they would be lost. Re-measuring the same rows is allowed."""
    if not path.is_file():
        return
    try:
        earlier = json.loads(path.read_text()).get("rows", [])
    except (OSError, ValueError):
        return  # not a results file this script wrote: nothing of ours to keep
    planned = {(m, s, b) for m, plan in plans.items() for s, b in plan} | set(kept)
    lost = sorted({(r.get("model"), r.get("strategy"), None if r.get("budget_gib") is None else float(r["budget_gib"]))
                   for r in earlier} - planned, key=str)
    if lost:
        listed = ", ".join(f"{m} {s}" + (f" at {b:g} GiB" if b is not None else "") for m, s, b in lost)
        raise SystemExit(f"{path} holds rows this command does not measure ({listed}); writing it would lose them. "
                         "Pass --label WORD (a file of its own), another --out folder, or measure those rows too.")


def _publish(args, rows: list[dict], device: str, quiet: bool = False) -> list[Path]:
    """The results files (json, md, chart) from the rows measured so far."""
    import torch

    rows = [dict(r) for r in rows]
    strategies = args.strategies.split(",")
    warm, runs = (1, 2) if args.smoke else (2, 5)
    if args.reference and "resident" not in strategies:
        # Rows of a split run (each command under the device's time limit) measured against
        # the resident rows of the first command, on the same card.
        earlier = json.loads(Path(args.reference).read_text())
        rows = [r for r in earlier["rows"] if r.get("strategy") == "resident"] + rows
    key = "s_per_step_median" if args.pipeline else "median_ms"
    resident = {r["model"]: r.get(key) for r in rows if r["strategy"] == "resident" and r.get("status") == "ok"}
    for r in rows:
        base = resident.get(r["model"])
        if base and r.get(key):
            r["speed_vs_resident"] = round(base / r[key], 3)
        plan = r.get("plan") or {}
        r["expected_peak_gib"] = plan.get("expected_peak_gib")
        r["resident_units"] = len(plan.get("resident", [])) if plan else None
        r["streamed_units"] = len(plan.get("streamed", [])) if plan else None
        r["expected_copy_ms"] = (plan.get("copy_ms_per_call") or {}).get("transformer")
        pred = next((x.get("predicted", {}) for x in rows if x["model"] == r["model"] and x["strategy"] == "resident"), {})
        if r["strategy"] == "magi_zoo" and str(r.get("budget_gib")) in pred and base:  # bf16 plans only
            wait = pred[str(r["budget_gib"])].get("simulated_wait_ms")
            r["predicted_ms"] = None if wait is None else round(base + wait, 2)
    env = common.environment(torch.device(device))
    record = {"environment": env, "smoke": args.smoke, "warmup": warm, "runs": runs, "rows": rows}
    if args.pipeline:
        cols = ["model", "strategy", "budget_gib", "status", "steps", "s_per_step_median", "speed_vs_resident",
                "generation_s", "process_max_reserved_gib", "process_max_allocated_gib", "expected_peak_gib",
                "resident_units", "streamed_units"]
    else:
        cols = ["model", "strategy", "budget_gib", "status", "median_ms", "speed_vs_resident", "timed_max_reserved_gib",
            "timed_max_allocated_gib", "expected_peak_gib", "resident_units", "streamed_units", "expected_copy_ms",
                "predicted_ms", "first_call_s", "rel_err_vs_resident", "recompiles", "graph_breaks"]
    what = "a whole generation" if args.pipeline else "one transformer forward"
    md = [f"# Weight offload: {what} under a memory cap{' (SMOKE: CPU, tiny)' if args.smoke else ''}",
          "", common.env_line(env), "",
          "`timed_max_reserved_gib`: torch.cuda.max_memory_reserved() over the timed calls, under a hard cap of "
          "budget_gib (set_per_process_memory_fraction, set before the build). speed_vs_resident = resident ms / "
          "this row's ms; predicted_ms = resident ms + the planner's simulated wait for copies, from block times measured in the resident run. diffusers = group offload (block level, stream) + compile_repeated_blocks(fullgraph=False).",
          "", common.results_table(rows, cols)]
    fits = [f"- {r['model']} {r['budget_gib']} GiB: measured on {r['refit'].get('measured_on', 'one forward')}: activations "
            f"{r['refit']['measured_gib']} GiB -> reserve "
            f"{r['refit']['reserve_gib']}; {r['refit']['made_resident']} unit(s) made resident, "
            f"{r['refit']['made_streamed']} made streamed ({r['refit']['seconds']} s)" for r in rows if r.get("refit")]
    if fits:
        md += ["", "Refit on the first call (magi_zoo_refit):", *fits]
    errors = [f"- {r['model']} {r['strategy']} {r.get('budget_gib')}: {r.get('error')}" for r in rows if r.get("status") != "ok"]
    if errors:
        md += ["", "Errors:", *errors]
    stem = _stem(args, env)
    written = common.write_results(Path(args.out), stem, record, "\n".join(md))
    if not args.pipeline and not quiet:
        for model in dict.fromkeys(r["model"] for r in rows):
            png = _chart([r for r in rows if r["model"] == model], Path(args.out) / f"{stem}_{model}.png",
                         f"{model}: one forward under a memory cap ({env.get('card')})")
            if png:
                written.append(png)
    return written


if __name__ == "__main__":
    raise SystemExit(main())
