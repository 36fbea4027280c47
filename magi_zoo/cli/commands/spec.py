"""`magi-zoo spec`: the resolved plan of a model on a GPU, section by section, resolved
against the real module tree built on the meta device (no memory, no download)."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn

from ... import adapters, zoo  # `zoo.load` looked up at call time: a patch of it reaches every command
from ...adapters import lora
from ...engine import STEP_ORDER, PlanError, format_table, list_custom_ops, preview
from ...engine.compat import torch as compat
from ...engine.offload import describe_plan
from ...overrides import activation_reserves, name_plan_source, spec_layers
from ...specs import SECTIONS, get_profile
from ..console import say
from .run_options import parse_loras


def cmd_spec(args) -> int:
    adapter, variant = adapters.lookup(args.model)
    profile = get_profile(args.gpu)
    recompute = None if args.recompute is None else parse_recompute(args.recompute)
    if args.measure and recompute is None:
        raise ValueError("--measure calibrates --recompute auto:GIB; add --recompute auto:GIB (e.g. auto:16), or "
                         "drop --measure")
    # with --recompute: the plan a training load applies
    layers = spec_layers(adapter, profile, spec_file=args.spec_file, memory_budget_gib=args.memory_budget,
                         train=recompute is not None, recompute=recompute)
    per_element = 4 if profile.default_dtype == "float32" else 2  # what load's default dtype gives
    # the offload reserves for the call defaults' shape, as load sizes them (docs/offload.md)
    layers = activation_reserves(layers, adapter.activation_estimate(variant, adapter.call_defaults(variant), per_element))
    # The meta device gives the real module tree at published sizes without allocating.
    native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    modules = nn.ModuleDict(adapter.components(native))
    try:
        plan = preview(modules, layers, adapter.preparations(native))
    except PlanError as e:  # name the file (or flag) the key came from
        raise name_plan_source(e, args.spec_file or adapter.spec_path(), profile.name,
                               shipped=args.spec_file is None) from None
    say(f"{variant.name} on {profile.name} ({profile.device}, default dtype {profile.default_dtype}); "
        f"spec {args.spec_file or adapter.spec_file}, layers: {' < '.join(n for n, _ in layers)}")
    say(f"apply steps, in order: {' -> '.join(STEP_ORDER)}")
    for p in adapter.preparations(native):
        say(f"  prepare: {p.name}: {p.why}")
    ops = family_custom_ops(adapter)
    say(f"custom ops of this model: {', '.join(ops) or 'none'}")
    for name in sorted(SECTIONS, key=lambda n: STEP_ORDER.index(n) if n in STEP_ORDER else len(STEP_ORDER)):
        rows = plan.section(name).table()
        say(f"[{name}]")
        say(format_table([{k: v for k, v in r.items() if k != "section"} for r in rows]) if rows
            else "  (nothing set: library default)")
    say(describe_plan(modules, plan, profile))
    specs = parse_loras(getattr(args, "lora", None)) or []
    for spec, state in zip(specs, lora.prepare(specs, native, adapter.components(native), variant.name)):
        say(lora.LoraState([spec], [lora.adapted_layers(state)], deltas=[lora.describe_deltas(state)]).lines()[0])
    if recompute is not None:
        for line in spec_recompute_lines(args.model, args.gpu, recompute, args.measure):
            say(line)
    return 0


def family_custom_ops(adapter) -> list[str]:
    """Names of the registered custom ops defined by the adapter's own modules (its package,
    or its module for a one-file family): the registry itself is process-wide."""
    mod = type(adapter).__module__
    pkg = getattr(sys.modules.get(mod), "__package__", None) or mod
    prefix = mod if pkg == adapters.__name__ else pkg
    return [i.name for i in list_custom_ops()
            if (compat.custom_op_module(i.op) or "").split(".")[:len(prefix.split("."))] == prefix.split(".")]


def parse_recompute(text: str) -> Any:
    """`--recompute`: ``full`` / ``selective`` / ``none`` / ``auto:16`` (the training peak, GiB)."""
    policy, _, budget = text.partition(":")
    if policy == "auto":
        if not budget:
            raise ValueError("--recompute auto needs a budget: auto:GIB, e.g. auto:16")
        try:
            return {"policy": "auto", "train_peak_gib": float(budget)}
        except ValueError:
            raise ValueError(f"--recompute {text!r}: the budget after 'auto:' is GiB, a number") from None
    if budget:
        raise ValueError(f"--recompute {text!r}: only auto takes a budget (auto:GIB)")
    return policy


def spec_recompute_lines(model: str, gpu: str, value: Any, measure: bool) -> list[str]:
    """What `magi-zoo spec --recompute` adds: for `auto`, the measured per-block choice
    (--measure builds the model with random weights on this machine and calibrates it), or
    how to get it."""
    if not (isinstance(value, dict) and value.get("policy") == "auto"):
        return []
    if not measure:
        return ["recompute auto: the per-block choice is measured, not resolved: add --measure (builds the model "
                "with random weights here and measures one block), or read load(train=True).report()"]
    h = zoo.load(model, gpu=gpu, weights=None if model.endswith("tiny") else "random", train=True, recompute=value)
    rec = h.report().step("recompute")
    lines = [f"recompute (measured on {h.device}): {rec.did}"]
    for key, a in rec.details.get("auto", {}).items():
        lines.append(f"  {key}: options per block: " + "; ".join(
            f"{o['name']} {o['gib_per_block']} GiB / {o['recompute_ms_per_block']} ms" for o in a["options"]))
    return lines
