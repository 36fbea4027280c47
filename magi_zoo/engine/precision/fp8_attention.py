"""fp8 attention: with ``attention = "fp8"`` a region's attention layers that the attention step
put on fa3 are switched to FA3's fp8 path (`engine/kernels/fa3.py`: per-head scales, K and V
smoothed over tokens); layers on other backends stay bf16 and the report says so. A switched
layer's calls with an attention mask or dropout (which FA3 cannot compute) run in bf16 on SDPA."""

from __future__ import annotations

import warnings

from .. import attention
from ..compat import diffusers as diffusers_compat
from ..kernels import fa3


def switch_to_fp8(key: str, targets, profile, backends: list) -> str:
    """Switch the region's attention layers to fp8 FA3 (the attention step ran before this
    one and chose the backends). fp8 attention exists only on fa3, so: layers on fa3 switch;
    layers nobody chose a backend for (the library default) switch too when fa3 can run here
    (asking for fp8 attention is asking for its kernel: Flux's plan leaves bf16 attention on
    the library default, where fa3 gains nothing); layers on a backend someone chose stay
    bf16, with a warning, as do all when fa3 cannot run. Appends (processor, its backend before)
    to `backends` (the undo); returns the report fragment."""
    fa3_member = diffusers_compat.fa3_member()
    backend = diffusers_compat.processor_backend
    procs = [p for t in targets for p in attention.processors(t.module)]
    on_fa3 = [p for p in procs if backend(p) == fa3_member]
    default = [p for p in procs if backend(p) is None]
    blocked = attention.unavailable_reason("fa3", profile) if default else None
    promoted = default if default and blocked is None else []
    if not on_fa3 and not promoted:
        others = sorted({"the library default" if backend(p) is None
                         else getattr(backend(p), "value", str(backend(p))) for p in procs})
        why = (f"its attention layers use {', '.join(others)}; fp8 attention runs "
               "on the fa3 backend only (the `hopper` extra on a Hopper card)"
               + (f", and fa3 cannot run here: {blocked}" if blocked else "")) if procs else "it has no attention layer"
        warnings.warn(f"magi_zoo: precision key {key!r}: attention stays bf16: {why}", RuntimeWarning, stacklevel=4)
        return f"attention on {key or '<root>'} stays bf16 ({why})"
    member = fa3.register_fp8()
    for p in on_fa3 + promoted:
        backends.append((p, backend(p)))
        diffusers_compat.set_processor_backend(p, member)
    kept = len(procs) - len(on_fa3) - len(promoted)
    if kept:
        warnings.warn(f"magi_zoo: precision key {key!r}: {kept} attention layer(s) on a backend other than fa3 "
                      "stay bf16 (fp8 attention runs on fa3 only)", RuntimeWarning, stacklevel=4)
    return (f"fp8 attention on {key or '<root>'} ({len(on_fa3) + len(promoted)} layers, fa3 e4m3, per-head scales, "
            f"K/V smoothed{f'; {len(promoted)} from the library default' if promoted else ''}"
            + (f"; {kept} non-fa3 layer(s) kept bf16" if kept else "")
            + f"; {MASKED_CALLS})")


# What the fp8 path does with the calls FA3 cannot compute (kernels/fa3.py, `fa3_fp8_attention`):
# stated in every report that switches a layer, since which calls carry a mask is the model's.
MASKED_CALLS = "a call with a mask or dropout runs bf16 on SDPA"


def undo_fp8(backends: list) -> None:
    """Put each processor's earlier backend back (last first)."""
    for proc, prior in reversed(backends):
        diffusers_compat.set_processor_backend(proc, prior)
