"""`precision_step`: run a region's linears (and its fa3 attention) in fp8, and install the
kernel fusions its plan asks for.

With ``matmul = "fp8"`` every eligible `nn.Linear` becomes an `Fp8Linear` (`fp8_linear`;
``keep_bf16`` patterns keep some, ``fuse_gelu`` folds a FeedForward's GELU into the down
projection's input quantization); with ``attention = "fp8"`` the fa3 layers switch to fp8 FA3
(`fp8_attention`); ``gelu_epilogue``, ``fuse_norm_rope`` and ``fuse_norm_act`` install the
fusions of `fusions`.

The step runs before compile (the graphs must contain the fp8 ops) and its undo puts the
original linears back. To restore them exactly the originals are kept -- on the host, so
the device holds only the fp8 copies (half the bytes of bf16) -- unless the apply says not to
(`ctx.keep_originals` False: a model built in host memory to stream, where bf16 originals beside
the fp8 copies and a text encoder outgrow the host: FLUX.2-dev's 64 GB + 32 GB + 48 GB on a
128 GiB machine). Then the originals are dropped and the undo leaves the fp8 linears, which a
later apply adopts as it adopts an fp8 checkpoint's.
"""

from __future__ import annotations

import fnmatch

import torch.nn as nn

from ..steps import StepContext, StepRecord
from .fp8_attention import switch_to_fp8, undo_fp8
from .fp8_linear import Fp8Linear, eligible, fuse_feedforward_gelu, unfuse_feedforward_gelu
from .fusions import fuse_norm_activations, gelu_epilogues, mark_norm_rope, undo_fusions


def precision_step(ctx: StepContext) -> StepRecord:
    section = ctx.plan.section("precision")
    swaps: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, attribute, original on the host or None)
    adopted: list[tuple[Fp8Linear, bool, bool]] = []  # (an Fp8Linear as loaded, its fast_accum, its fuse_gelu)
    backends: list[tuple[object, object]] = []  # (attention processor, its backend before)
    fusions: list[tuple[nn.ModuleList, nn.Module, Fp8Linear]] = []  # (FeedForward.net, its GELU, down proj)
    epilogues: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, name, GELU module or None: a mark)
    norm_acts: list[tuple[nn.Module, str, nn.Module | None]] = []  # (parent, name, activation or None: a forward)
    done, skipped = [], 0

    def undo() -> None:
        for lin, fast, fuse in reversed(adopted):
            lin.fast_accum, lin.fuse_gelu = fast, fuse
        undo_fusions(norm_acts)
        undo_fusions(epilogues)
        unfuse_feedforward_gelu(fusions)
        undo_fp8(backends)
        for parent, name, original in reversed(swaps):
            if original is None:  # released (keep_originals False): the fp8 linear stays
                continue
            device = next(getattr(parent, name).buffers()).device
            setattr(parent, name, original.to(device))

    try:
        for (key, _), targets in section.regions().items():
            spec = targets[0].spec
            if "fp8" in (spec.matmul, spec.attention) and not ctx.profile.fp8:
                raise ValueError(f"precision key {key!r}: fp8 needs a card with fp8 matmuls (Hopper, "
                                 f"Ada, Blackwell); profile {ctx.profile.name!r} has none. Use 'bf16' "
                                 "(drop precision='fp8' / --fp8)")
            if spec.attention == "fp8":
                done.append(switch_to_fp8(key, targets, ctx.profile, backends))
            if spec.matmul == "fp8":
                skipped += _fp8_matmuls(key, spec, targets, swaps, fusions, done, adopted, ctx.keep_originals)
            if spec.gelu_epilogue:
                counts = [gelu_epilogues(t.module, epilogues) for t in targets]
                swapped, marked = sum(c[0] for c in counts), sum(c[1] for c in counts)
                if swapped or marked:
                    done.append(f"GELU in the GEMM epilogue on {key or '<root>'} ("
                                + ", ".join(([f"{swapped} GELU module(s)"] if swapped else [])
                                            + ([f"{marked} nn.GELU marked, fused where the adapter's forward reads it"] if marked else []))
                                + ")")
            if spec.fuse_norm_rope:
                marked = sum(mark_norm_rope(t.module, epilogues) for t in targets)
                if marked:
                    done.append(f"q/k RMSNorm + RoPE in one pass on {key or '<root>'} ({marked} attention layer(s) "
                                "whose processor fuses them)")
            if spec.fuse_norm_act:
                fused = sum(fuse_norm_activations(t.module, norm_acts) for t in targets)
                if fused:
                    done.append(f"channel RMSNorm + SiLU in one pass on {key or '<root>'} ({fused} norm(s))")
    except BaseException:
        undo()
        raise
    did = "; ".join(done) if done else "as built (no fp8 region)"
    if skipped:
        did += f"; {skipped} linear(s) kept (dims not multiples of 16)"
    released = sum(original is None for _, _, original in swaps)
    if released:
        did += (f"; the {released} bf16 originals were released, not kept on the host (keep_originals=False: "
                "load's choice for a model built there to stream): remove() leaves these fp8 linears in place")
    return StepRecord("precision", did, undo, {"fp8_linears": len(swaps), "skipped": skipped,
                                               "fp8_attention_layers": len(backends),
                                               "gelu_epilogues": sum(a is not None for _, _, a in epilogues),
                                               "norm_act_fusions": sum(name == "forward" for _, name, _ in norm_acts)})


def _fp8_matmuls(key: str, spec, targets, swaps: list, fusions: list, done: list, adopted: list,
                 keep_originals: bool = True) -> int:
    """Swap the region's eligible linears for `Fp8Linear`s (keep_bf16 honoured) and fuse the
    FeedForward GELUs (fuse_gelu). Linears already fp8 (an fp8 checkpoint's, loaded as
    `Fp8Linear`) take the spec's fast_accum and fuse_gelu, as a swapped one would. Appends to
    `swaps`/`fusions`/`adopted` (the caller's undo) and the report line to `done`; returns how
    many linears were kept for their dims. keep_originals False: a swap records None for its
    original, which is dropped here rather than copied to the host."""
    skipped = 0  # (the caller refused fp8 on a profile without it)
    adopted_before = len(adopted)
    n, kept = 0, 0
    seen: set[int] = set()
    used = {pat: False for pat in spec.keep_bf16}
    for t in targets:
        for parent_path, parent in list(t.module.named_modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Fp8Linear) and id(child) not in seen:
                    seen.add(id(child))
                    adopted.append((child, child.fast_accum, child.fuse_gelu))
                    child.fast_accum, child.fuse_gelu = spec.fast_accum, spec.fuse_gelu
                    continue
                if id(child) in seen or not isinstance(child, nn.Linear):
                    continue
                seen.add(id(child))
                path = f"{parent_path}.{name}" if parent_path else name
                hits = [pat for pat in spec.keep_bf16 if fnmatch.fnmatchcase(path, pat)]
                if hits:
                    used.update(dict.fromkeys(hits, True))
                    kept += 1
                    continue
                if not eligible(child):
                    skipped += 1
                    continue
                fp8 = Fp8Linear(child, fast_accum=spec.fast_accum)
                fp8.fuse_gelu = spec.fuse_gelu  # may take its input in parts (an adapter's forward)
                swaps.append((parent, name, child.to("cpu") if keep_originals else None))
                setattr(parent, name, fp8)
                n += 1
    fused = sum(fuse_feedforward_gelu(t.module, fusions) for t in targets) if spec.fuse_gelu else 0
    unused = [pat for pat, hit in used.items() if not hit]
    if unused:
        linears = sorted(p for p, m in targets[0].module.named_modules() if isinstance(m, (nn.Linear, Fp8Linear)))
        raise ValueError(f"precision key {key!r}: keep_bf16 pattern(s) {unused} match no linear under "
                         f"{targets[0].cls_name}; its linears: {', '.join(linears)}")
    loaded = len(adopted) - adopted_before
    done.append(f"fp8 matmuls on {key or '<root>'} ({n} linears"
                + (f", {loaded} already fp8 from the checkpoint" if loaded else "")
                + (f", {kept} kept bf16 by keep_bf16" if kept else "")
                + (", fast accumulation" if spec.fast_accum else "")
                + (f", {fused} FeedForward GELU(s) quantized in one pass" if fused else "") + ")")
    return skipped
