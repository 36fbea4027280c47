"""The h100 plan over every registered family, with no edit for a new one: every section of the
spec's h100 table applied to the tiny variant (its compile regions eager), with the fa3 kernel
present as a CPU stand-in (the wheel's op signature, SDPA inside), runs every entry point and
gives the bf16 eager output.

What this catches is a plan the card would fail on mid-generation although every key resolves
(the conformance suite's meta-device check): an attention call of the example inputs that the
chosen backend cannot take, a fusion or preparation that breaks a family's forward. (A call
the example inputs do not make, such as Qwen-Image's masked batch of unequal prompts, is its
own test: tests/engine/test_attention_backends.py.) The kernel's speed and numerics are the GPU
suite's.
"""

from __future__ import annotations

import pytest
import torch

import magi_zoo
from magi_zoo.adapters import all_adapters
from magi_zoo.engine import remove
from magi_zoo.engine.compat import diffusers as diffusers_compat
from magi_zoo.engine.prepare import prepare
from magi_zoo.overrides import eager_compile, spec_layers
from magi_zoo.specs import PlanLayer, SpecFile
from helpers.entry_calls import call_entry, tensors
from helpers.fa3_standins import install_fa3

H100 = magi_zoo.get_profile("h100")
ADAPTERS = all_adapters()
TINY = [(a, next(v for v in a.variants.values() if v.tiny)) for a in ADAPTERS]


@pytest.fixture
def fa3_standin(monkeypatch):
    """fa3 'installed' as the CPU stand-in; diffusers' _flash_3 slot put back afterwards."""
    install_fa3(monkeypatch)
    member = diffusers_compat.fa3_member()
    saved = diffusers_compat.backend_entry(member)
    yield
    diffusers_compat.restore_backend_entry(member, saved)


def _run(h, entry) -> list[torch.Tensor]:
    """The floating-point tensors of one entry-point call, in fp32 for comparing."""
    return [t.float() for _, t in tensors(call_entry(h, entry)) if t.is_floating_point()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("tiny", TINY, ids=[v.name for _, v in TINY])
def test_hopper_plan_runs_every_entry_point(tiny, fa3_standin):
    adapter, variant = tiny
    h = magi_zoo.load(variant.name, gpu="cpu", dtype="bfloat16", compile=False)
    # the eager reference with the adapter's preparations, which keep values and may add the
    # method an entry point names (Qwen3-Omni's prefill / decode_step)
    prepare(h.modules, adapter.preparations(h.pipe))
    refs = {e: _run(h, e) for e in adapter.entry_points}
    # every h100 section as shipped, its compile regions eager (inductor on a CPU would test
    # the CPU compiler, not the plan)
    off = PlanLayer(compile=eager_compile(SpecFile.from_toml(adapter.spec_path())))
    magi_zoo.apply(h.modules, layers=[*spec_layers(adapter, H100), ("user", off)], gpu=H100,
                   preparations=adapter.preparations(h.pipe))
    try:
        for entry, ref in refs.items():
            got = _run(h, entry)
            assert [t.shape for t in got] == [t.shape for t in ref], f"{variant.name}:{entry}"
            worst = max(_rel(g, r) for g, r in zip(got, ref))
            # measured: 0 where only the backend changes (the stand-in is SDPA), 1.9e-3 on
            # flux-tiny (its fused q/k norm + rope and GELU epilogues round differently in bf16)
            assert worst < 1e-2, f"{variant.name}:{entry}: the h100 plan vs bf16 eager {worst:.3g}"
    finally:
        remove(h.modules)
