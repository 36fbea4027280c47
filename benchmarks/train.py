"""Training step benchmark: activation recompute strategies, FSDP2 and data parallel.

One GPU (each strategy in a fresh process, so peaks and compile state do not leak):

    python -m benchmarks.train --model wan2.1-t2v-1.3b --gpu h100          # 480x832x81
    python -m benchmarks.train --model flux.1-dev --gpu h100               # 1024x1024
    python -m benchmarks.train --smoke --out /tmp/train                    # tiny models, CPU

Two GPUs (torchrun):

    torchrun --nproc-per-node 2 -m benchmarks.train --fsdp --model wan2.1-t2v-14b --gpu h100
    torchrun --nproc-per-node 2 -m benchmarks.train --dp --model wan2.1-t2v-1.3b --gpu h100
    torchrun --nproc-per-node 2 -m benchmarks.train --fsdp --smoke --out /tmp/train   # CPU, gloo

A step = flow-matching loss on random latents at the variant's call shape (Wan 480x832x81:
32,760 tokens; Flux 1024^2: 4,096 + 512 tokens), backward, AdamW step (bf16 weights and
states), zero_grad. Random text states stand in for the text encoder, so the text encoder
and the VAE are moved to the host after `load` (a fine-tune with cached embeddings does the
same) and `auto` is re-measured without them. Strategies (`--strategies`):

- eager_full: blocks eager (compile off for the block classes), full checkpointing;
- regional_full: the shipped regional compile, full checkpointing;
  (both baselines attend with torch SDPA's own dispatch, backend "native", and have the plan's
  kernel fusions -- GELU epilogue, norm + rope -- off: the blocks as diffusers computes them,
  what a user gets without the plan; the other strategies use the plan's attention, fa3 on Hopper = FA3's
  forward + cuDNN's backward); any strategy + "_sdpa" (e.g. auto16_sdpa) pins SDPA's dispatch
  too, to attribute the attention backend's share
- save_all: regional compile, selective checkpointing keeping every matmul and attention output;
- auto16 / auto24 / auto40 (any autoN): regional compile, `recompute="auto"` at an N GiB budget
  (the choice is printed and recorded);
- none: regional compile, no checkpointing (out of memory at the Wan shape on 80 GB; docs/training.md).

Hard caps: a budgeted row (autoN) runs with its process capped at N GiB, and any strategy
takes a cap as `STRATEGY@GIB` (eager_full@16: the baseline under the same cap). The cap is
`torch.cuda.set_per_process_memory_fraction`, set in the row's fresh process before anything
touches the card, so the build and the calibration are capped too: what a user with a card
of that size has. A capped row records its allocated and reserved peaks (the timed steps and
the whole process); a row whose reserved peak passes its cap is a failure ("over cap"), not a
result; its speedup is against eager_full under the same cap. An auto row also records its
estimated peak against the measured allocated peak (`estimate_error`).

    python -m benchmarks.train --model wan2.1-t2v-1.3b --gpu h100 --optimizer none --expandable-segments \
        --strategies eager_full@16,auto16,eager_full@24,auto24,eager_full@40,auto40,save_all

Per row: median ms per step over --runs after --warmup steps (CUDA events), peak GiB allocated
over the timed steps, first-step seconds (compile included), graph breaks and recompiles of
the block regions (calibration compiles every auto option: those count there) and
recompiles during the steps, the loss. Writes benchmarks/results/train/train_<model>[_<gpu>].json/.md.

--fsdp: FSDP2 (`magi_zoo.train.shard`: recompute -> compile -> fully_shard per block, bf16
params / fp32 reduce) with `auto` at --budget GiB per GPU; ms/step and peak per rank.
--dp: the same step per rank on its own batch; first each rank alone (no collectives), then
FSDP2 over all ranks: scaling = world x single-GPU ms / sharded ms.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks import common

STRATEGIES = ("eager_full", "regional_full", "save_all", "auto16", "auto24", "auto40")
ALL_STRATEGIES = (*STRATEGIES, "none")


SDPA = "_sdpa"  # strategy suffix: attention pinned to torch SDPA's dispatch (e.g. auto16_sdpa)
CAP = "@"  # strategy suffix: a hard memory cap in GiB (e.g. eager_full@16)


def _base(strategy: str) -> str:
    strategy = strategy.partition(CAP)[0]
    return strategy[: -len(SDPA)] if strategy.endswith(SDPA) else strategy


def row_cap(strategy: str) -> float | None:
    """The hard cap (GiB) a row runs under: `STRATEGY@GIB`, else an autoN row's budget N,
    else none."""
    name, _, cap = strategy.partition(CAP)
    if cap:
        try:
            value = float(cap)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ValueError(f"strategy {strategy!r}: the cap after {CAP!r} is GiB, a positive number "
                             "(e.g. eager_full@16)")
        return value
    base = _base(name)
    return float(base[4:]) if base.startswith("auto") and base[4:] else None


def check_strategies(strategies: list[str]) -> None:
    """Every strategy names a known recompute strategy (autoN with N > 0) and a valid cap."""
    for s in strategies:
        _recompute(s)
        row_cap(s)


def cap_memory(gib: float | None) -> float | None:
    """Limit this process's CUDA allocator to `gib` (before anything touches the card);
    returns the fraction set, or None (no cap, or no CUDA)."""
    import torch

    if gib is None or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fraction = min(1.0, gib * 2 ** 30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


def _recompute(strategy: str, budget: float | None = None, optimizer: str = "adamw") -> Any:
    strategy = _base(strategy)
    if strategy in ("eager_full", "regional_full"):
        return "full"
    if strategy == "save_all":
        return {"policy": "selective", "save": ["matmuls", "attention"]}
    if strategy == "none":
        return "none"
    if strategy.startswith("auto") and (budget is not None or _positive(strategy[4:])):
        return {"policy": "auto", "train_peak_gib": float(budget if budget is not None else strategy[4:]),
                "optimizer_states": 2.0 if optimizer == "adamw" else 0.0}
    raise ValueError(f"unknown strategy {strategy!r}; choices: {', '.join(ALL_STRATEGIES)} (autoN: any budget N "
                     f"GiB; {SDPA} pins SDPA; {CAP}GIB a hard cap)")


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _block_keys(model: str) -> list[str]:
    """The regions the spec declares for recompute (the repeated block classes)."""
    from magi_zoo import adapters
    from magi_zoo.specs import SpecFile

    adapter, _ = adapters.lookup(model)
    return list(SpecFile.from_toml(adapter.spec_path()).default.entries("recompute"))


# The baselines are what a user gets without magi_zoo: torch SDPA's own dispatch for attention
# (cuDNN on Hopper), not the plan's backend (fa3 there: FA3's forward + cuDNN's backward).
BASELINES = ("eager_full", "regional_full")


def build(model: str, strategy: str, *, gpu: str, device: str, backend: str | None, budget: float | None = None,
          calibrate: bool = True, optimizer: str = "adamw"):
    """load(train=True) for one strategy; frozen components to the host; then `auto` measured
    (unless calibrate=False: the caller does it, e.g. after sharding)."""
    import torch

    import magi_zoo
    from magi_zoo.train import calibrate as calibrate_handle

    compile_override: dict[str, Any] = {}
    if _base(strategy) == "eager_full":
        compile_override = {k: {"enabled": False} for k in _block_keys(model)}
    elif backend:
        compile_override = {k: {"backend": backend} for k in _block_keys(model)}
    from magi_zoo import adapters

    adapter = adapters.lookup(model)[0]
    keys = sorted(common.spec_keys(adapter, gpu, "attention")) \
        if _base(strategy) in BASELINES or strategy.partition(CAP)[0].endswith(SDPA) else []
    overrides: dict[str, Any] = {"attention": {k: {"backend": "native"} for k in keys}} if keys else {}
    if _base(strategy) in BASELINES:
        # the blocks as diffusers computes them: none of the plan's kernel fusions either
        overrides["precision"] = common.fusions_off(adapter, gpu)
    kw = dict(gpu=gpu, weights=None if model.endswith("tiny") else "random", device=device, train=True,
              recompute=_recompute(strategy, budget, optimizer), compile=compile_override or None,
              overrides=overrides or None)
    if _base(strategy).startswith("auto"):
        # measured once, below, with only the denoiser on the card -- or by the caller after
        # sharding (calibrate=False): never with the frozen encoders still there
        kw["calibrate"] = False
    if device == "cpu":
        kw["dtype"] = "float32"
    h = magi_zoo.load(model, **kw)
    for name, comp in h.adapter.components(h.pipe).items():
        if comp is not h.trainable:
            comp.to("cpu")
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if calibrate and _base(strategy).startswith("auto"):
        calibrate_handle(h)  # now that only the denoiser is on the card
    return h


def make_step(h, inputs, optimizer: str = "adamw"):
    """One training step: loss, backward, then the AdamW step (or, with optimizer "none",
    only dropping the gradients -- the forward + backward the reference setting times; docs/training.md)."""
    import torch

    from magi_zoo.train import flow_matching_loss

    params = [p for p in h.trainable.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True) if optimizer == "adamw" else None
    gen = torch.Generator(device=inputs["hidden_states"].device).manual_seed(0)

    def step():
        loss = flow_matching_loss(h.trainable, inputs, generator=gen)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None
        return loss.detach()

    step.optimizer = opt  # its states count in a peak measured off CUDA (run_one)
    return step


def _blocks_counters(report) -> dict[str, int]:
    regions = [r for r in report.regions if r.name in set(_block_keys_from(report))]
    return {"graph_breaks": sum(r.counters.n_graph_breaks for r in regions),
            "recompiles": sum(len(r.counters.recompiles) for r in regions),
            "frames_compiled": sum(r.counters.frames for r in regions)}


def _block_keys_from(report) -> list[str]:
    return [k for (k, _) in report.plan.section("recompute").regions()]


def _auto_choice(report) -> dict[str, Any] | None:
    rec = report.step("recompute")
    return rec.details.get("auto")


def static_need_bytes(trainable_bytes: int, optimizer: str) -> int:
    """What a full fine-tune holds before any activation: the trainable weights, their
    gradients and (AdamW) two optimizer states of the same dtype."""
    return trainable_bytes * (2 + (2 if optimizer == "adamw" else 0))


def run_one(args) -> dict[str, Any]:
    """One strategy in this process (the parent runs each in a fresh one)."""
    import torch

    device = torch.device(args.device)
    row: dict[str, Any] = {"strategy": args.one}
    setup = (0, 0)  # CUDA: peak allocated / reserved before the timed steps
    cap = row_cap(args.one)
    if cap is not None:
        # before anything touches the card: the build and the calibration are capped too
        row.update(cap_gib=cap, cap_fraction=cap_memory(cap) if device.type == "cuda" else None)
    try:
        h = build(args.model, args.one, gpu=args.gpu, device=args.device, backend=args.backend,
                  optimizer=args.optimizer)
        row["auto"] = _auto_choice(h.report())  # recorded before the steps: an OOM row keeps it
        if device.type == "cuda":  # a step that cannot fit is not run (minutes of build and compile saved)
            need = static_need_bytes(sum(p.numel() * p.element_size() for p in h.trainable.parameters()
                                         if p.requires_grad), args.optimizer)
            card = torch.cuda.get_device_properties(device).total_memory
            card = min(card, int(cap * 2 ** 30)) if cap is not None else card
            if need > card:
                row.update(status="does not fit", error=f"weights + gradients{' + AdamW states' if args.optimizer == 'adamw' else ''} "
                           f"= {need / 2**30:.1f} GiB > the card's {card / 2**30:.1f} GiB before any activation; "
                           "try --optimizer none, or FSDP2 over several GPUs (--fsdp)")
                return row
        inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
        step = make_step(h, inputs, args.optimizer)
        from magi_zoo.engine import counters

        before = counters.snapshot()  # calibration compiles one variant per auto option: not a step's
        loss, first_s = common.first_call(step, device)
        if device.type == "cuda":  # build, calibration and first step: kept before the timed steps' reset
            setup = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)
        t = common.time_calls(step, device, warmup=max(0, args.warmup - 1), runs=args.runs)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if device.type == "cuda":  # the allocator's side: a cache near the card's size retries (slow)
            stats = torch.cuda.memory_stats(device)
            row.update(peak_reserved_gib=common.gib(stats.get("reserved_bytes.all.peak", 0)),
                       alloc_retries=stats.get("num_alloc_retries", 0))
        else:  # off CUDA: the step's tensors (LiveBytes) over the weights, as the estimate counts them
            from magi_zoo.engine.recompute import measure_peak

            _, made = measure_peak(step)
            states = [t for st in (step.optimizer.state.values() if step.optimizer else ()) for t in st.values()
                      if isinstance(t, torch.Tensor)]
            peak = made + sum(t.numel() * t.element_size() for t in [*h.modules.parameters(), *h.modules.buffers(),
                                                                     *states])
        during = counters.delta(before)
        row.update(status="ok", recompiles_in_steps=len(during.recompiles),
                   breaks_in_steps=sum(during.graph_breaks.values()),
                   ms_per_step=t["median_ms"], min_ms=t["min_ms"], max_ms=t["max_ms"], runs=t["runs"],
                   peak_gib=common.gib(peak), first_step_s=round(first_s, 2), loss=round(float(loss), 5),
                   **_blocks_counters(h.report()), recompute=h.report().step("recompute").did,
                   auto=_auto_choice(h.report()))
        row.update(estimate_check(row.get("auto"), peak))
    except torch.OutOfMemoryError as e:
        row.update(status="out of memory", error=str(e).splitlines()[0][:300])
    except Exception as e:  # recorded, not fatal: the other strategies still run
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:2000])
    if device.type == "cuda":  # the whole process: build and calibration too
        row.update(process_peak_allocated_gib=common.gib(max(setup[0], torch.cuda.max_memory_allocated(device))),
                   process_peak_reserved_gib=common.gib(max(setup[1], torch.cuda.max_memory_reserved(device))))
    return judge_cap(row)


def estimate_check(auto: dict[str, Any] | None, measured_bytes: int | None) -> dict[str, Any]:
    """An auto row's estimated peak against its measured one (allocated, over the timed
    steps): both, and the estimate's error relative to the measurement."""
    if not auto or not measured_bytes:
        return {}
    est = next(iter(auto.values())).get("estimated_peak_bytes")
    if est is None:
        return {}
    return {"estimated_peak_gib": common.gib(est), "estimate_error": round(est / measured_bytes - 1, 4)}


def judge_cap(row: dict[str, Any]) -> dict[str, Any]:
    """A capped row whose reserved peak (timed steps or whole process) passed its cap is a
    failure: "over cap", its time kept only as `over_cap_ms_per_step`, never as a result."""
    cap = row.get("cap_gib")
    reserved = max((row.get(k) or 0) for k in ("peak_reserved_gib", "process_peak_reserved_gib"))
    if cap is not None and row.get("status") == "ok" and reserved > cap:
        row["over_cap_ms_per_step"] = row.pop("ms_per_step", None)
        row.update(status="over cap", error=f"reserved peak {reserved} GiB > the {cap:g} GiB cap")
    return row


def run_single(args) -> dict[str, Any]:
    import torch

    strategies = args.strategies.split(",")
    check_strategies(strategies)
    rows = []
    for i, s in enumerate(strategies, 1):
        print(f"[bench] [{i}/{len(strategies)}] {args.model}: {s} (fresh process)", flush=True)
        result_file = Path(args.out) / f".train_{args.model}_{s}.json"
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.unlink(missing_ok=True)
        child = ["--one", s, "--model", args.model, "--gpu", args.gpu, "--device", args.device,
                 "--runs", str(args.runs), "--warmup", str(args.warmup), "--result-file", str(result_file),
                 "--optimizer", args.optimizer]
        if args.backend:
            child += ["--backend", args.backend]
        row = common.run_isolated("benchmarks.train", child, result_file=result_file, timeout=args.timeout)
        row.setdefault("strategy", s)
        result_file.unlink(missing_ok=True)
        print(f"[bench]     {_row_line(row)}", flush=True)
        rows.append(row)
    for r in rows:  # against eager + full checkpointing under the same cap (or both uncapped)
        base = next((b for b in rows if _base(b["strategy"]) == "eager_full" and b.get("status") == "ok"
                     and b.get("cap_gib") == r.get("cap_gib")), None)
        if base and r.get("status") == "ok":
            r["speedup_vs_eager_full"] = round(base["ms_per_step"] / r["ms_per_step"], 3)
    return {"kind": "single", "model": args.model, "gpu": args.gpu, "env": common.environment(torch.device(args.device)),
            "step": "flow-matching loss on random latents + backward + "
                    + ("AdamW" if args.optimizer == "adamw" else "no optimizer")
                    + f" ({'bf16' if args.device.startswith('cuda') else 'fp32'} weights), batch 1",
            "runs": args.runs, "warmup": args.warmup, "results": rows}


def _row_line(r: dict[str, Any]) -> str:
    if r.get("status") != "ok":
        return f"{r.get('strategy')}: {r.get('status')}: {str(r.get('error', ''))[:200]}"
    return (f"{r['strategy']}: {r['ms_per_step']} ms/step, peak {r.get('peak_gib')} GiB, first step "
            f"{r['first_step_s']} s, breaks {r['graph_breaks']}, recompiles {r['recompiles']}")


def markdown(rec: dict[str, Any]) -> str:
    lines = [f"# Training step: {rec['model']} ({rec['kind']})", "", common.env_line(rec["env"]), "",
             f"Step: {rec.get('step', '')}. Median of {rec.get('runs')} steps after {rec.get('warmup')} warm-up."
             + (f" Allocator: PYTORCH_CUDA_ALLOC_CONF={rec['allocator']}." if rec.get("allocator") else ""), ""]
    cols = ["strategy", "cap_gib", "status", "ms_per_step", "peak_gib", "peak_reserved_gib",
            "process_peak_reserved_gib", "estimated_peak_gib", "estimate_error", "alloc_retries",
            "speedup_vs_eager_full", "first_step_s",
            "graph_breaks", "recompiles", "recompiles_in_steps", "loss"]
    if rec["kind"] != "single":
        cols = ["mode", "world", "status", "ms_per_step", "peak_gib_per_gpu", "peak_reserved_gib_per_gpu", "scaling",
                "first_step_s", "loss"]
    lines.append(common.results_table(rec["results"], cols))
    for r in rec["results"]:
        if r.get("auto"):
            lines += ["", f"What `auto` chose ({r.get('strategy', r.get('mode'))}):", ""]
            for key, a in r["auto"].items():
                lines.append(
                    f"- {key}: {a['choice']} of {a['blocks']} blocks; estimated peak {a['estimated_peak_gib']} GiB of "
                    f"{a['budget_gib']} = live {a['live_gib']} (of it frozen weights {a.get('frozen_weights_on_device_gib')}, "
                    f"other {a.get('other_live_gib')}) + optimizer states {a.get('optimizer_states_gib')} + gradients "
                    f"outside the blocks {a.get('gradients_outside_blocks_gib')} + FSDP in flight "
                    f"{a.get('fsdp_in_flight_gib', 0)} + one block's backward "
                    f"{a['largest_block_backward_gib']} + per block max(kept, its gradient) "
                    f"{a.get('blocks_kept_or_gradient_gib')} (kept {a['kept_activations_gib']}); estimated recompute "
                    f"{a['estimated_recompute_ms']} ms/step")
                lines.append(f"  options per block (from the {a.get('bytes_from', 'eager op outputs')}; "
                             "eager estimate in brackets): " + "; ".join(
                                 f"{o['name']} {o['gib_per_block']} GiB [{o.get('eager_estimate_gib', '-')}] / "
                                 f"{o['recompute_ms_per_block']} ms [{o.get('eager_estimate_ms', '-')}], "
                                 f"backward working set {o.get('backward_working_set_gib', '-')} GiB"
                                 for o in a["options"]))
    return "\n".join(lines)


# -- torchrun modes ------------------------------------------------------------------------------

def run_distributed(args) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    from magi_zoo.train import shard

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    # One recompute policy for both modes (--dp): the scaling compares like with like. `auto`
    # (with --budget) re-chooses under FSDP2, where sharded weights leave more room to keep.
    strategy = args.strategy or ("auto" if args.budget else "regional_full")
    rows = []

    def measure(h, mode: str) -> dict[str, Any]:
        inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise", seed=rank)  # each rank its own batch
        # on the compute device: example inputs follow the weights, which FSDP2's CPU offload
        # keeps on the host (the model's output is on the card, its target would be on the host)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        step = make_step(h, inputs, args.optimizer)
        row: dict[str, Any] = {"mode": mode, "world": world if mode != "single" else 1,
                               "auto": _auto_choice(h.report())}  # kept on an out-of-memory row too
        try:
            loss, first_s = common.first_call(step, device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            t = common.time_calls(step, device, warmup=max(0, args.warmup - 1), runs=args.runs)
            peak = torch.cuda.max_memory_allocated(device) if cuda else None
            row.update(status="ok", ms_per_step=t["median_ms"], first_step_s=round(first_s, 2),
                       peak_gib_per_gpu=common.gib(peak), loss=round(float(loss), 5),
                       peak_reserved_gib_per_gpu=common.gib(torch.cuda.max_memory_reserved(device)) if cuda else None)
        except torch.OutOfMemoryError as e:
            row.update(status="out of memory", error=str(e).splitlines()[0][:300])
        return row

    if args.dp:  # each rank alone first: the single-GPU time on this card, same moment
        h = build(args.model, strategy, gpu=args.gpu, device=str(device), backend=args.backend, budget=args.budget,
                  optimizer=args.optimizer)
        rows.append(measure(h, "single"))
        del h
        if cuda:
            torch.cuda.empty_cache()
    # auto: measured once before sharding (the compiled per-option costs; a sharded block cannot
    # be run alone), then chosen again after it with per-rank memory, reusing those costs
    h = build(args.model, strategy, gpu=args.gpu, device=str(device), backend=args.backend, budget=args.budget,
              optimizer=args.optimizer)
    master = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.master_dtype)
    # recompute -> compile (by load) -> fully_shard per block, root
    shard(h.trainable, master_dtype=master, cpu_offload=args.cpu_offload)
    if strategy.startswith("auto"):
        from magi_zoo.train import calibrate

        calibrate(h)  # per-rank accounting now that the weights are sharded (costs measured before)
    rows.append(measure(h, "fsdp2"))
    single = next((r for r in rows if r["mode"] == "single" and r.get("status") == "ok"), None)
    if single and rows[-1].get("status") == "ok":
        rows[-1]["scaling"] = round(world * single["ms_per_step"] / rows[-1]["ms_per_step"], 3)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if cuda:
        torch.cuda.synchronize(device)
    dist.barrier()  # every rank done with FSDP2's collectives before the group goes away
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"kind": "dp" if args.dp else "fsdp", "model": args.model, "gpu": args.gpu, "env": common.environment(device),
            "step": f"flow-matching loss + backward + {'AdamW' if args.optimizer == 'adamw' else 'no optimizer'}, FSDP2 ({'bf16 params / fp32 reduce' if cuda else 'fp32, gloo'}), "
                    f"recompute {strategy}" + (f", {args.master_dtype} master weights" if args.master_dtype else "")
                    + (f" at {args.budget} GiB per GPU" if args.budget else "")
                    + (", shards, gradients and optimizer states on the host (CPUOffloadPolicy)"
                       if args.cpu_offload else ""),
            "runs": args.runs, "warmup": args.warmup, "results": rows, "per_rank": gathered}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="wan2.1-t2v-1.3b")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list of {', '.join(ALL_STRATEGIES)}")
    p.add_argument("--gpu", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default=None, help="compile backend for the blocks (default: the spec's, inductor)")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per strategy process")
    p.add_argument("--fsdp", action="store_true", help="torchrun: FSDP2 step (auto recompute at --budget)")
    p.add_argument("--dp", action="store_true", help="torchrun: data-parallel scaling against one GPU")
    p.add_argument("--master-dtype", choices=("bf16", "fp32"), default=None,
                   help="--fsdp/--dp: the sharded weights' dtype (default: shard's -- fp32 masters for a model "
                        "with mixed dtypes, as Wan's; bf16 halves weights, gradients and AdamW states: what "
                        "lets a 14B full fine-tune fit on 2 x 80 GB)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="--fsdp/--dp: FSDP2's CPUOffloadPolicy (magi_zoo.train.shard(cpu_offload=True)): the shards, "
                        "their gradients and the optimizer states in host memory, the optimizer step on the CPU")
    p.add_argument("--strategy", default=None, choices=ALL_STRATEGIES,
                   help="--fsdp/--dp: the recompute strategy of both modes (default: auto at --budget, else "
                        "regional_full)")
    p.add_argument("--budget", type=float, default=None, help="--fsdp/--dp: auto recompute budget, GiB per GPU "
                   "(default: full checkpointing)")
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="none: forward + backward only (the reference setting, docs/training.md); auto then counts no states")
    p.add_argument("--expandable-segments", action="store_true",
                   help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in every process (set before CUDA starts): "
                        "the caching allocator grows segments instead of caching fixed blocks, so a peak near the "
                        "card's size fragments less (the 14B FSDP2 row failed with 5.4 GiB reserved but unallocated)")
    p.add_argument("--merge", action="store_true",
                   help="add this run's rows to the results file already there (same card, commit and settings; "
                        "a strategy run again replaces its row): one table from several shorter invocations")
    p.add_argument("--smoke", action="store_true", help="tiny models on CPU, eager backend, 2 runs: plumbing")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=common.results_dir("train"))
    common.add_commit_argument(p)
    args = p.parse_args(argv)
    common.measured_commit()  # refused before anything is measured where the commit cannot be known
    if args.expandable_segments:  # before any CUDA work; the rows' / ranks' processes inherit it
        common.use_expandable_segments()
    if args.smoke:
        args.device, args.gpu, args.backend = "cpu", "cpu", args.backend or "eager"
        args.runs, args.warmup = min(args.runs, 2), min(args.warmup, 1)
    if args.one:
        row = run_one(args)
        Path(args.result_file).write_text(json.dumps(row, default=str))
        return 0
    if not args.one and not (args.fsdp or args.dp):
        try:  # a bad name or cap: one line, before any build
            check_strategies(args.strategies.split(","))
        except ValueError as e:
            p.error(str(e))
    if args.fsdp or args.dp:
        if args.smoke:
            args.model = "wan2.1-tiny" if args.model == "wan2.1-t2v-1.3b" else args.model
        rec = run_distributed(args)
        if rec is None:
            return 0
        stem = f"train_{'dp' if args.dp else 'fsdp'}_{args.model}" + (f"_{args.gpu}" if args.gpu not in ("auto", "cpu") else "") \
            + ("_cpuoffload" if args.cpu_offload else "")
        recs = [(stem, rec)]
    else:
        models = ["wan2.1-tiny", "flux-tiny"] if args.smoke else [args.model]
        recs = []
        for m in models:
            args.model = m
            stem = f"train_{m}" + (f"_{args.gpu}" if args.gpu not in ("auto", "cpu") else "") \
                + ("_noopt" if args.optimizer == "none" else "")
            recs.append((stem, run_single(args)))
    for stem, rec in recs:
        rec["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        if args.merge:
            rec = merge_into(Path(args.out) / f"{stem}.json", rec)
        common.publish(Path(args.out), stem, rec, markdown(rec))
    return 0


def merge_into(path: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """`rec`'s rows added to the results already at `path` (--merge: one table from several
    invocations, e.g. one cap per command): a strategy measured again replaces its old row.
    Only a file of the same card, commit, step and timing settings is merged; a ratio stays
    within one invocation (each row's baseline is the eager_full row run beside it)."""
    if not path.is_file():
        return rec
    old = json.loads(path.read_text())
    same = ("card", "commit")
    if any(old.get("env", {}).get(k) != rec["env"].get(k) for k in same) or \
            any(old.get(k) != rec.get(k) for k in ("kind", "model", "step", "runs", "warmup")):
        raise SystemExit(f"--merge: {path} is another run (card, commit, step or --runs/--warmup differ); "
                         "move it away or run without --merge")
    new = {r["strategy"] for r in rec["results"]}
    return {**rec, "results": [r for r in old["results"] if r.get("strategy") not in new] + rec["results"]}


if __name__ == "__main__":
    raise SystemExit(main())
