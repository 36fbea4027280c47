"""Qwen3-Omni thinker decode step: tokens/s at batch 1, eager vs magi_zoo.

    python -m benchmarks.qwen3_omni_gpu --device cuda --out benchmarks/results
    python -m benchmarks.qwen3_omni_gpu --device cpu --model qwen3-omni-tiny --out /tmp/r   # CPU smoke run

The full 30B-A3B model (48 thinker layers, 128 experts each, plus talker) takes ~60 GiB in
bf16 and long to initialise, so on CUDA this builds the PUBLISHED layer config (hidden
2048, 32/4 heads, 128 experts top-8, moe_inter 768, vocab 152064, the published audio and
vision encoders) with only --layers thinker layers (default 4) and no talker, random
weights, bf16. Per-token decode cost scales ~linearly in layers; the output says so.

Measurement: a fixed 32-token prompt. One run = generate 1 token (the prefill alone) and
generate N tokens (prefill + N-1 decode steps), each timed with CUDA events; decode
tokens/s = (N-1) / (t_N - t_1). Warm-up >= 2 runs, then >= 5 timed runs: median / min /
max, peak GiB. Strategies run in this process, in order: eager (nothing compiled), then
magi_zoo (the shipped spec for the detected GPU profile applied to the same weights: the
decode step with CUDA graphs on H100/H200). Spec keys for parts this build lacks (the
talker, code2wav) are dropped and listed. A failing strategy records its error; the rest
go on. Writes qwen3_omni_gpu.json and .md under --out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

from benchmarks import common

PROMPT_LEN = 32
# The markdown table's columns (values formatted in `_table_row`).
COLUMNS = ["strategy", "decode tok/s median", "min", "max", "ms/token", "prefill+1 tok ms", "cold first run s",
           "peak GiB", "speedup", "error"]


def _build(model: str, layers: int, device, dtype):
    """The pipeline: tiny as shipped, or the published config with `layers` thinker layers."""
    import dataclasses

    from magi_zoo import adapters
    from magi_zoo.adapters.qwen3_omni.configs import with_thinker_layers

    adapter, variant = adapters.lookup(model)
    if not variant.tiny:
        variant = dataclasses.replace(variant, config=with_thinker_layers(variant.config, layers, talker=False))
    pipe = adapter.build(variant, weights="random", dtype=dtype, device=device)
    return adapter, variant, pipe


def _plan_layers(adapter, pipe, profile, backend: str | None):
    """The shipped spec's layers for `profile`, minus keys matching nothing in this build
    (in every section), with every compile spec on `backend` if one is given."""
    import torch.nn as nn

    from magi_zoo.engine.resolve import match_key
    from magi_zoo.specs import PlanLayer
    from magi_zoo.specs.plan import with_backend
    from magi_zoo.zoo import spec_layers

    modules = nn.ModuleDict(adapter.components(pipe))
    named = dict(modules.named_modules())
    out, dropped = [], []
    for name, layer in spec_layers(adapter, profile):
        sections = {}
        for section, entries in layer.sections.items():
            sections[section] = {k: e for k, e in entries.items() if match_key(modules, k, named)[0]}
            dropped += [k for k in entries if k not in sections[section]]
        out.append((name, PlanLayer(sections=sections)))
    if backend:  # CPU smoke runs: a cheaper backend than inductor's C++ build
        out = with_backend(out, backend)
    return modules, out, sorted(set(dropped))


def _time_generate(pipe, ids, n, device) -> float:
    """Seconds for one greedy generate of `n` tokens (EOS ignored), CUDA events on GPU."""
    gen = lambda: pipe.generate(ids, max_new_tokens=n, ignore_eos=True)  # noqa: E731
    return common.time_calls(gen, device, warmup=0, runs=1)["median_ms"] / 1e3


def _measure(pipe, ids, args, device) -> dict:
    import torch

    def one_run():
        t1 = _time_generate(pipe, ids, 1, device)
        tn = _time_generate(pipe, ids, args.new_tokens, device)
        return t1, tn

    t0 = time.perf_counter()
    one_run()  # cold: compiles on the magi_zoo strategy
    cold_s = time.perf_counter() - t0
    for _ in range(max(0, args.warmup - 1)):
        one_run()
    tps, prefill_ms, step_ms = [], [], []
    for _ in range(args.runs):
        t1, tn = one_run()
        dec = max(tn - t1, 1e-9)
        tps.append((args.new_tokens - 1) / dec)
        prefill_ms.append(t1 * 1e3)
        step_ms.append(dec * 1e3 / (args.new_tokens - 1))
    return {"decode_tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps)},
            "decode_ms_per_token_median": statistics.median(step_ms),
            "prefill_plus_first_token_ms_median": statistics.median(prefill_ms),
            "cold_first_run_s": cold_s,
            "peak_gib": common.gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None}


def _table_row(r: dict, eager: dict | None) -> dict:
    if "error" in r:
        return {"strategy": r["strategy"], "error": r["error"][:120]}
    t = r["decode_tokens_per_s"]
    return {"strategy": r["strategy"], "decode tok/s median": f"{t['median']:.1f}", "min": f"{t['min']:.1f}",
            "max": f"{t['max']:.1f}", "ms/token": f"{r['decode_ms_per_token_median']:.2f}",
            "prefill+1 tok ms": f"{r['prefill_plus_first_token_ms_median']:.1f}",
            "cold first run s": f"{r['cold_first_run_s']:.1f}",
            "peak GiB": f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else None,
            "speedup": f"{t['median'] / eager['decode_tokens_per_s']['median']:.2f}x" if eager else None}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="qwen3-omni-30b-a3b")
    p.add_argument("--layers", type=int, default=4, help="thinker layers of the published config (not tiny)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per timed generate (N)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--gpu", default="auto", help="spec profile; auto = detect")
    p.add_argument("--backend", default=None, help="override every region's backend (CPU smoke runs)")
    p.add_argument("--out", default="benchmarks/results")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)

    import torch

    import magi_zoo
    from magi_zoo.adapters.qwen3_omni import experts_implementation
    from magi_zoo.specs import get_profile

    device = torch.device(args.device)
    profile = get_profile(args.gpu if device.type == "cuda" else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    adapter, variant, pipe = _build(args.model, args.layers, device, dtype)
    build_s = time.perf_counter() - t0
    text_cfg = pipe.model.thinker.config.text_config
    note = ("tiny variant as shipped" if variant.tiny else
            f"published Qwen3-Omni-30B-A3B layer config with {text_cfg.num_hidden_layers} of 48 thinker layers, "
            "no talker/code2wav, random weights: per-token decode time scales ~linearly with layers")
    print(f"[qwen3_omni_gpu] {note}; built in {build_s:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151643, (1, PROMPT_LEN), generator=g).to(device)

    res = {"model": variant.name, "note": note, "thinker_layers": text_cfg.num_hidden_layers,
           "experts_implementation": sorted(experts_implementation(pipe.model)),
           "device": str(device), "env": common.environment(device), "profile": profile.name, "dtype": str(dtype),
           "command": "python -m benchmarks.qwen3_omni_gpu " + " ".join(argv),
           "prompt_len": PROMPT_LEN, "new_tokens": args.new_tokens, "runs": args.runs, "warmup": args.warmup,
           "build_s": build_s, "results": []}
    for strategy in ("eager", "magi_zoo"):
        row = {"strategy": strategy}
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            if strategy == "magi_zoo":
                modules, layers, dropped = _plan_layers(adapter, pipe, profile, args.backend)
                report = magi_zoo.apply(modules, layers=layers, gpu=profile,
                                        preparations=adapter.preparations(pipe))
                row["dropped_keys"] = dropped
            row.update(_measure(pipe, ids, args, device))
            if strategy == "magi_zoo":
                row["regions"] = [r for r in report.to_dict()["regions"] if r["calls"]]
        except Exception as e:  # record and go on
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()[-3000:]
            print(f"[qwen3_omni_gpu] {strategy} failed: {row['error']}", flush=True)
        res["results"].append(row)
        print(f"[qwen3_omni_gpu] {strategy}: "
              + (f"{row['decode_tokens_per_s']['median']:.1f} tok/s" if "error" not in row else "error"), flush=True)

    eager = next((r for r in res["results"] if r["strategy"] == "eager" and "error" not in r), None)
    lines = ["# Qwen3-Omni thinker decode, batch 1", "", common.env_line(res["env"]), "", note, "",
             common.results_table([_table_row(r, eager) for r in res["results"]], COLUMNS)]
    common.write_results(Path(args.out), "qwen3_omni_gpu", res, "\n".join(lines))
    print("\n".join(lines), flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
