"""Self-Forcing (causal Wan2.1-T2V-1.3B) end to end: frames per second, time to the first
decoded frames, and the transformer time of the full-graph static-cache step against the
naive port of the reference -- with the graph-break and recompile counts of each.

    python -m benchmarks.self_forcing --device cuda
    python -m benchmarks.self_forcing --device cuda --strategies fullgraph_cudagraphs,fullgraph_flex_cudagraphs
    python -m benchmarks.self_forcing --smoke --out /tmp/sf   # CPU, tiny model, eager backend: plumbing only

Setup: `self-forcing-wan2.1-1.3b` with random weights (`weights="random"`) at the published
config, bf16, batch 1, 81 frames at 480x832 = 21 latent frames in 7 blocks of 3 (4,680
query tokens per step, a 32,760-token cache per layer), 4 denoising steps per block at the
published timesteps + 1 cache pass per block but the last = 34 transformer forwards. The
VAE runs in --vae-dtype (default bf16: the reference's inference.py casts its whole pipeline,
VAE included, to bf16).

Strategies (one process; torch.compiler.reset() between them; all through magi_zoo's engine):
- eager:                     the static-cache step, nothing compiled;
- naive_compiled:            the reference's control flow (`naive_step`: `.item()` reads,
                             cache slicing, `grid_sizes.tolist()`), torch.compile with
                             fullgraph=False (it cannot be one graph);
- naive_compiled_fa3:        the same on the FA3 kernel (`seqused_k`), the same-kernel baseline
                             for the fa3 rows; `speedup_vs_naive` is against the faster naive row;
- fullgraph:                 the shipped spec: `denoise_step` fullgraph, static shapes, SDPA
                             with a length mask over the whole cache;
- fullgraph_flex:            the same with FlexAttention (tiles past the valid length skipped);
- fullgraph_fa3:             the same with FlashAttention-3, `seqused_k` = the valid length
                             (needs the `hopper` extra, fa3-fwd);
- fullgraph_cudagraphs / fullgraph_flex_cudagraphs / fullgraph_fa3_cudagraphs: the same,
                             mode="reduce-overhead".

Per strategy: the first video (cold: compile included) with its counter delta (frames
compiled, graphs, graph breaks, recompiles) and a second video's delta (recompiles after
warm-up); then >= --runs timed videos (after --warmup) of the block loop alone (decode off:
"transformer time") and of the whole call (text encoding + 7 blocks + streaming VAE
decode: "end to end"), CUDA events, median; the first decoded frames' latency (wall time
from the call to the first block's frames on the host, median); relative error of the
latents against eager on the same seed, and of one step per block on identical inputs
(the per-step figure, free of the drift a whole video accumulates). Each invocation merges its rows into
self_forcing_<card>.json/.md (so strategies can be run in separate commands).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import common

MODEL, TINY = "self-forcing-wan2.1-1.3b", "self-forcing-tiny"
KEY = "CausalWanTransformer3DModel"
# The one-graph rows name their mode: the shipped [gpu.h100] plan captures the step in CUDA
# graphs, and "fullgraph*" rows are the plain compiled step.
_GRAPH = {"denoise_step": {"fullgraph": True, "dynamic": False, "mode": "default"}}
_CUDAGRAPHS = {"denoise_step": {"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}}
# The streaming VAE decoder compiled per latent frame (3 graphs on the tiny model: the
# video's first frame, its second, every later one; 0 breaks, equal frames). On the
# published VAE it fails under fullgraph: diffusers' Wan VAE compares its feature cache with
# the string "Rep" (`feat_cache[idx] == "Rep"` on a tensor), which dynamo refuses -- kept
# as a strategy so that error stays measured (results/self_forcing/self_forcing_h100_vae_contig_serial.md).
_VAE = {"vae.decoder": {"fullgraph": True, "dynamic": False}}
STRATEGIES: dict[str, dict[str, Any]] = {
    "eager": dict(kind="static", attention="sdpa", compile=None),
    "naive_compiled": dict(kind="naive", attention="sdpa", compile={"naive_step": {"fullgraph": False}}),
    # the same naive port on the FA3 kernel the fast rows use: the same-kernel baseline
    "naive_compiled_fa3": dict(kind="naive", attention="fa3", compile={"naive_step": {"fullgraph": False}}),
    "fullgraph": dict(kind="static", attention="sdpa", compile=_GRAPH),
    "fullgraph_flex": dict(kind="static", attention="flex", compile=_GRAPH),
    "fullgraph_fa3": dict(kind="static", attention="fa3", compile=_GRAPH),
    "fullgraph_vae": dict(kind="static", attention="sdpa", compile=_GRAPH, extra=_VAE),
    "fullgraph_cudagraphs": dict(kind="static", attention="sdpa", compile=_CUDAGRAPHS),
    "fullgraph_flex_cudagraphs": dict(kind="static", attention="flex", compile=_CUDAGRAPHS),
    "fullgraph_fa3_cudagraphs": dict(kind="static", attention="fa3", compile=_CUDAGRAPHS),
    "fullgraph_fa3_cudagraphs_vae": dict(kind="static", attention="fa3", compile=_CUDAGRAPHS, extra=_VAE),
    # the shipped row with the VAE as diffusers builds it: no norm + SiLU fusion, no padding or
    # upsampling rewrites (adapters/wan/vae.py) -- what those are worth, same run
    "fullgraph_fa3_cudagraphs_vae_as_built": dict(kind="static", attention="fa3", compile=_CUDAGRAPHS,
                                                  vae_as_built=True),
    # the shipped row with the first block's decode overlapping the second block too
    # (pipe.first_frames_first False)
    "fullgraph_fa3_cudagraphs_overlap_first": dict(kind="static", attention="fa3", compile=_CUDAGRAPHS,
                                                   first_frames_first=False),
}
DEFAULT = "eager,naive_compiled,fullgraph,fullgraph_flex,fullgraph_fa3"
PROMPT = "a corgi surfing a wave at sunset, cinematic lighting"
COLUMNS = ["strategy", "status", "attention", "first_frames_first", "breaks", "recompiles", "frames_compiled", "first_video_s",
           "transformer_ms", "ms_per_step", "speedup_vs_naive", "e2e_s", "fps", "first_frames_s",
           "rel_err_step_max", "rel_err_vs_eager"]


def _layers(handle, spec: dict | None, backend: str | None, extra: dict | None = None, vae_as_built: bool = False):
    """The shipped spec's layers with this strategy's compile override (and backend) on top;
    vae_as_built: the VAE's norm + SiLU fusion off."""
    from magi_zoo.overrides import spec_layers

    override = {**({KEY: spec} if spec else {}), **(extra or {})} or None
    fusion_off = {"precision": {"vae": {"fuse_norm_act": False}}} if vae_as_built else None
    layers = spec_layers(handle.adapter, handle.profile, compile=override, overrides=fusion_off)
    if backend:
        from magi_zoo.specs import with_backend

        layers = with_backend(layers, backend)
    return layers


def _video(pipe, call, *, decode: bool, on_block=None):
    if decode:
        return pipe(PROMPT, on_block=on_block, **call)
    out = None
    for r in pipe.stream(PROMPT, decode=False, **call):
        out = r
    return out


def run_strategy(name: str, handle, call: dict, args, ref_latents, device) -> dict[str, Any]:
    import torch

    from magi_zoo.engine import apply, counters, remove

    cfg = STRATEGIES[name]
    pipe = handle.pipe
    row: dict[str, Any] = {"strategy": name, "attention": cfg["attention"], "kind": cfg["kind"]}
    torch.compiler.reset()
    pipe.strategy, pipe.transformer.cache_attention = cfg["kind"], cfg["attention"]
    report = None
    first_frames_first = pipe.first_frames_first
    pipe.first_frames_first = cfg.get("first_frames_first", first_frames_first)
    row["first_frames_first"] = pipe.first_frames_first
    if cfg["compile"] is not None:
        from magi_zoo.adapters.wan.vae import PREPARATION_NAME  # the preparation a vae_as_built row leaves out

        vae_as_built = cfg.get("vae_as_built", False)
        preparations = [p for p in handle.adapter.preparations(pipe)
                        if not (vae_as_built and p.name == PREPARATION_NAME)]
        report = apply(handle.modules, layers=_layers(handle, cfg["compile"], args.backend, cfg.get("extra"),
                                                      vae_as_built),
                       gpu=handle.profile, preparations=preparations)
        row["vae"] = "as built" if vae_as_built else report.step("precision").did
    try:
        before = counters.snapshot()
        t0 = time.perf_counter()
        _video(pipe, call, decode=False)
        common.sync(device)
        row["first_video_s"] = round(time.perf_counter() - t0, 2)
        first = counters.delta(before)
        before = counters.snapshot()
        _video(pipe, call, decode=False)
        second = counters.delta(before)
        row.update(frames_compiled=first.frames, graphs=first.graphs, breaks=first.n_graph_breaks,
                   recompiles=len(first.recompiles), recompiles_second_video=len(second.recompiles),
                   frames_second_video=second.frames, compile_s=round(first.compile_s, 2),
                   break_reasons={k.splitlines()[0][:160]: v for k, v in first.graph_breaks.items()})
        print(f"[bench] {name}: first video {row['first_video_s']} s, {first.frames} frames compiled, "
              f"{first.n_graph_breaks} breaks, {len(first.recompiles)} recompiles", flush=True)
        # Latents of the whole video vs eager, same seed (bf16: the error grows over 34 steps;
        # the first block's is the per-step figure).
        lat = torch.cat([r.latents for r in pipe.stream(PROMPT, decode=False, **call)], dim=2).float()
        if ref_latents is not None:
            ref = ref_latents.float()
            s = lat.shape[2] // 7 if lat.shape[2] >= 7 else lat.shape[2]
            row["rel_err_vs_eager"] = round(float((lat - ref).abs().max() / ref.abs().max()), 5)
            row["rel_err_first_block"] = round(float((lat[:, :, :s] - ref[:, :, :s]).abs().max()
                                                     / ref[:, :, :s].abs().max()), 5)
        if cfg["kind"] == "static" and args.step_refs:
            # Per block, one step on identical inputs (a random cache, the block's offsets):
            # compiled vs eager without the drift a whole video accumulates.
            errs = []
            for b, ref in enumerate(args.step_refs):
                got = pipe.transformer.denoise_step(**_step_inputs(handle, call, b)).float()
                errs.append(float((got - ref).abs().max() / ref.abs().max()))
            row["rel_err_per_step"] = [round(e, 5) for e in errs]
            row["rel_err_step_max"] = round(max(errs), 5)
        t = common.time_calls(lambda: _video(pipe, call, decode=False), device, warmup=args.warmup, runs=args.runs)
        row["transformer_ms"] = t["median_ms"]
        row["transformer"] = t
        row["ms_per_step"] = round(t["median_ms"] / args.steps_per_video, 2)
        firsts: list[float] = []

        def on_block(r):
            if r.index == 0:
                firsts.append(r.seconds)

        e = common.time_calls(lambda: _video(pipe, call, decode=True, on_block=on_block), device,
                              warmup=args.warmup, runs=args.runs)
        row["e2e"] = e
        row["e2e_s"] = round(e["median_ms"] / 1e3, 3)
        row["fps"] = round(call["num_frames"] / (e["median_ms"] / 1e3), 2)
        row["first_frames_s"] = round(statistics.median(firsts[args.warmup:] or firsts), 3)
        if device.type == "cuda":
            row["peak_gib"] = common.gib(torch.cuda.max_memory_allocated())
        row["status"] = "ok"
        print(f"[bench] {name}: transformer {row['transformer_ms']} ms ({row['ms_per_step']} ms/step), "
              f"end to end {row['e2e_s']} s = {row['fps']} FPS, first frames {row['first_frames_s']} s", flush=True)
        if report is not None:
            row["report"] = report.table()
        return row
    finally:
        pipe.first_frames_first = first_frames_first
        if report is not None:
            remove(handle.modules)
        torch.compiler.reset()


def _step_inputs(handle, call: dict, block: int) -> dict[str, Any]:
    """The adapter's example inputs of `denoise_step` for `block` (seeded: identical each time)."""
    return handle.adapter.example_inputs(handle.pipe, handle.variant, "denoise_step", height=call["height"],
                                         width=call["width"], frames=call["num_frames"], block=block)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch

    # inference throughout; as a context, so a caller in the same process (the tests) keeps
    # its grad mode afterwards
    with torch.no_grad():
        return _main(argv)


def _main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--strategies", default=DEFAULT, help=f"comma list of {', '.join(STRATEGIES)}")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--vae-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--vae-contiguous", action="store_true",
                   help="the VAE's weights as loaded (default: the pipeline's channels_last_3d, cuDNN's "
                        "preferred 3D-conv layout); results go to their own file (suffix _vae_contig)")
    p.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                   help="decode on the main stream after each block (default: the pipeline's side-stream "
                        "decode, overlapping the next block)")
    p.add_argument("--backend", default=None, help="compile backend for every region (default: the spec's)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, the tiny variant, eager backend, 1 run")
    p.add_argument("--out", default=common.results_dir("self_forcing"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; choices: {', '.join(STRATEGIES)}")
    if args.smoke:
        args.device, args.backend, args.warmup, args.runs = "cpu", args.backend or "eager", 0, 1
        cuda_only = [n for n in names if "cudagraphs" in n or "fa3" in n]
        if cuda_only:
            print(f"[bench] --smoke runs on CPU: skipping the CUDA-only strategies {', '.join(cuda_only)}", flush=True)
        names = [n for n in names if n not in cuda_only]
    elif args.runs < 5:
        raise SystemExit("--runs >= 5 (docs/methodology.md); --smoke for a plumbing run")

    import torch

    import magi_zoo

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA here; use --smoke for the CPU plumbing run")
    model = TINY if args.smoke else MODEL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    handle = magi_zoo.load(model, gpu="auto" if device.type == "cuda" else "cpu", weights="random", dtype=dtype,
                           device=device, compile=False)
    pipe = handle.pipe
    if device.type != "cuda":
        args.vae_dtype = "fp32"  # CPU runs are fp32 throughout
    elif args.vae_dtype == "bf16":
        pipe.vae.to(torch.bfloat16)  # as the reference's `pipeline.to(dtype=torch.bfloat16)`
    pipe.vae_memory_format = "contiguous" if args.vae_contiguous else "channels_last_3d"
    pipe.overlap_decode = args.overlap_decode
    d = handle.variant.call_defaults
    call = dict(height=args.height or d["height"], width=args.width or d["width"],
                num_frames=args.frames or d["num_frames"], max_sequence_length=d["max_sequence_length"], seed=0)
    sched = pipe.schedule(call["height"], call["width"], call["num_frames"])
    args.steps_per_video = sched.num_blocks * (len(pipe.timesteps) + 1) - 1
    env = common.environment(device)
    t0 = time.perf_counter()
    pipe.encode_prompt(PROMPT, call["max_sequence_length"])
    common.sync(device)
    text_s = time.perf_counter() - t0
    text = common.time_calls(lambda: pipe.encode_prompt(PROMPT, call["max_sequence_length"]), device,
                             warmup=args.warmup, runs=args.runs)
    print(f"[bench] {model} on {env.get('card')}: {call['num_frames']} frames {call['height']}x{call['width']}, "
          f"{sched.num_blocks} blocks x {sched.block_tokens} tokens, cache {sched.cache_tokens} tokens, "
          f"{args.steps_per_video} transformer forwards; text encoding {text['median_ms']} ms", flush=True)

    out_dir = Path(args.out)
    # one file per decode setting (the default -- channels_last_3d VAE, side-stream decode -- unsuffixed)
    stem = f"self_forcing_{'smoke' if args.smoke else common.card_tag(env)}" \
        + ("_vae_contig" if args.vae_contiguous else "") + ("" if args.overlap_decode else "_serial")
    path = out_dir / f"{stem}.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    if record.get("env", {}).get("card") != env.get("card") or record.get("shape") != call:
        record = {}  # another card or shape: start a new table
    rows = {r["strategy"]: r for r in record.get("results", [])}
    pipe.strategy, pipe.transformer.cache_attention = "static", "sdpa"
    args.step_refs = [pipe.transformer.denoise_step(**_step_inputs(handle, call, b)).float()
                      for b in range(sched.num_blocks)]  # eager, per block: the per-step reference
    ref_latents = None
    order = (["eager"] if "eager" in names else []) + [n for n in names if n != "eager"]
    if "eager" not in names:  # the reference for the error column, not timed
        pipe.strategy, pipe.transformer.cache_attention = "static", "sdpa"
        ref_latents = torch.cat([r.latents for r in pipe.stream(PROMPT, decode=False, **call)], dim=2)
    for name in order:
        try:
            row = run_strategy(name, handle, call, args, ref_latents, device)
            if name == "eager":
                ref_latents = torch.cat([r.latents for r in pipe.stream(PROMPT, decode=False, **call)], dim=2)
                row["rel_err_vs_eager"] = 0.0
        except Exception as e:
            row = {"strategy": name, "status": "error", "error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}",
                   "traceback": traceback.format_exc()[-3000:]}
            print(f"[bench] {name}: ERROR {row['error']}", flush=True)
        row["env_commit"] = env.get("commit")
        rows[name] = row
    # against the strongest naive row measured (on the same FA3 kernel where that row ran)
    naive = min((rows[k]["transformer_ms"] for k in ("naive_compiled", "naive_compiled_fa3")
                 if rows.get(k, {}).get("transformer_ms")), default=None)
    for r in rows.values():
        if naive and r.get("transformer_ms"):
            r["speedup_vs_naive"] = round(naive / r["transformer_ms"], 3)
    record.update(model=model, env=env, shape=call, smoke=args.smoke, vae_dtype=args.vae_dtype,
                  vae_memory_format=pipe.vae_memory_format,
                  overlap_decode=args.overlap_decode,
                  steps_per_video=args.steps_per_video, blocks=sched.num_blocks, block_tokens=sched.block_tokens,
                  cache_tokens=sched.cache_tokens, text_encoding=text, text_encoding_first_s=round(text_s, 3),
                  results=[rows[k] for k in STRATEGIES if k in rows])
    md = [f"# Self-Forcing ({model}): {call['num_frames']} frames {call['height']}x{call['width']}, "
          f"{sched.num_blocks} blocks, {args.steps_per_video} transformer forwards", "",
          common.env_line(env), "",
          f"VAE {args.vae_dtype}, {pipe.vae_memory_format}"
          f"{', decoded on a side stream overlapping the next block' if args.overlap_decode else ', decoded after each block'}; text encoding {text['median_ms']} ms (median); transformer time = the 7-block "
          "loop without decode; end to end = text encoding + blocks + streaming VAE decode; first frames = "
          "wall time to the first block's decoded frames on the host; breaks / recompiles / frames compiled: "
          "counters over the first video; rel_err_step_max: one step per block on identical inputs vs eager "
          "(max over blocks); rel_err_vs_eager: the whole video's latents (same seed; bf16 drift accumulates "
          "over 34 steps).", "",
          common.results_table(record["results"], COLUMNS)]
    for r in record["results"]:
        if r.get("break_reasons"):
            md += ["", f"{r['strategy']} graph breaks (first video):"]
            md += [f"- x{n}: {k}" for k, n in r["break_reasons"].items()]
    written = common.write_results(out_dir, stem, record, "\n".join(md))
    print(f"[bench] wrote {', '.join(map(str, written))}", flush=True)
    return record


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
