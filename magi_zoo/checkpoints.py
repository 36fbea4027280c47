"""Saving a loaded model, optionally as an fp8 checkpoint.

`save_pretrained(handle, path, precision="fp8")` (also `handle.save_pretrained(...)`) writes
the family's own directory (`Adapter.save_pretrained`) with the linears that
`load(..., precision="fp8")` would run in fp8 -- the eligible linears of the regions the spec's
precision section declares, its `keep_bf16` patterns honoured -- stored quantized by the
engine's own quantizer (`Fp8Linear`: float8 e4m3, one fp32 scale per output row), plus
``magi_zoo_fp8.json`` naming them. `load(name, weights=path)` reads those back as `Fp8Linear`
without a bf16 copy (`adapters/fp8_checkpoint.py`): the same tensors quantize-at-load makes,
half the bytes on the host and through the offload streams.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .adapters.diffusers_pipeline import DiffusersPipelineAdapter
from .adapters.fp8_checkpoint import FORMAT, MANIFEST
from .engine import Fp8Linear, fp8_eligible, preview
from .io import check_writable
from .overrides import fp8_region_keys, spec_layers
from .specs.gpu_profiles import GpuProfile


def fp8_linears(adapter: Any, native: Any, profile: GpuProfile) -> dict[str, list[str]]:
    """component -> the linear paths (relative to it) that precision='fp8' quantizes: the
    precision section resolved (not applied) on the module tree, read as the precision step reads it."""
    modules = nn.ModuleDict(adapter.components(native))
    # every region the precision section declares with a matmul is what precision="fp8" sets
    # (overrides.fp8_region_keys); the layers without that argument, so that quantizing for a file
    # needs no card with fp8 matmuls
    layers = spec_layers(adapter, profile)
    plan = preview(modules, layers, adapter.preparations(native))
    eligible = set(fp8_region_keys(layers))
    out: dict[str, list[str]] = {}
    for (key, _), targets in plan.section("precision").regions().items():
        if key not in eligible:
            continue  # listed for its fusions only: precision="fp8" leaves it as built
        spec = targets[0].spec
        for t in targets:
            comp, _, below = t.path.partition(".")
            for sub, m in t.module.named_modules():
                if not sub or not (isinstance(m, Fp8Linear) or (type(m) is nn.Linear and fp8_eligible(m))):
                    continue  # (an Fp8Linear: a plan already quantized it, written as it is)
                if any(fnmatch.fnmatchcase(sub, pat) for pat in spec.keep_bf16):
                    continue
                out.setdefault(comp, []).append(".".join(x for x in (below, sub) if x))
    return {c: sorted(set(p)) for c, p in out.items()}


@contextlib.contextmanager
def standard_layout(modules):
    """Parameters in torch's standard (contiguous) layout while the block runs, then back in
    the layout they had: safetensors writes only contiguous tensors, and a plan's
    memory_format step keeps convolution weights channels-last (same values, other strides)."""
    moved: list[tuple[torch.nn.Parameter, torch.memory_format]] = []
    try:
        with torch.no_grad():
            for module in modules:
                for prm in module.parameters():
                    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(prm.dim())
                    # contiguous already, or a layout no step of ours makes (the library's save decides)
                    if prm.is_contiguous() or fmt is None or not prm.is_contiguous(memory_format=fmt):
                        continue
                    prm.data = prm.data.contiguous()
                    moved.append((prm, fmt))
        yield
    finally:
        with torch.no_grad():
            for prm, fmt in moved:
                prm.data = prm.data.contiguous(memory_format=fmt)


def save_pretrained(handle: Any, path: str | Path, *, precision: str | None = None, overwrite: bool = False) -> Path:
    """Write `handle`'s model so that `load(name, weights=path)` reads it back. precision:
    None (as held) or "fp8" (the fp8 regions' linears quantized, see the module docstring).
    `path` is a new or empty directory; one that holds files is refused unless `overwrite`
    (the library writers replace a checkpoint's files in place, a user's own among them).
    Save before applying a plan that changes modules (load with compile=False), so the
    library's own classes are what is written."""
    path = Path(path)
    if precision not in (None, "bf16", "fp8"):
        raise ValueError(f"precision={precision!r}; choices: 'fp8' or None")
    check_writable(path, what="save_pretrained's path", directory=True, overwrite=overwrite)
    if precision in (None, "bf16"):
        with standard_layout(handle.adapter.components(handle.pipe).values()):
            return handle.adapter.save_pretrained(handle.pipe, path)
    if not isinstance(handle.adapter, DiffusersPipelineAdapter):
        raise ValueError(f"{handle.variant.name}: fp8 checkpoints are written for the diffusers families (wan, "
                         "wan22, flux, ...); load this one with precision='fp8' (quantized at load) instead")
    targets = fp8_linears(handle.adapter, handle.pipe, handle.profile)
    if not targets:
        raise ValueError(f"{handle.variant.name}: its spec declares no fp8 region; nothing to quantize")
    comps = handle.adapter.components(handle.pipe)
    swaps = []
    try:
        for comp, paths in targets.items():
            for p in paths:
                parent_path, _, name = p.rpartition(".")
                parent = comps[comp].get_submodule(parent_path) if parent_path else comps[comp]
                lin = getattr(parent, name)
                if isinstance(lin, Fp8Linear):
                    continue
                setattr(parent, name, Fp8Linear(lin))  # the precision step's quantizer, bit for bit
                swaps.append((parent, name, lin))
        with standard_layout(comps.values()):
            out = handle.adapter.save_pretrained(handle.pipe, path)
    finally:
        for parent, name, lin in reversed(swaps):
            setattr(parent, name, lin)
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, "components": targets}, indent=1) + "\n")
    index = path / "model_index.json"  # diffusers' loader skips a [null, null] component: read by ours instead
    cfg = json.loads(index.read_text())
    cfg.update({comp: [None, None] for comp in targets})
    index.write_text(json.dumps(cfg, indent=2) + "\n")
    return out
