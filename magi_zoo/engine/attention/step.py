"""`attention_step`: set the attention backend of every attention layer under a region.

Works on diffusers models, whose attention layers hold a processor that dispatches through
`diffusers.models.attention_dispatch` by the processor's backend (what
`ModelMixin.set_attention_backend` sets model-wide); here it is set per region. Also on
transformers' attention layers (Qwen3-Omni), which call the attention interface their config
names: each layer in the region gets its own copy of its config naming the backend ('native' =
transformers' SDPA, 'fa3' = the engine's FA3 function registered in that interface), and on this
project's own layers that declare ATTENTION_BACKENDS (BAGEL's). A region whose subtree has no
such layer is an error, never a silent no-op. Undo restores every layer's previous backend.
``auto`` resolves once per apply; a choice skipped on the way is reported in one warning that
says what to install.
"""

from __future__ import annotations

import warnings

from ..resolve import PlanError
from ..steps import StepContext, StepRecord
from .backends import auto_backend, check_name, resolve_backend
from .layers import (engine_layers, processors, set_engine_layer, set_processors, set_transformers_layer,
                     transformers_backend, transformers_layers)


def attention_step(ctx: StepContext) -> StepRecord:
    section = ctx.plan.section("attention")
    undo_list: list[tuple[object, object, object]] = []  # (object, its setter, prior value)
    done = []
    auto = None  # resolved once per apply: one warning however many regions say auto

    def undo() -> None:
        for obj, setter, prior in reversed(undo_list):
            setter(obj, prior)

    try:
        for (key, _), targets in section.regions().items():
            name = targets[0].spec.backend
            if name is None:
                continue
            note, is_auto = "", name == "auto"
            if is_auto:
                if auto is None:
                    auto = auto_backend(ctx.profile)
                    if auto[1]:
                        warnings.warn(f"attention backend 'auto' on profile {ctx.profile.name!r} uses "
                                      f"{auto[0]!r}: {'; '.join(auto[1])}", RuntimeWarning, stacklevel=2)
                name = auto[0]
                note = f"; auto: {'; '.join(auto[1])}" if auto[1] else ""
            name = check_name(name)
            if name == "fa3" and targets[0].spec.masks == "padding":
                # the spec says this region's masks only pad keys: FA3 can take them (seqused_k)
                name, note = "fa3_varlen", note + "; masks are padding: fa3 as fa3_varlen"
            n, label = 0, None
            for t in targets:
                procs, layers = processors(t.module), engine_layers(t.module)
                hf_layers = transformers_layers(t.module)
                if not procs and not layers and not hf_layers:
                    raise PlanError(f"attention key {key!r}: {t.cls_name} at {t.path or '<root>'!r} has no "
                                    "attention layer under it that takes a backend (a diffusers attention layer, "
                                    "a transformers one, or a module declaring ATTENTION_BACKENDS); key a "
                                    "transformer or its blocks")
                if procs:
                    backend, label = resolve_backend(name, ctx.profile)
                    set_processors(procs, backend, undo_list)
                for layer in layers:
                    label = set_engine_layer(layer, name, ctx.profile, key, undo_list) or label
                if hf_layers:  # resolved once for the region's layers
                    impl, label = transformers_backend(name, ctx.profile, key, is_auto, type(hf_layers[0]).__name__)
                    for layer in hf_layers:
                        set_transformers_layer(layer, impl, undo_list)
                n += len(procs) + len(layers) + len(hf_layers)
            done.append(f"{label} on {key or '<root>'} ({n} attention layers{note})")
    except BaseException:  # a refusal part-way leaves nothing set
        undo()
        raise
    did = "; ".join(done) if done else "library default (no attention section)"
    return StepRecord("attention", did, undo, {"backends": done})
