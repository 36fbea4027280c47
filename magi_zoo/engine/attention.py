"""The attention step: set the attention backend of every attention layer under a region.

Works on diffusers models, whose attention layers hold a processor that dispatches through
`diffusers.models.attention_dispatch` by the processor's `_attention_backend` (what
`ModelMixin.set_attention_backend` sets model-wide); here it is set per region. A region
whose subtree has no such layer is an error, never a silent no-op. Undo restores every
processor's previous backend.
"""

from __future__ import annotations

import difflib

import torch.nn as nn

from .resolve import PlanError
from .steps import StepContext, StepRecord, register_step


def _processors(module: nn.Module) -> list:
    """The attention processors under `module` that carry a dispatch backend."""
    out = []
    for m in module.modules():
        proc = getattr(m, "processor", None)
        if proc is not None and hasattr(proc, "_attention_backend") and all(p is not proc for p in out):
            out.append(proc)
    return out


def _backend(name: str):
    """Validate a backend name against diffusers' registry (did-you-mean on a typo)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    valid = [b.value for b in AttentionBackendName]
    if name.lower() not in valid:
        close = difflib.get_close_matches(name.lower(), valid, n=1)
        hint = f" -- did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"attention backend {name!r} is not a diffusers backend{hint}; valid: {', '.join(valid)}")
    backend = AttentionBackendName(name.lower())
    try:  # raises with the package to install when a backend's kernels are missing
        from diffusers.models.attention_dispatch import _check_attention_backend_requirements
    except ImportError:  # pragma: no cover - other diffusers versions
        return backend
    _check_attention_backend_requirements(backend)
    return backend


@register_step("attention")
def attention_step(ctx: StepContext) -> StepRecord:
    section = ctx.plan.section("attention")
    undo_list: list[tuple[object, object]] = []
    done = []
    for (key, _), targets in section.regions().items():
        name = targets[0].spec.backend
        if name is None:
            continue
        if name == "auto":
            name = ctx.profile.attention_backend
        backend = _backend(name)
        n = 0
        for t in targets:
            procs = _processors(t.module)
            if not procs:
                raise PlanError(f"attention key {key!r}: {t.cls_name} at {t.path or '<root>'!r} has no "
                                "diffusers attention layer under it; attention backends apply to diffusers "
                                "models (key a transformer or its blocks)")
            for p in procs:
                undo_list.append((p, p._attention_backend))
                p._attention_backend = backend
            n += len(procs)
        done.append(f"{backend.value} on {key or '<root>'} ({n} attention layers)")

    def undo() -> None:
        for proc, prior in reversed(undo_list):
            proc._attention_backend = prior

    did = "; ".join(done) if done else "library default (no attention section)"
    return StepRecord("attention", did, undo, {"backends": done})
