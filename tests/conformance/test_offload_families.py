"""Offload over every registered family, with no edit for a new one: every published variant of a
family whose spec names offload units plans within a 24 GiB card (an RTX 4090's memory, the
budget the offload goals are set at) -- built on the meta device, sizes only, through the same
planner `load(..., memory_budget_gib=24)` asks before it builds anything. A family whose spec
names none refuses the budget with what to add.

What this catches before a card is spent: a variant whose units cannot fit the budget (a
resident component larger than the card, an activation reserve that leaves nothing to stream
into), which the GPU run would only report as a refused plan. The streamed forward's speed is
the offload benchmark's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.adapters import all_adapters
from magi_zoo.engine import needs_streaming
from magi_zoo.engine.offload import GIB
from magi_zoo.overrides import spec_layers, with_memory_budget

BUDGET_GIB = 24
H100 = magi_zoo.get_profile("h100")  # the profile's other sections; the budget is the user's
PUBLISHED = [(a, v) for a in all_adapters() for v in a.variants.values() if not v.tiny]


def _declares_offload(adapter) -> bool:
    return any(layer.entries("offload") for _, layer in spec_layers(adapter, H100))


@pytest.mark.parametrize("published", PUBLISHED, ids=[v.name for _, v in PUBLISHED])
def test_published_variant_plans_within_24_gib(published):
    adapter, variant = published
    if not _declares_offload(adapter):
        with pytest.raises(ValueError, match=r"names no \[\*\.offload\] units"):
            with_memory_budget(spec_layers(adapter, H100), BUDGET_GIB)
        return
    native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    root = nn.ModuleDict(adapter.components(native))
    weights = sum(p.numel() * p.element_size() for p in root.parameters())
    plan = needs_streaming(root, with_memory_budget(spec_layers(adapter, H100), BUDGET_GIB), H100,
                           adapter.preparations(native))
    if plan is None:  # nothing streams: the planner found every weight and the reserve within the budget
        assert weights < BUDGET_GIB * GIB, f"{variant.name}: {weights / GIB:.1f} GiB of weights, and nothing streams"
        return
    assert plan.streamed and plan.expected_peak <= BUDGET_GIB * GIB, \
        f"{variant.name}: expected peak {plan.expected_peak / GIB:.2f} GiB over the {BUDGET_GIB} GiB budget"
