"""The memory_format step: put the convolution weights of the plan's modules in
channels-last layout, with an exact undo.

For every target with ``channels_last = true`` each `nn.Conv2d` / `nn.Conv3d` under it
(diffusers' causal 3-D convolutions subclass `nn.Conv3d`) gets its weight re-laid out in
place (`Tensor.contiguous(memory_format=...)`: same values, new strides); the parameter
object stays the same, so optimizers, hooks and offload see the tensor they knew. A weight
that is not in torch's standard layout to begin with is left alone and counted, because
the undo puts weights back in the standard layout and could not restore another.

Why before compile and offload (`apply.STEP_ORDER`): inductor specialises on the strides of
the weights it traces, and offload moves a resident unit's weights with `Tensor.to`, which
keeps their layout. A *streamed* unit's weights are views of its flat card buffer in the
standard layout (the values copied right), so streaming keeps the outputs, not the gain.
Saving a checkpoint needs standard-layout tensors (safetensors refuses others):
`magi_zoo.checkpoints` writes them in that layout and puts them back.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..resolve import PlanError
from ..steps import StepContext, StepRecord

_LAYOUTS = {4: torch.channels_last, 5: torch.channels_last_3d}  # weight rank -> channels-last format


def convolutions(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The Conv2d / Conv3d layers under `module` (itself included), by path below it."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]


def memory_format_step(ctx: StepContext) -> StepRecord:
    """Re-lay out the convolution weights of every channels_last target; undo restores the
    standard layout of exactly those weights."""
    targets = [t for t in ctx.plan.section("memory_format").targets if t.spec.channels_last]
    if not targets:
        return StepRecord("memory_format", "none requested")
    chosen: list[tuple[str, list[tuple[str, nn.Module]]]] = []  # (target path, its convolutions)
    for t in targets:  # every refusal before any weight changes
        convs = convolutions(t.module)
        label = t.path or "<root>"
        if not convs:
            if "user" in t.layers:
                raise PlanError(f"memory_format key {t.key!r}: {t.cls_name} at {label!r} holds no Conv2d / Conv3d, "
                                "so channels_last changes nothing there; name a module with convolutions (a VAE) "
                                "or drop the entry")
            continue  # the shipped spec's key on a variant without convolutions there: nothing to do
        chosen.append((t.path, convs))
    converted: dict[int, nn.Parameter] = {}  # id -> weight, so nested targets convert a layer once
    per_target: dict[str, int] = {}
    left: list[str] = []
    paths: set[str] = set()  # the converted convolutions, by path from the root
    for root_path, convs in chosen:
        label = root_path or "<root>"
        n = 0
        for name, conv in convs:
            w = conv.weight
            if id(w) in converted:
                continue
            if not w.is_contiguous():  # another layout than torch's standard: the undo could not restore it
                left.append(f"{label}.{name}" if name else label)
                continue
            with torch.no_grad():
                w.data = w.data.contiguous(memory_format=_LAYOUTS[w.dim()])
            converted[id(w)] = w
            paths.add(".".join(p for p in (root_path, name) if p))
            n += 1
        per_target[label] = n

    ctx.channels_last = frozenset(paths)

    def undo() -> None:
        with torch.no_grad():
            for w in converted.values():
                w.data = w.data.contiguous()

    did = ("channels-last convolution weights: " + ", ".join(f"{p} ({n})" for p, n in per_target.items())
           if per_target else "none (no convolution under the plan's keys)")
    if left:
        did += f"; {len(left)} weight(s) in another layout left as loaded (e.g. {left[0]})"
    return StepRecord("memory_format", did, undo,
                      {"converted": per_target, **({"left_as_loaded": left} if left else {})})
