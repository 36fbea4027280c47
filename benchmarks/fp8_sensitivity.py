"""Where fp8 loses accuracy in a model's blocks: the fp32 distance of the spec's fp8 plan with
each group of block linears kept bf16, one group at a time.

    python -m benchmarks.fp8_sensitivity --model ltx-2 --layers 2
    python -m benchmarks.fp8_sensitivity --model ltx-2 --layers 2 --cpu-fp8 --frames 25   # no GPU: fp8 numerics on CPU
    python -m benchmarks.fp8_sensitivity --model ltx-2 --layers 8 --groups ff,audio_ff   # only these rows
    python -m benchmarks.fp8_sensitivity --model ltx-2-tiny --smoke --out /tmp/fp8-sens   # CPU: the script works
    python -m benchmarks.fp8_sensitivity --model z-image-turbo --layers 2 --cpu-fp8 --height 256 --width 256 \
        --regions "transformer.layers.*,transformer.noise_refiner.*,transformer.context_refiner.*"  # not yet fp8

The published config with `--layers` of its repeated blocks (`benchmarks.run`'s derivation),
random weights, bf16, the family's denoiser entry on its example inputs (`--height`, `--width`,
`--frames` change the shape). Measured, as the shipped-path gate measures
(tests/gpu/test_shipped_path.py): the relative L2 distance from an fp32 eager forward of bf16
eager, of the spec's fp8 plan, and of that plan with one more group kept bf16 -- the spec's own
``keep_bf16`` patterns stay, and a group is the linears under one child of the block (``attn1``,
``ff``, ``audio_attn1``, ...). So the rows answer "what else to keep". The gate is fp8 <= 3x
bf16 eager's distance; a group whose row falls under it is where the loss is.

`--cpu-fp8` measures the same rows without a GPU: the fp8 linears run on the CPU through torch's
CPU ``_scaled_mm`` (the same e4m3 rounding and the same per-row scales as on a card; only the
fp32 accumulation order differs, and CUDA's fast accumulation is not modelled), and every region
runs eager (compiled fp8 differs from eager fp8 by inductor's fusion of the same quantization).
Its numbers are the plan's numerics, not its speed, and the record says where they were taken.
On the CPU without it (`--smoke`) there are no fp8 matmuls: every row is bf16 (the plumbing
only, and the record says so). Writes ``fp8_sensitivity_<model>_<card>.{json,md}``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import common

FP8_GATE = 3.0


def _groups(block) -> list[str]:
    """The block's children that hold linears, in order."""
    import torch.nn as nn

    return [name for name, child in block.named_children()
            if any(isinstance(m, nn.Linear) for m in child.modules())]


def main(argv=None) -> int:
    import torch
    import torch.nn as nn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ltx-2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=common.results_dir("quality"))
    ap.add_argument("--smoke", action="store_true", help="CPU (pass a tiny variant), bf16 only")
    ap.add_argument("--cpu-fp8", action="store_true",
                    help="CPU, fp8 linears through torch's CPU _scaled_mm, regions eager: the numerics without a GPU")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--stem", default=None, help="results file name (default fp8_sensitivity_<model>_<card>)")
    ap.add_argument("--regions", default=None,
                    help="comma-separated precision keys to measure as fp8 regions (a spec that declares "
                         "them without a matmul, e.g. Z-Image's blocks, which fp8 does not yet hold)")
    ap.add_argument("--groups", default=None,
                    help="comma-separated block children to try (default: every child that holds linears)")
    common.add_commit_argument(ap)
    args = ap.parse_args(argv)

    from benchmarks import run
    from magi_zoo import adapters
    from magi_zoo.engine import apply, preview, remove
    from magi_zoo import SpecFile
    from magi_zoo.overrides import eager_compile, fp8_region_keys, spec_layers
    from magi_zoo.specs import get_profile

    if args.smoke and args.cpu_fp8:
        ap.error("--smoke (bf16 plumbing) and --cpu-fp8 (fp8 numerics on the CPU) exclude each other")
    cuda = not (args.smoke or args.cpu_fp8)
    device = torch.device("cuda" if cuda else "cpu")
    env = common.environment(device)
    adapter, variant = adapters.lookup(args.model)
    derived = variant if variant.tiny else run.LAYER_VARIANTS[adapter.family](variant, args.layers)[0]
    profile = get_profile("auto" if cuda else "cpu")
    if args.cpu_fp8:
        # the CPU profile declares no fp8 (no user should run fp8 on a CPU: it is slow); this
        # measurement wants its numerics, which torch's CPU _scaled_mm computes
        profile = profile.model_copy(update={"fp8": True})
    precision = "fp8" if profile.fp8 else None
    # On the CPU the regions run eager: --smoke checks the plumbing, not compiled code, and a CPU
    # compile of each of the ~10 plans would be most of the run's time
    compile_kw = {} if cuda else {"compile": eager_compile(SpecFile.from_toml(adapter.spec_path()))}
    # --regions: those keys as fp8 regions too (a matmul named in the user layer makes a key one)
    extra = {k.strip(): {"matmul": "bf16"} for k in (args.regions or "").split(",") if k.strip()}

    def overrides(keep: dict[str, dict] | None = None) -> dict:
        merged = {k: dict(v) for k, v in extra.items()}
        for k, v in (keep or {}).items():
            merged.setdefault(k, {}).update(v)
        return {"overrides": {"precision": merged}} if merged else {}

    if not fp8_region_keys(spec_layers(adapter, profile, **overrides(), **compile_kw)):
        ap.error(f"{adapter.family}'s spec declares no fp8 regions (no precision key names a matmul); "
                 "name the keys to measure with --regions")
    base = spec_layers(adapter, profile, precision=precision, **overrides(), **compile_kw)
    regions = fp8_region_keys(base)

    def region_groups(pipe) -> dict[str, list[str]]:
        """Per fp8 region, the groups of the first block it resolves to, as the engine resolves
        the plan (a region keyed by class or by path: Z-Image keys each of its three block sites
        by path, and its context refiner's blocks hold no modulation linears)."""
        resolved = preview(nn.ModuleDict(adapter.components(pipe)), base).section("precision").regions()
        return {key: _groups(targets[0].module) for (key, _), targets in resolved.items() if key in regions}

    def every_group(per_region: dict[str, list[str]]) -> list[str]:
        """Every region's groups, each once, in order."""
        return list(dict.fromkeys(g for gs in per_region.values() for g in gs))

    asked = [g.strip() for g in args.groups.split(",") if g.strip()] if args.groups else None
    if asked:  # checked on a weightless build (the meta device) before the real one
        known = every_group(region_groups(adapter.build_random(derived, torch.bfloat16, torch.device("meta"))))
        unknown = [g for g in asked if g not in known]
        if unknown:
            ap.error(f"--groups {', '.join(unknown)}: not a child of the block that holds linears; "
                     f"those are: {', '.join(known)}")
    torch.manual_seed(0)
    handle, _ = run._assemble(adapter, derived, gpu=profile.name, dtype=torch.bfloat16, device=device,
                              compiled=False, backend=None, cache_dir=None, derived=True)
    module, method = adapter.entry(handle.pipe, adapter.entry_points[0])
    shape = {k: v for k, v in (("height", args.height), ("width", args.width), ("frames", args.frames)) if v}
    inputs = adapter.example_inputs(handle.pipe, handle.variant, adapter.entry_points[0], **shape)
    call = lambda kw: run._first_tensor(getattr(module, method)(**kw)).double()  # noqa: E731
    where = region_groups(handle.pipe)  # the plan resolved once on the real build
    groups = asked or every_group(where)
    # what the plan already keeps bf16, per region, as the engine resolves the layers it is made of
    resolved = preview(handle.modules, base, adapter.preparations(handle.pipe)).section("precision")
    spec_keep = {key: targets[0].spec.keep_bf16 for (key, _), targets in resolved.regions().items()}

    def distance(out) -> float:
        return float((out - ref).norm() / ref.norm())

    rows = []
    with torch.no_grad():
        ref = common.fp32_forward(module, call, inputs)
        eager = distance(call(inputs))
        rows.append({"row": "bf16 eager", "distance": eager})
        for group in [None, *groups]:
            # the group kept bf16 in every region whose blocks have it (a keep_bf16 pattern that
            # matches no linear of a region is refused)
            keep = None if group is None else {
                r: {"keep_bf16": list(dict.fromkeys([*spec_keep.get(r, ()), f"{group}.*"]))} for r in regions
                if group in where.get(r, ())}
            layers = spec_layers(adapter, profile, precision=precision, **overrides(keep), **compile_kw)
            torch.compiler.reset()
            apply(handle.modules, layers=layers, gpu=profile, preparations=adapter.preparations(handle.pipe))
            try:
                d = distance(call(inputs))
            finally:
                remove(handle.modules)
            plan = "fp8" if precision else "bf16 (smoke)"
            rows.append({"row": f"{plan} plan" if group is None else f"{plan}, {group} kept bf16", "distance": d,
                         "x_eager": d / eager, "within_gate": d <= FP8_GATE * eager})
            print(f"[bench] {rows[-1]}", flush=True)
    kept = sorted({p for ps in spec_keep.values() for p in ps})
    note = ("SMOKE / PLUMBING ONLY: no fp8 matmuls on this profile, every row is bf16" if not profile.fp8 else
            "fp8 numerics on the CPU (torch's CPU _scaled_mm, regions eager), not a GPU's" if args.cpu_fp8 else "")
    if kept:
        note = (note + "; " if note else "") + f"every row also keeps the spec's keep_bf16: {', '.join(kept)}"
    md = [f"# {args.model}: fp8 distance from fp32 by group kept bf16 ({args.layers} blocks"
          + "".join(f", {k} {v}" for k, v in shape.items()) + ")", "",
          common.env_line(env), "", *([note, ""] if note else []),
          common.results_table(rows, ["row", "distance", "x_eager", "within_gate"])]
    record = {"environment": env, "model": args.model, "layers": args.layers, "shape": shape, "gate": FP8_GATE,
              "groups": groups, "spec_keep_bf16": kept, "cpu_fp8": args.cpu_fp8, "note": note, "rows": rows}
    stem = args.stem or f"fp8_sensitivity_{args.model}_{common.card_tag(env, cuda)}"
    common.publish(args.out, stem, record, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
