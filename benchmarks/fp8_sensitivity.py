"""Where fp8 loses accuracy in a model's blocks: the fp32 distance of the spec's fp8 plan with
each group of block linears kept bf16, one group at a time.

    python -m benchmarks.fp8_sensitivity --model ltx-2 --layers 2
    python -m benchmarks.fp8_sensitivity --model ltx-2-tiny --smoke --out /tmp/fp8-sens   # CPU: the script works

The published config with `--layers` of its repeated blocks (`benchmarks.run`'s derivation),
random weights, bf16, the family's denoiser entry on its example inputs. Measured, as the
shipped-path gate measures (tests/gpu/test_shipped_path.py): the relative L2 distance from an
fp32 eager forward of bf16 eager, of the spec's fp8 plan, and of that plan with one group kept
bf16 through the precision spec's ``keep_bf16`` -- a group is the linears under one child of
the block (``attn1``, ``ff``, ``audio_attn1``, ...). The gate is fp8 <= 3x bf16 eager's
distance; a group whose bf16 row falls under it is where the loss is. On the CPU (`--smoke`)
there are no fp8 matmuls: every row is bf16 (the plumbing only, and the record says so).
Writes ``fp8_sensitivity_<model>_<card>.{json,md}``.
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

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ltx-2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=common.results_dir("quality"))
    ap.add_argument("--smoke", action="store_true", help="CPU (pass a tiny variant), bf16 only")
    common.add_commit_argument(ap)
    args = ap.parse_args(argv)

    from benchmarks import run
    from magi_zoo import adapters
    from magi_zoo.engine import apply, remove
    from magi_zoo import SpecFile
    from magi_zoo.overrides import eager_compile, spec_layers
    from magi_zoo.specs import get_profile

    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    env = common.environment(device)
    adapter, variant = adapters.lookup(args.model)
    derived = variant if variant.tiny else run.LAYER_VARIANTS[adapter.family](variant, args.layers)[0]
    profile = get_profile("auto" if cuda else "cpu")
    torch.manual_seed(0)
    handle, _ = run._assemble(adapter, derived, gpu=profile.name, dtype=torch.bfloat16, device=device,
                              compiled=False, backend=None, cache_dir=None, derived=True)
    module, method = adapter.entry(handle.pipe, adapter.entry_points[0])
    inputs = adapter.example_inputs(handle.pipe, handle.variant, adapter.entry_points[0])
    call = lambda kw: run._first_tensor(getattr(module, method)(**kw)).double()  # noqa: E731
    precision = "fp8" if profile.fp8 else None
    # --smoke checks the plumbing, not compiled code: its regions run eager (a CPU compile of each
    # of the ~10 plans would be most of the test's time)
    compile_kw = {"compile": eager_compile(SpecFile.from_toml(adapter.spec_path()))} if args.smoke else {}
    base = spec_layers(adapter, profile, precision=precision, **compile_kw)
    regions = list(dict.fromkeys(k for _, layer in base for k in layer.entries("precision")))
    blocks = [m for m in module.modules() if type(m).__name__ in regions]
    groups = _groups(blocks[0]) if blocks else []

    def distance(out) -> float:
        return float((out - ref).norm() / ref.norm())

    rows = []
    with torch.no_grad():
        ref = common.fp32_forward(module, call, inputs)
        eager = distance(call(inputs))
        rows.append({"row": "bf16 eager", "distance": eager})
        for group in [None, *groups]:
            keep = None if group is None else {"precision": {r: {"keep_bf16": [f"{group}.*"]} for r in regions}}
            layers = spec_layers(adapter, profile, precision=precision, overrides=keep, **compile_kw)
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
    note = "" if profile.fp8 else ("SMOKE / PLUMBING ONLY: no fp8 matmuls on this profile, every row is bf16")
    md = [f"# {args.model}: fp8 distance from fp32 by group kept bf16 ({args.layers} blocks)", "",
          common.env_line(env), "", *([note, ""] if note else []),
          common.results_table(rows, ["row", "distance", "x_eager", "within_gate"])]
    record = {"environment": env, "model": args.model, "layers": args.layers, "gate": FP8_GATE, "groups": groups,
              "note": note, "rows": rows}
    stem = f"fp8_sensitivity_{args.model}_{common.card_tag(env, cuda)}"
    common.publish(args.out, stem, record, "\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
