"""Where a forward's GPU time goes: a torch.profiler breakdown by kernel category.

    pip install -e ".[hopper]"    # on a CUDA machine: the fa3-fwd wheel (docs/attention.md)
    python -m benchmarks.profile_forward --model wan2.1-t2v-1.3b
    python -m benchmarks.profile_forward --model wan2.1-t2v-1.3b --precision fp8
    python -m benchmarks.profile_forward --model flux.2-dev --baseline diffusers_regional_fa3
    python -m benchmarks.profile_forward --smoke --out /tmp/prof      # CPU, tiny: the script works

Loads the model with random weights at its published config under the shipped plan
(`magi_zoo.load(..., gpu="auto")`, optionally `precision="fp8"`), warms up (compiles), then
profiles `--runs` forwards of the family's first entry (the denoiser step) on its example
inputs. `--baseline NAME` profiles a baseline instead, built as `benchmarks.run` builds that
row (diffusers' pipeline with no plan applied, then `compile_repeated_blocks(fullgraph=True)`,
and for the `baselines.BASELINES` rows their attention backend / torchao fp8): the two profiles
of one run side by side say which kernels the engine changed and which it shares.

Kernels are grouped: attention (flash / FA3 / cuDNN / SDPA kernels), gemm (cuBLAS,
cuBLASLt, CUTLASS, nvjet; fp8 `_scaled_mm` included), triton (inductor's fused elementwise
and reduction kernels: ``triton_poi`` pointwise, ``triton_red`` / ``triton_per``
reductions), other. Also reported: GPU busy time against the wall time of the forward (the
gap is launch overhead and host work, what CUDA graphs would remove). Writes
``profile_<model>_<label, baseline or precision>_<card>.{json,md}`` with the top kernels.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from benchmarks import baselines, common

CATEGORIES = (  # first match wins; inductor's kernels first: their names list the origins of
    # the fused nodes (a quantization epilogue reads "..._scaled_mm_...") but they are Triton
    ("triton_pointwise", re.compile(r"^triton_poi", re.I)),
    ("triton_reduction", re.compile(r"^triton_(red|per)", re.I)),
    ("triton_other", re.compile(r"^triton", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|cudnn.*(sdpa|mha)|FlashAttn", re.I)),
    ("gemm", re.compile(r"gemm|sm90_xmma|cutlass|nvjet|cublas|Kernel2|scaled_mm|_mm_|matmul", re.I)),
)


def category(name: str) -> str:
    for cat, rx in CATEGORIES:
        if rx.search(name):
            return cat
    return "other"


def _device_us(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


# The baselines this script can profile: diffusers' regional compile and the same-kernel rows.
PROFILED_BASELINES = ("diffusers_regional", *baselines.BASELINES)


def _plan_line(handle) -> str:
    """The shipped plan's attention and precision steps, as the report says them."""
    report = handle.report()
    return f"{report.step('attention').did.split('; custom ops')[0]} | {report.step('precision').did}"


def _set_up_baseline(name: str, module, method: str, cuda: bool) -> str:
    """Set `module` up as benchmarks.run sets up the `name` row (the regional compile happens on
    the first call); returns the plan line for the profile."""
    if method != "forward" or not callable(getattr(module, "compile_repeated_blocks", None)):
        raise SystemExit(f"--baseline {name}: {type(module).__name__}.{method} is not a diffusers model's forward "
                         "with compile_repeated_blocks")
    kw = {} if cuda else {"backend": "eager"}
    if name == "diffusers_regional":
        module.compile_repeated_blocks(fullgraph=True, **kw)
        return "diffusers compile_repeated_blocks(fullgraph=True), attention as built (SDPA)"
    done = baselines.prepare(name, module, kw)
    return f"diffusers compile_repeated_blocks(fullgraph=True) | {done}"


def main(argv=None):
    import torch
    from torch.profiler import ProfilerActivity, profile

    import magi_zoo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=common.results_dir("profiles"))
    common.add_commit_argument(ap)
    ap.add_argument("--overrides", default=None,
                    help='a user plan layer as JSON, e.g. \'{"precision": {"WanTransformerBlock": '
                         '{"matmul": "fp8", "keep_bf16": ["ffn.net.2"]}}}\'')
    ap.add_argument("--baseline", choices=PROFILED_BASELINES, default=None,
                    help="profile this baseline (as benchmarks.run builds its row) instead of the shipped plan")
    ap.add_argument("--label", default=None,
                    help="names the results file (default: the precision, or the baseline's name)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.smoke:
        args.model = "wan2.1-tiny"
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.baseline and (args.precision != "bf16" or args.overrides):
        raise SystemExit(f"--baseline {args.baseline} profiles diffusers' own setup: --precision and --overrides "
                         "are the shipped plan's (diffusers_fp8 is the fp8 baseline)")
    why = baselines.missing_reason(args.baseline, device.type) if args.baseline in baselines.BASELINES else None
    if why:  # before the build: a published model takes minutes to build
        raise SystemExit(f"--baseline {args.baseline}: {why}")
    kw = {"precision": "fp8"} if args.precision == "fp8" else {}
    if args.baseline:
        kw["compile"] = False  # diffusers' pipeline as built: no plan step applied
    elif args.overrides:
        import json

        kw["overrides"] = json.loads(args.overrides)
    if not cuda and not args.baseline:
        kw["compile"] = {"": {"backend": "eager"}}
    h = magi_zoo.load(args.model, gpu="auto" if cuda else "cpu", weights="random", device=device, **kw)
    entry = h.adapter.entry_points[0]
    module, method = h.adapter.entry(h.pipe, entry)
    plan = _set_up_baseline(args.baseline, module, method, cuda) if args.baseline else _plan_line(h)
    fn = getattr(module, method)
    inputs = h.adapter.example_inputs(h.pipe, h.variant, entry)
    with torch.no_grad():
        _, first_s = common.first_call(lambda: fn(**inputs), device)
        timing = common.time_calls(lambda: fn(**inputs), device, warmup=2, runs=5)
        t0 = time.perf_counter()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(args.runs):
                fn(**inputs)
            common.sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / args.runs
    rows, cats = [], {}
    for evt in prof.key_averages():
        us = _device_us(evt) if cuda else 0.0
        if cuda and (us <= 0 or getattr(evt, "device_type", None) not in (None, torch.autograd.DeviceType.CUDA)):
            continue
        if not cuda and not evt.key.startswith(("aten::", "triton")):
            continue
        ms = (us if cuda else float(evt.self_cpu_time_total)) / 1e3 / args.runs
        cat = category(evt.key)
        cats[cat] = cats.get(cat, 0.0) + ms
        rows.append({"kernel": evt.key[:110], "category": cat, "ms_per_forward": round(ms, 3),
                     "calls_per_forward": evt.count // args.runs})
    rows.sort(key=lambda r: -r["ms_per_forward"])
    busy = sum(cats.values())
    env = common.environment(device)
    summary = [{"category": c, "ms_per_forward": round(v, 2), "share": f"{100 * v / busy:.1f}%" if busy else None}
               for c, v in sorted(cats.items(), key=lambda kv: -kv[1])]
    summary.append({"category": "GPU busy (sum)", "ms_per_forward": round(busy, 2), "share": None})
    summary.append({"category": "wall (profiled, incl. profiler overhead)", "ms_per_forward": round(wall_ms, 2),
                    "share": None})
    summary.append({"category": "forward, unprofiled (median of 5, CUDA events)",
                    "ms_per_forward": timing["median_ms"], "share": None})
    summary.append({"category": "first call incl. compile (s)", "ms_per_forward": round(first_s, 2), "share": None})
    tag = common.card_tag(env, cuda)
    stem = f"profile_{args.model}_{args.label or args.baseline or args.precision}_{tag}"
    md = (f"# Profile: {args.model}, {entry}, {'baseline ' + args.baseline if args.baseline else 'precision ' + args.precision}"
          f"{', overrides ' + args.overrides if args.overrides else ''}\n\n{common.env_line(env)}\n\n"
          f"plan: {plan}\n\n"
          f"{common.results_table(summary, ['category', 'ms_per_forward', 'share'])}\n\n"
          f"Top {args.top} kernels:\n\n"
          f"{common.results_table(rows[:args.top], ['kernel', 'category', 'ms_per_forward', 'calls_per_forward'])}\n")
    print(md)
    record = {"environment": env, "precision": args.precision, "baseline": args.baseline, "plan": plan,
              "overrides": args.overrides, "summary": summary,
              "timing": timing, "first_call_s": round(first_s, 2), "kernels": rows}
    for p in common.write_results(args.out, stem, record, md):
        print("wrote", p)


if __name__ == "__main__":
    main()
