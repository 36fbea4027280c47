"""The offload step. No `offload` plan section exists yet, so nothing is moved; the step
reads the GPU profile's memory and says whether the resident weights fit in it, so a plan
for a card that cannot hold the model fails loudly in the report instead of at the first
out-of-memory error deep inside a forward."""

from __future__ import annotations

import warnings

import torch.nn as nn

from .steps import StepContext, StepRecord, register_step

GIB = 1024 ** 3


def resident_bytes(root: nn.Module, device_type: str) -> int:
    """Bytes of parameters and buffers on `device_type` under `root` (shared tensors once)."""
    seen, total = set(), 0
    for t in [*root.parameters(), *root.buffers()]:
        if t.device.type == device_type and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@register_step("offload")
def offload_step(ctx: StepContext) -> StepRecord:
    p = ctx.profile
    used = resident_bytes(ctx.root, p.device) / GIB
    did = f"none requested; weights {used:.2f} GiB on {p.device}, profile {p.name} has {p.memory_gib:g} GiB"
    if used > p.memory_gib:
        did += " -- does not fit"
        warnings.warn(f"magi_zoo: the module's weights ({used:.1f} GiB) exceed the {p.name} profile's "
                      f"{p.memory_gib:g} GiB; pick the profile of the card you run on (gpu=...)",
                      RuntimeWarning, stacklevel=3)
    return StepRecord("offload", did, None, {"resident_gib": round(used, 3), "budget_gib": p.memory_gib})
