"""The benchmark harness: one entry-point call of any zoo model under several strategies.

    python -m benchmarks.run --model wan2.1-t2v-1.3b \
        --strategies eager,torch_compile,diffusers_regional,magi_zoo \
        --height 480 --width 832 --frames 81 --device cuda
    python -m benchmarks.run --model bagel-7b-mot --strategies eager,magi_zoo --shape text_len=32 \
        --fp32-reference --no-warm-start --device cuda
    python -m benchmarks.run --model qwen3-omni-30b-a3b --entry decode_step --layers 4 \
        --strategies eager,magi_zoo --no-warm-start --device cuda
    python -m benchmarks.run --model wan2.1-tiny --strategies eager,torch_compile,magi_zoo \
        --device cpu --out /tmp/bench

What is timed is an entry point of the adapter contract (magi_zoo/adapters/base.py):
`module, method = adapter.entry(pipe, --entry)` (default: the family's first entry point:
a diffusion family's denoiser step "denoise", Qwen3-Omni's "prefill"), called as
`getattr(module, method)(**adapter.example_inputs(pipe, variant, entry, **shape))`, where
shape is --height / --width / --frames (default: the variant's call defaults, where it has
them) plus family-specific `--shape key=value` pairs passed through as keyword arguments
(BAGEL: text_len, cfg_img_scale; Qwen3-Omni: seq_len, ctx_len, batch). Each process builds
the inputs once and every call reuses them, as a generation reuses its KV cache: a decode
step writes its token into the static cache at the next slot, which its mask leaves out, so
repeated calls return the same values (the cache has room for the variant's default
`max_new_tokens` calls past ctx_len: keep warm-up + runs below that). FLOPs and the fp32
reference run on their own fresh inputs.

Setup: random weights at the published config (`weights="random"`), bf16 on GPU (fp32 on
CPU), batch 1 unless `--shape batch=N`. Strategies are the real thing:

- eager:              the entry as the library builds it. Where the entry's method is one
                      an adapter preparation adds (Qwen3-Omni's prefill / decode_step), the
                      adapter's preparations are installed (they keep values unchanged);
                      otherwise the model is untouched;
- torch_compile:      `torch.compile(module)` for a `forward` entry, `torch.compile` of the
                      bound method otherwise (compiling the module would leave the method eager);
- diffusers_regional: `module.compile_repeated_blocks(fullgraph=True)` (diffusers' own):
                      only a diffusers model's forward with `_repeated_blocks`; for any other
                      entry (BAGEL, Qwen3-Omni) it is refused before any process starts, and
                      the refusal is recorded (status "refused", with the reason);
- diffusers_regional_fa3 / diffusers_regional_fa3_varlen / diffusers_fp8: diffusers' regional
                      compile with the same FA3 kernel as attention (varlen: diffusers' FA3
                      backend for key-padding masks), and with torchao's float8 per-row linears
                      + per-tensor fp8 FA3 on top: the baselines a diligent user composes on Hopper
                      (benchmarks/baselines.py says exactly what each does); refused with the
                      reason where their pieces cannot run;
- magi_zoo:           `magi_zoo.load(model, weights="random", gpu=<card>)` with its shipped
                      spec, timed on the same entry;
- magi_zoo_fp8:       the same with `precision="fp8"` (fp8 linears in the regions the spec
                      declares, and fp8 attention where those regions run fa3; cards with
                      fp8 matmuls only);
- magi_zoo_fp8_matmul: fp8 linears only (attention as the spec sets it): splits the fp8
                      gain between matmuls and attention;
- magi_zoo_sdpa:      the shipped spec with every attention region it names put back on
                      torch SDPA (`backend="native"`): what the spec's attention choice buys.
- magi_zoo_fa3:       the shipped spec with every attention region it names on `fa3` (e.g.
                      BAGEL's MoT attention, which ships on SDPA): what FA3 would buy; a spec
                      with no attention section (Flux.1's) gets `fa3` on the regions its
                      precision section names, the denoiser's repeated blocks.
- magi_zoo[_fp8]_multikernel / magi_zoo[_fp8]_persistent: magi_zoo / magi_zoo_fp8 with
                      inductor's multi-kernel reductions in the repeated blocks' compile regions
                      (a row wider than 1,024 gets a persistent kernel beside the looped one, the
                      faster picked at the first call), or the persistent kind forced: what the
                      LayerNorm + modulation and quantization reductions would gain
                      (benchmarks/norm_reductions.py times the same kinds per kernel);
- magi_zoo_lora / magi_zoo_fp8_lora: magi_zoo / magi_zoo_fp8 with a LoRA fused at load
                      (`load(..., lora=[file])`): a rank-64 LoRA on every linear of the
                      repeated blocks, written by the harness in diffusers' peft layout with
                      random values (`common.write_block_lora`); same graphs and shapes as the
                      base row, so its time and counters say what fusing costs (nothing, if
                      the merge is whole). Its error columns compare a changed model with
                      eager's base, so they measure the LoRA, not the engine.

`--backend B` puts every compiled region on backend B (magi_zoo: `specs.with_backend` over
the spec's layers; torch_compile / diffusers_regional: torch.compile's `backend=`), e.g.
eager / aot_eager for CPU smoke runs. `--layers N` builds the variant with N layers where the
harness knows how for that family (LAYER_VARIANTS; today Qwen3-Omni: the published layer
config with N thinker layers and no talker / Code2Wav; spec keys for the parts the build
lacks are dropped and listed). `--smoke` allows fewer warm-up / timed runs than docs/methodology.md
asks, for tests; the record says so.

Each strategy runs in its own process with fresh inductor and Triton cache directories, so
cold compile times and memory peaks are honest. A second process then measures the
warm-start first call: for magi_zoo, again with *fresh* inductor/Triton dirs, so only its
own artifact cache (`cache_dir`) carries compiled code over; for torch_compile and
diffusers_regional, with the inductor/Triton dirs of their cold run (torch's own on-disk
caches are their warm start). Per strategy: cold and warm first-call seconds; ms per call
(CUDA events, >= 2 warm-up, >= 5 timed: median, min, max); for a decode-step entry, tokens/s
= batch x 1000 / ms; peak GiB over the timed runs; relative error (and max abs difference)
against eager on the same inputs; FLOPs of one call from torch's flop counter, achieved
TFLOP/s and % of the matmul rate measured on the same card in the same run; compiled frames,
graph breaks, recompiles (magi_zoo.engine.counters). `--cfg` adds seconds per denoising step
with classifier-free guidance (two forwards, as the diffusers pipelines run cond and uncond;
BAGEL's denoise entry already is a whole CFG step). Output: JSON, a markdown table (with
magi_zoo's region table) and a PNG chart under --out. A strategy that fails is recorded with
its error.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import statistics
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

from benchmarks import baselines, common

STRATEGIES = ("eager", "torch_compile", "diffusers_regional", *baselines.BASELINES, "magi_zoo", "magi_zoo_fp8", "magi_zoo_fp8_matmul",
              "magi_zoo_sdpa", "magi_zoo_fa3", "magi_zoo_graphs", "magi_zoo_fp8_graphs", "magi_zoo_nographs",
              "magi_zoo_fp8_nographs", "magi_zoo_unfused", "magi_zoo_multikernel", "magi_zoo_fp8_multikernel",
              "magi_zoo_persistent", "magi_zoo_fp8_persistent", "magi_zoo_lora", "magi_zoo_fp8_lora")
ZOO_STRATEGIES = ("magi_zoo", "magi_zoo_fp8", "magi_zoo_fp8_matmul", "magi_zoo_sdpa", "magi_zoo_fa3",
                  "magi_zoo_graphs", "magi_zoo_fp8_graphs", "magi_zoo_nographs", "magi_zoo_fp8_nographs",
                  "magi_zoo_unfused", "magi_zoo_multikernel", "magi_zoo_fp8_multikernel", "magi_zoo_persistent",
                  "magi_zoo_fp8_persistent", "magi_zoo_lora", "magi_zoo_fp8_lora")  # load(), shipped spec + one change
LORA_RANK = 64  # the rank of LightX2V's published distill LoRAs (e.g. ..._lora_rank64.safetensors)
# Row suffix: inductor's `triton.multi_kernel` mode in the repeated blocks. 1: each reduction wider
# than inductor's persistent limit (1,024) is compiled both looped and persistent, and the faster
# is picked by timing at the first call; 2: the persistent kind always.
REDUCTION_KINDS = {"_multikernel": 1, "_persistent": 2}


def _zoo_kwargs(strategy: str, adapter, gpu: str) -> dict[str, Any]:
    """The one change a magi_zoo_* strategy makes to `magi_zoo.load` (a `_lora` strategy's
    LoRA file is added by `_build`, which has the run's scratch folder)."""
    if strategy.endswith("_lora"):
        return _zoo_kwargs(strategy[: -len("_lora")], adapter, gpu)
    for suffix, on in (("_nographs", False), ("_graphs", True)):  # the denoiser's forward in CUDA graphs, or not
        if strategy.endswith(suffix):
            from magi_zoo.adapters.diffusers_pipeline import DiffusersPipelineAdapter

            if not isinstance(adapter, DiffusersPipelineAdapter):
                raise TypeError(f"{strategy}: times a diffusers denoiser's forward; {adapter.family} has none "
                                "(key its step method in a cuda_graphs override instead)")
            base = _zoo_kwargs(strategy[: -len(suffix)], adapter, gpu)
            return {**base, "overrides": {"cuda_graphs": {"transformer": on}}}
    for suffix, mode in REDUCTION_KINDS.items():  # inductor's multi-kernel reductions in the blocks
        if strategy.endswith(suffix):
            return _with_multi_kernel(_zoo_kwargs(strategy[: -len(suffix)], adapter, gpu), adapter, gpu, mode)
    if strategy == "magi_zoo_fp8":  # fp8 matmuls and fp8 attention (where attention runs on fa3)
        return {"precision": "fp8"}
    if strategy == "magi_zoo_fp8_matmul":  # fp8 matmuls only, attention as the spec sets it
        keys = common.fp8_keys(adapter, gpu)
        return {"overrides": {"precision": {k: {"matmul": "fp8", "attention": "bf16"} for k in keys}}}
    if strategy == "magi_zoo_unfused":  # the precision section's kernel fusions off (GELU epilogue, norm + rope)
        return {"overrides": {"precision": common.fusions_off(adapter, gpu)}}
    if strategy in ("magi_zoo_sdpa", "magi_zoo_fa3"):
        keys = common.spec_keys(adapter, gpu, "attention")
        if not keys and strategy == "magi_zoo_fa3":
            # no attention section: the library default everywhere; FA3 then goes on the regions
            # the precision section names for fp8 (the denoiser's repeated blocks: every attention
            # layer under them)
            keys = common.fp8_keys(adapter, gpu)
        if not keys:
            raise TypeError(f"{strategy}: the spec sets no attention backend here, so it equals magi_zoo")
        return {"overrides": {"attention": {k: "native" if strategy == "magi_zoo_sdpa" else "fa3" for k in keys}}}
    return {}


def _with_multi_kernel(kwargs: dict[str, Any], adapter, gpu: str, mode: int) -> dict[str, Any]:
    """`kwargs` with `triton.multi_kernel=mode` (REDUCTION_KINDS) in the compile regions of the
    denoiser's repeated blocks (the compile keys the precision section also names). The
    whole-model side of `benchmarks/norm_reductions.py`; the spec's other compile fields stay."""
    keys = sorted(set(common.fp8_keys(adapter, gpu)) & common.spec_keys(adapter, gpu, "compile"))
    if not keys:
        raise TypeError(f"{adapter.family}: the spec compiles no repeated-block region here to give "
                        "multi-kernel reductions")
    overrides = {**kwargs.get("overrides", {}),
                 "compile": {k: {"options": {"triton.multi_kernel": mode}} for k in keys}}
    return {**kwargs, "overrides": overrides}


DECODE_ENTRIES = ("decode_step",)  # one generated token per call: reported as tokens/s too


# -- --layers: variants with fewer layers, per family ------------------------------------------

def _qwen3_omni_layers(variant, n: int):
    """The variant's layer config with `n` thinker text layers and no talker / Code2Wav
    (the published 30B-A3B is ~60 GiB in bf16 and slow to initialise; per-token decode
    cost scales ~linearly in layers)."""
    from magi_zoo.adapters.qwen3_omni.configs import with_thinker_layers

    total = variant.config["thinker"]["text_config"]["num_hidden_layers"]
    if not 1 <= n <= total:
        raise SystemExit(f"--layers {n}: {variant.name} has {total} thinker layers; choose 1..{total}")
    # Its own name, so the compile cache never mixes it up with the registered variant.
    derived = dataclasses.replace(variant, name=f"{variant.name}-{n}L",
                                  config=with_thinker_layers(variant.config, n, talker=False))
    note = (f"{variant.name} layer config with {n} of {total} thinker layers, no talker/code2wav, random "
            "weights: per-token decode time scales ~linearly with layers")
    return derived, note


# Where each family keeps its denoiser's depth: (component, key) pairs, in the variant config.
# Text encoders are cut to one layer too: the timed entries (the denoiser step) never run them,
# and a published T5-XXL (4.7B parameters) would dominate the build of a reduced-depth model.
DEPTH_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "wan": (("transformer", "num_layers"),),
    "self-forcing": (("transformer", "num_layers"),),
    "flux": (("transformer", "num_layers"), ("transformer", "num_single_layers")),
    "bagel": (("llm", "num_hidden_layers"),),
    "qwen_image": (("transformer", "num_layers"),),
    "flux2": (("transformer", "num_layers"), ("transformer", "num_single_layers")),
    "hunyuanvideo15": (("transformer", "num_layers"),),
    "ltx2": (("transformer", "num_layers"),),
    # z_image: the 30 main blocks (the 2 + 2 refiner blocks stay: they are other regions)
    "z_image": (("transformer", "n_layers"),),
}
ENCODER_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "wan": (("text_encoder", "num_layers"),), "self-forcing": (("text_encoder", "num_layers"),),
    "flux": (("t5", "num_layers"), ("clip", "num_hidden_layers")),
    "bagel": (("vit", "num_hidden_layers"),),
    "qwen_image": (("text", "num_hidden_layers"), ("vision", "depth")),
    "flux2": (("text", "num_hidden_layers"), ("vision", "num_hidden_layers")),
    "hunyuanvideo15": (("text_encoder", "num_hidden_layers"), ("text_encoder_2", "num_layers")),
    # ltx2: Gemma-3-12B (22.7 GiB in bf16, more than a 24 GiB host holds beside the rest) and its
    # vision tower; the connectors read all of Gemma's hidden states, so their input width follows
    # (ENCODER_TIES)
    "ltx2": (("text_encoder", "num_hidden_layers"), ("vision", "num_hidden_layers")),
    "z_image": (("text", "num_hidden_layers"),),
}
# Config values that must follow an encoder's depth: (component, key) -> f(config) after the cut.
ENCODER_TIES: dict[str, dict[tuple[str, str], Callable[[dict], int]]] = {
    # LTX2TextConnectors project Gemma's stacked hidden states: one per layer plus the embeddings
    "ltx2": {("connectors", "text_proj_in_factor"): lambda c: c["text_encoder"]["num_hidden_layers"] + 1},
}


def _one_layer_encoders(family: str, config: dict) -> None:
    """Set each text / vision encoder the variant has to one layer (a family's variants differ:
    FLUX.2 klein has no vision tower, dev has one)."""
    for component, key in ENCODER_KEYS.get(family, ()):
        if component in config:
            config[component][key] = 1
    for (component, key), follow in ENCODER_TIES.get(family, {}).items():
        config[component][key] = follow(config)


def _denoiser_layers(variant, n: int | None):
    """The variant's published config with `n` repeated layers in each of the denoiser's block
    stacks (None: the published depth; widths, heads and every other constant unchanged) and
    one-layer text encoders: the real per-layer code path and shapes at a fraction of the build."""
    family = variant.family
    config = {k: dict(v) if isinstance(v, dict) else v for k, v in variant.config.items()}
    if n is None:
        _one_layer_encoders(family, config)
        derived = dataclasses.replace(variant, name=f"{variant.name}-1Lenc", config=config)
        return derived, (f"{variant.name} published config with one-layer encoders (the timed denoiser entry "
                         "never runs them), random weights")
    totals = []
    for component, key in DEPTH_KEYS[family]:
        total = config[component][key]
        if not 1 <= n <= total:
            raise SystemExit(f"--layers {n}: {variant.name} has {total} {component}.{key}; choose 1..{total}")
        totals.append(f"{component}.{key} {n} of {total}")
        config[component][key] = n
    _one_layer_encoders(family, config)
    derived = dataclasses.replace(variant, name=f"{variant.name}-{n}L", config=config)
    note = (f"{variant.name} published config with {', '.join(totals)} and one-layer encoders, random weights: "
            "per-forward time scales ~linearly with layers")
    return derived, note


# family -> (registered variant, N) -> (derived Variant, one-line note for the results).
LAYER_VARIANTS: dict[str, Callable] = {"qwen3_omni": _qwen3_omni_layers,
                                       **dict.fromkeys(DEPTH_KEYS, _denoiser_layers)}


def _variant(args):
    """(adapter, variant, note): the registered variant, or the one --layers derives."""
    from magi_zoo import adapters

    adapter, variant = adapters.lookup(args.model)
    if args.one_layer_encoders:
        if args.layers is not None or adapter.family not in DEPTH_KEYS:
            raise SystemExit(f"--one-layer-encoders: families {', '.join(DEPTH_KEYS)}, without --layers "
                             "(--layers already cuts the encoders)")
        return (adapter, *_denoiser_layers(variant, None))
    if args.layers is None:
        return adapter, variant, None
    derive = LAYER_VARIANTS.get(adapter.family)
    if derive is None:
        raise SystemExit(f"--layers: the harness cannot derive a layer count for family {adapter.family!r} "
                         f"(supported: {', '.join(LAYER_VARIANTS)})")
    return (adapter, *derive(variant, args.layers))


def _shape(args) -> dict[str, Any]:
    """The shape keyword arguments of `example_inputs`: the flags that are set, then --shape."""
    shape = {k: getattr(args, k) for k in ("height", "width", "frames") if getattr(args, k) is not None}
    for pair in args.shape:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SystemExit(f"--shape {pair!r}: expected key=value (e.g. --shape text_len=32)")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a plain string
        shape[key.strip()] = value
    return shape


# -- building a handle -------------------------------------------------------------------------

def _assemble(adapter, variant, *, gpu: str, dtype, device, compiled: bool, backend: str | None,
              cache_dir: str | None, derived: bool, overrides=None, precision: str | None = None, lora=None):
    """What `magi_zoo.load` returns, for the two inputs load cannot be given: a derived
    Variant (--layers; load takes a registered name, and the base `build` has no config=)
    and compile layers with every backend overridden (--backend; `specs.with_backend` works
    on layers, load takes override dicts). Rather than widen load's signature for a
    benchmark (zoo.py stays the one loader for users), this assembles the handle from the
    same public pieces in the same order -- spec layers -> LoRA check -> adapter.build -> LoRA
    fused -> engine.apply -> compile cache -> ZooPipeline -- so the harness measures what load
    would build.

    For a derived variant, spec keys that match nothing in the smaller build (Qwen3-Omni's
    talker / code2wav keys, with no talker built) are dropped and returned; the engine's own
    `preview` decides, key by key, with the adapter's preparations installed."""
    import torch.nn as nn

    from magi_zoo.adapters import lora as lora_loader
    from magi_zoo.engine import apply
    from magi_zoo.engine.compile.cache import CompileCache, resolve_cache_dir
    from magi_zoo.specs import get_profile, with_backend
    from magi_zoo.overrides import spec_layers
    from magi_zoo.zoo import ZooPipeline

    profile = get_profile(gpu)
    # a strategy's one change, as load takes it
    layers = spec_layers(adapter, profile, overrides=overrides, precision=precision)
    if backend:
        layers = with_backend(layers, backend)
    loras = lora_loader.lora_specs(lora or [])
    lora_states = lora_loader.check_for(adapter, variant, loras, dtype)
    native = adapter.build(variant, weights="random", dtype=dtype, device=device)
    lora_state = lora_loader.attach(native, loras, lora_states, hotswap=False) if loras else None
    modules = nn.ModuleDict(adapter.components(native))
    dropped: list[str] = []
    if derived and compiled:
        layers, dropped = _drop_unmatched(modules, layers, adapter.preparations(native))
    report = apply(modules, layers=layers, gpu=profile, preparations=adapter.preparations(native)) if compiled else None
    cache = None
    directory = resolve_cache_dir(cache_dir)
    if report is not None and directory is not None:
        cache = CompileCache(directory, {"model": f"{adapter.family}/{variant.name}", "dtype": str(dtype),
                                         "device": device.type, "gpu_profile": profile.name,
                                         "plan": report.plan.digests()})
        cache.load()
    if report is not None and lora_state is not None:
        report.notes[:] = lora_state.lines()
    handle = ZooPipeline(native, modules, report, adapter=adapter, variant=variant, profile=profile, dtype=dtype,
                         device=device, layers=layers, cache=cache)
    handle.lora = lora_state
    return handle, dropped


def _drop_unmatched(modules, layers, preparations) -> tuple[list, list[str]]:
    """`layers` without the keys that resolve to nothing in `modules` (each key tried alone
    through `magi_zoo.engine.preview`, which raises PlanError for a key or method that
    matches nothing), and the dropped keys."""
    from magi_zoo.engine import PlanError, preview
    from magi_zoo.specs import PlanLayer

    out, dropped = [], []
    for name, layer in layers:
        sections = {}
        for section, entries in layer.sections.items():
            sections[section] = {}
            for key, entry in entries.items():
                try:
                    preview(modules, [(name, PlanLayer(sections={section: {key: entry}}))], preparations)
                    sections[section][key] = entry
                except PlanError:
                    dropped.append(key)
        out.append((name, PlanLayer(sections=sections)))
    return out, sorted(set(dropped))


def _regional_refusal(adapter, entry: str, module, method: str, strategy: str = "diffusers_regional") -> str | None:
    """Why `strategy` (diffusers' regional compile, alone or under a baseline) cannot apply to
    this entry (None: it can)."""
    if method == "forward" and callable(getattr(module, "compile_repeated_blocks", None)) \
            and getattr(module, "_repeated_blocks", None):
        return None
    return (f"{strategy} needs a diffusers model's forward with _repeated_blocks "
            f"(compile_repeated_blocks); {adapter.family} entry {entry!r} is "
            f"{type(module).__name__}.{method}, which is not one")


# -- worker (one strategy, one process) ------------------------------------------------------

def _progress(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def _build(args, strategy: str):
    import torch

    import magi_zoo
    from magi_zoo.engine.prepare import prepare

    adapter, variant, _ = _variant(args)
    device = torch.device(args.device)
    gpu = "cpu" if device.type == "cpu" else "auto"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = strategy in ZOO_STRATEGIES
    cache_dir = args.zoo_cache if compiled else None
    dropped: list[str] = []
    extra = _zoo_kwargs(strategy, adapter, gpu) if compiled else {}
    if strategy.endswith("_lora"):
        path = Path(args.tmp) / f"{strategy}.safetensors"
        _progress(f"{strategy}: writing a rank-{LORA_RANK} LoRA over the repeated blocks' linears ...")
        common.write_block_lora(adapter, variant, path, rank=LORA_RANK)
        extra["lora"] = [str(path)]
    if args.layers is None and not args.one_layer_encoders and not (compiled and args.backend):
        handle = magi_zoo.load(args.model, gpu=gpu, weights="random", dtype=dtype, device=device,
                               compile=None if compiled else False, cache_dir=cache_dir, **extra)
    else:
        if set(extra) - {"overrides", "precision", "lora"}:
            raise TypeError(f"{strategy} does not combine with --layers / --backend")
        handle, dropped = _assemble(adapter, variant, gpu=gpu, dtype=dtype, device=device, compiled=compiled,
                                    backend=args.backend, cache_dir=cache_dir, derived=args.layers is not None or args.one_layer_encoders,
                                    overrides=extra.get("overrides"), precision=extra.get("precision"),
                                    lora=extra.get("lora"))
    module, method = adapter.entry(handle.pipe, args.entry)
    if not compiled and not callable(getattr(module, method, None)):
        # The method is one a preparation adds (apply installs them for magi_zoo).
        prepare(handle.modules, adapter.preparations(handle.pipe))
    make_inputs = lambda: adapter.example_inputs(handle.pipe, handle.variant, args.entry, **_shape(args))  # noqa: E731
    return handle, module, method, make_inputs, device, dtype, dropped


def count_flops(call) -> tuple[int | None, str | None]:
    """(FLOPs of one `call()` by torch's flop counter, None) or (None, why it could not count):
    the counter has limits of its own (its SDPA formula rejects grouped-query shapes), which must
    not fail the eager row it is only a column of."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as fc:
            call()
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
    return int(fc.get_total_flops()), None


def _prepare(args, adapter, module, method: str):
    """The callable each strategy times (compilation itself happens on the first call)."""
    import torch

    strategy = args.worker
    kw = {"backend": args.backend} if args.backend else {}
    if strategy == "eager" or strategy in ZOO_STRATEGIES:
        return getattr(module, method)
    if strategy == "torch_compile":
        return torch.compile(module, **kw) if method == "forward" else torch.compile(getattr(module, method), **kw)
    if strategy == "diffusers_regional":
        why = _regional_refusal(adapter, args.entry, module, method)
        if why:
            raise TypeError(why)
        module.compile_repeated_blocks(fullgraph=True, **kw)
        return module
    if strategy in baselines.BASELINES:
        why = _regional_refusal(adapter, args.entry, module, method, strategy) \
            or baselines.missing_reason(strategy, next(module.parameters()).device.type)
        if why:
            raise TypeError(why)
        args.baseline_setup = baselines.prepare(strategy, module, kw)
        return module
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def _first_tensor(out):
    """The output that is compared: a tensor, the first of a tuple, a diffusers output's
    `sample`, a transformers ModelOutput's first field (last_hidden_state)."""
    import torch

    while not isinstance(out, torch.Tensor):
        if isinstance(out, (tuple, list)):
            out = out[0]
        elif hasattr(out, "sample"):
            out = out.sample
        elif isinstance(out, dict):
            out = next(v for v in out.values() if v is not None)
        else:
            raise TypeError(f"no tensor output to compare in a {type(out).__name__}")
    return out


def _fp32_reference(module, fn, inputs: dict[str, Any], tmp: Path) -> None:
    """One call with the same weights and inputs in fp32 (see common.fp32_forward)."""
    import torch

    out = common.fp32_forward(module, lambda up: _first_tensor(fn(**up)), inputs)
    torch.save(out.float().cpu(), tmp / "fp32.pt")


def worker(args) -> dict[str, Any]:
    import torch

    from magi_zoo.engine import counters

    strategy, phase = args.worker, args.phase
    rec: dict[str, Any] = {"strategy": strategy, "phase": phase, "status": "ok"}
    _progress(f"{strategy}/{phase}: building {args.model} (random weights) ...")
    handle, module, method, make_inputs, device, dtype, dropped = _build(args, strategy)
    rec["entry_target"] = f"{type(module).__name__}.{method}"
    if dropped:
        rec["dropped_keys"] = dropped
    rec["resident_gib"] = common.gib(torch.cuda.memory_allocated()) if device.type == "cuda" else None
    if handle.cache is not None:
        rec["cache_status"], rec["cache_load_s"] = handle.cache.status, round(handle.cache.load_s, 3)
        rec["cache_kernel_files"] = handle.cache.kernel_files  # our Triton kernels' files restored
    fn = _prepare(args, handle.adapter, module, method)
    if getattr(args, "baseline_setup", None):
        rec["baseline_setup"] = args.baseline_setup
    inputs = make_inputs()
    call = lambda: fn(**inputs)  # noqa: E731
    before = counters.snapshot()
    with torch.no_grad():
        if strategy == "eager" and phase == "cold":
            rec["flops"], flops_error = count_flops(lambda: fn(**make_inputs()))
            if flops_error:  # the row stands; only the TFLOP/s columns are missing
                rec["flops_error"] = flops_error
            rec["matmul_tflops"] = common.matmul_peak_tflops(device, dtype)
            if args.fp32_reference and dtype != torch.float32:
                try:
                    _fp32_reference(module, fn, make_inputs(), Path(args.tmp))
                except Exception as e:  # the eager row stands; only the fp32 column is missing
                    rec["fp32_reference_error"] = f"{type(e).__name__}: {e}"
        _progress(f"{strategy}/{phase}: first call (compiles) ...")
        out, first_s = common.first_call(call, device)
        rec["first_call_s"] = round(first_s + rec.get("cache_load_s", 0.0), 3)
        # Copied now: later calls may overwrite it (CUDA graphs reuse their output buffers).
        first_out = _first_tensor(out).float().cpu()
        del out
        d = counters.delta(before)
        rec.update(frames_compiled=d.frames, graph_breaks=d.n_graph_breaks, recompiles=len(d.recompiles),
                   compile_s=round(d.compile_s, 3), compile_breakdown_s=d.breakdown())
        if strategy in ZOO_STRATEGIES and phase == "cold":
            handle.save_compile_cache()
        if phase == "cold":
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _progress(f"{strategy}/{phase}: timing {args.warmup} warm-up + {args.runs} runs ...")
            rec.update(common.time_calls(call, device, warmup=args.warmup, runs=args.runs))
            rec["peak_gib"] = common.gib(torch.cuda.max_memory_allocated()) if device.type == "cuda" else None
            rec["recompiles_after_first_call"] = len(counters.delta(before).recompiles) - rec["recompiles"]
            torch.save(first_out, Path(args.tmp) / f"{strategy}.pt")
    if handle.lora is not None:  # what was fused: the report's own lines
        rec["lora"] = handle.lora.lines()
    rep = handle.report()
    if rep is not None:
        rec["regions"] = rep.to_dict()["regions"]
        rec["plan_table"] = rep.table()
        # which kernel each attention key took ([] = the library's default, SDPA), so a table can
        # say whether diffusers on SDPA is the same-kernel baseline
        rec["attention"] = list((rep.step("attention").details or {}).get("backends", []))
        graphed = (rep.step("cuda_graphs").details or {}).get("graphed", {})
        if graphed:  # graphs captured, replays, calls that ran uncaptured and why
            rec["cuda_graphs"] = {label: call.stats() for label, call in graphed.items()}
    return rec


# -- parent (all strategies, fresh processes) ------------------------------------------------

def _strategy_env(tmp: Path, strategy: str, phase: str, repeat: int = 0) -> dict[str, str]:
    """Fresh compile caches per process; see the module docstring for the warm rules."""
    run = "cold" if (phase == "cold" or strategy not in ZOO_STRATEGIES) else f"warm{repeat}"
    base = tmp / f"{strategy}-{run}"
    return {"TORCHINDUCTOR_CACHE_DIR": str(base / "inductor"), "TRITON_CACHE_DIR": str(base / "triton")}


def _worker_args(args, strategy: str, phase: str, tmp: Path, result: Path) -> list[str]:
    out = ["--model", args.model, "--entry", args.entry, "--device", args.device, "--worker", strategy,
           "--phase", phase, "--warmup", str(args.warmup), "--runs", str(args.runs), "--tmp", str(tmp),
           "--result", str(result), "--zoo-cache", str(tmp / "zoo-cache")]
    for k in ("height", "width", "frames", "layers", "backend"):
        if getattr(args, k) is not None:
            out += [f"--{k}", str(getattr(args, k))]
    for pair in args.shape:
        out += ["--shape", pair]
    if args.fp32_reference:
        out.append("--fp32-reference")
    if args.one_layer_encoders:
        out.append("--one-layer-encoders")
    return out


def _compare(tmp: Path, strategy: str, reference: str = "eager") -> tuple[float | None, float | None]:
    """(relative L2 error, max abs difference) of a strategy's output against a reference's."""
    import torch

    ref, mine = tmp / f"{reference}.pt", tmp / f"{strategy}.pt"
    if not (ref.is_file() and mine.is_file()):
        return None, None
    # weights_only: these files hold plain tensors, and unpickling must never run code
    a, b = torch.load(ref, weights_only=True), torch.load(mine, weights_only=True)
    return float((b - a).norm() / a.norm()), float((b - a).abs().max())


def _preflight(args, adapter, variant, strategies: list[str]) -> dict[str, str]:
    """Check the entry's example inputs at this shape and which strategies can apply, on a
    build on the meta device (module tree only, no memory, seconds), before any process
    starts. Bad shape arguments exit with the adapter's message; strategies that cannot
    apply are returned with the reason. A family that cannot build on meta is checked in
    the workers instead."""
    import torch
    import torch.nn as nn

    from magi_zoo.engine.prepare import prepare

    try:
        native = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
        module, method = adapter.entry(native, args.entry)
        prepare(nn.ModuleDict(adapter.components(native)), adapter.preparations(native))
    except Exception as e:  # noqa: BLE001
        print(f"[bench] no meta-device preflight for {variant.name} ({type(e).__name__}: {e}); "
              "the workers check", flush=True)
        return {}
    try:
        adapter.example_inputs(native, variant, args.entry, **_shape(args))
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{variant.name} entry {args.entry!r}: example inputs at this shape fail: {e}") from None
    refused = {}
    for strategy in ("diffusers_regional", *baselines.BASELINES):
        if strategy not in strategies:
            continue
        why = _regional_refusal(adapter, args.entry, module, method, strategy)
        if why is None and strategy in baselines.BASELINES:
            why = baselines.missing_reason(strategy, torch.device(args.device).type)
        if why:
            refused[strategy] = why
    return refused


def _chart(rows: list[dict[str, Any]], path: Path, title: str, ylabel: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if r.get("status") == "ok" and r.get("median_ms") is not None]
    if not ok:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [r["strategy"] for r in ok]
    a1.bar(names, [r["median_ms"] for r in ok], yerr=[[r["median_ms"] - r["min_ms"] for r in ok],
                                                      [r["max_ms"] - r["median_ms"] for r in ok]], color="#4c72b0")
    a1.set_ylabel(ylabel)
    a2.bar(names, [r.get("first_call_s") or 0 for r in ok], color="#dd8452", label="cold")
    a2.bar(names, [r.get("warm_first_call_s") or 0 for r in ok], color="#55a868", label="warm", width=0.4)
    a2.set_ylabel("first call s")
    a2.legend()
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


COLUMNS = ["strategy", "status", "median_ms", "min_ms", "max_ms", "first_call_s", "warm_first_call_s",
           "peak_gib", "rel_err_vs_eager", "rel_err_vs_fp32", "tflops", "pct_of_matmul_peak", "frames_compiled", "graph_breaks",
           "recompiles", "s_per_step_cfg"]
DECODE_COLUMNS = ["tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "speedup_vs_eager"]


def _shape_line(record: dict[str, Any], flops, peak) -> str:
    shape = dict(record["shape"])
    dims = ""
    if shape.get("height") is not None or shape.get("width") is not None:
        dims = f"{shape.pop('height', None)}x{shape.pop('width', None)}, frames {shape.pop('frames', None)}, "
    extra = "".join(f"{k}={v}, " for k, v in shape.items() if v is not None and k != "batch")
    unit = "forward" if record["entry_method"] in (None, "forward") else "call"
    return (f"shape: {dims}{extra}batch {record['batch']}, {record['dtype']}; "
            f"FLOPs/{unit} {flops / 1e12 if flops else float('nan'):.4g} TFLOP; measured matmul peak {peak} TFLOP/s")


def parent(args) -> dict[str, Any]:
    import torch

    adapter, variant, note = _variant(args)
    if args.entry is None:
        args.entry = adapter.entry_points[0] if adapter.entry_points else "denoise"
    try:
        adapter.check_entry(args.entry)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    defaults = variant.call_defaults  # record the shape actually run
    args.height = args.height or defaults.get("height")
    args.width = args.width or defaults.get("width")
    args.frames = args.frames or defaults.get("num_frames")
    shape = _shape(args)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    if "eager" in strategies:
        strategies.remove("eager")
    strategies.insert(0, "eager")  # the reference for errors and FLOPs runs first
    refused = _preflight(args, adapter, variant, strategies)
    decode = args.entry in DECODE_ENTRIES
    batch = shape.get("batch", 1)
    out_dir = Path(args.out) if args.out else common.results_dir(common.model_topic(args.model))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="magi-bench-") as tmp_s:
        tmp = Path(tmp_s)
        for i, strategy in enumerate(strategies, 1):
            if strategy in refused:
                print(f"[{i}/{len(strategies)}] {strategy}: refused: {refused[strategy]}", flush=True)
                rows.append({"strategy": strategy, "status": "refused", "error": refused[strategy]})
                record = _write_record(args, adapter, variant, note, shape, [dict(r) for r in rows], decode, batch,
                                       out_dir, complete=i == len(strategies))
                continue
            warm = 0 if strategy == "eager" or args.no_warm_start else args.warm_repeats
            phases = [("cold", 0)] + [("warm", k) for k in range(warm)]
            row: dict[str, Any] = {"strategy": strategy}
            warm_s: list[float] = []
            for phase, k in phases:
                label = f"{phase} process" + (f" {k + 1}/{warm}" if phase == "warm" and warm > 1 else "")
                print(f"[{i}/{len(strategies)}] {strategy} ({label})", flush=True)
                result = tmp / f"{strategy}-{phase}{k}.json"
                rec = common.run_isolated("benchmarks.run", _worker_args(args, strategy, phase, tmp, result),
                                          env=_strategy_env(tmp, strategy, phase, k), timeout=args.timeout,
                                          result_file=result)
                if phase == "cold":
                    row.update(rec)
                    row["strategy"] = strategy
                else:
                    warm_s.append(rec.get("first_call_s"))
                    # the median over repeated warm processes (each with fresh torch caches)
                    row["warm_first_call_s"] = round(statistics.median([w for w in warm_s if w is not None] or [0]), 3)
                    row["warm_first_call_s_all"] = list(warm_s)
                    row["warm_status"] = rec.get("status")
                    row["warm_cache_status"] = rec.get("cache_status")
                    row.setdefault("warm_detail", []).append(
                        {key: rec.get(key) for key in ("cache_load_s", "cache_kernel_files", "compile_s", "compile_breakdown_s")})
                    if rec.get("status") != "ok":
                        row["warm_error"] = rec.get("error")
                if rec.get("status") != "ok":
                    print(f"    {strategy}/{phase} failed: {str(rec.get('error'))[-400:]}", flush=True)
                    break
            row["rel_err_vs_eager"], row["max_abs_diff_vs_eager"] = _compare(tmp, strategy)
            if args.fp32_reference:
                row["rel_err_vs_fp32"] = _compare(tmp, strategy, "fp32")[0]
            rows.append(row)
            # Written after every row: a run cut short (a time limit, a crash) keeps what it measured,
            # marked incomplete; the last write is the whole run.
            record = _write_record(args, adapter, variant, note, shape, [dict(r) for r in rows], decode, batch,
                                   out_dir, complete=i == len(strategies))
    return record


def _write_record(args, adapter, variant, note, shape, rows: list[dict[str, Any]], decode: bool, batch: int,
                  out_dir: Path, *, complete: bool) -> dict[str, Any]:
    """The results record of the rows measured so far (derived columns added), written as JSON,
    markdown and chart; `complete` False marks a run still going (or cut short) in both files."""
    import torch

    eager = rows[0]
    flops, peak = eager.get("flops"), eager.get("matmul_tflops")
    for r in rows:
        if r.get("status") == "ok" and flops and r.get("median_ms"):
            r["tflops"] = float(f"{flops / (r['median_ms'] / 1e3) / 1e12:.3g}")
            r["pct_of_matmul_peak"] = float(f"{100 * r['tflops'] / peak:.3g}") if peak else None
        if r.get("status") == "ok" and r.get("median_ms") and eager.get("median_ms"):
            r["speedup_vs_eager"] = round(eager["median_ms"] / r["median_ms"], 3)
        if decode and r.get("status") == "ok" and r.get("median_ms"):
            # one token per sequence per call
            r["tokens_per_s"] = round(batch * 1000 / r["median_ms"], 1)
            r["tokens_per_s_min"] = round(batch * 1000 / r["max_ms"], 1)
            r["tokens_per_s_max"] = round(batch * 1000 / r["min_ms"], 1)
        if args.cfg and r.get("median_ms"):
            r["s_per_step_cfg"] = round(2 * r["median_ms"] / 1e3, 3)
        for key in ("rel_err_vs_eager", "rel_err_vs_fp32", "max_abs_diff_vs_eager"):
            if r.get(key) is not None:
                r[key] = float(f"{r[key]:.2e}")
    device = torch.device(args.device)
    env = common.environment(device)
    target = eager.get("entry_target")
    record = {"complete": complete, "model": args.model, "variant": variant.name, "variant_note": note, "entry": args.entry,
              "entry_target": target, "entry_method": target.rsplit(".", 1)[-1] if target else None,
              "shape": {"height": args.height, "width": args.width, "frames": args.frames, **shape},
              "batch": batch, "dtype": "bfloat16" if device.type == "cuda" else "float32", "cfg": args.cfg,
              "backend": args.backend, "layers": args.layers, "smoke": args.smoke,
              "flops_per_forward": flops, "matmul_tflops_measured": peak, "env": env,
              "command": "python -m benchmarks.run " + " ".join(args.argv), "results": rows}
    default_entry = adapter.entry_points[0] if adapter.entry_points else args.entry
    stem = args.stem or (args.model + (f"_{args.entry}" if args.entry != default_entry else "")
                         + (f"_{args.layers}L" if args.layers is not None else "")
                         + f"_{common.card_tag(env, device.type == 'cuda')}")  # a name says its card
    what = "one denoiser forward" if args.entry == "denoise" else f"one {args.entry} call"
    md = [f"# {args.model}: {what}" + (" (smoke run: too few runs to be a measurement)" if args.smoke else "")
          + ("" if complete else f" (incomplete: {len(rows)} strategies measured so far)"), "",
          common.env_line(env), ""]
    if note:
        md += [note, ""]
    if target and args.entry != "denoise":
        md += [f"entry: `{args.entry}` = `{target}`", ""]
    columns = COLUMNS[:2] + (DECODE_COLUMNS if decode else []) + COLUMNS[2:]
    md += [_shape_line(record, flops, peak), "", f"command: `{record['command']}`", "",
           common.results_table(rows, columns)]
    errors = [f"- {r['strategy']}: {str(r.get('error'))[-600:]}" for r in rows if r.get("status") != "ok"]
    errors += [f"- {r['strategy']} (warm): {str(r.get('warm_error'))[-600:]}" for r in rows if r.get("warm_error")]
    errors += [f"- eager fp32 reference: {eager['fp32_reference_error']}"] if eager.get("fp32_reference_error") else []
    errors += [f"- eager FLOP count (no TFLOP/s columns): {eager['flops_error']}"] if eager.get("flops_error") else []
    if errors:
        md += ["", "Failures:", *errors]
    for r in rows:
        if r.get("dropped_keys"):
            md += ["", f"spec keys dropped ({r['strategy']}: no such part in this build): "
                   + ", ".join(f"`{k}`" for k in r["dropped_keys"])]
        if r.get("plan_table"):
            md += ["", f"{r['strategy']} regions:", "", r["plan_table"]]
    paths = common.write_results(out_dir, stem, record, "\n".join(md))
    ylabel = "ms per forward (median)" if record["entry_method"] in (None, "forward") else "ms per call (median)"
    chart = _chart(rows, out_dir / f"{stem}.png", f"{args.model} on {env['card']} (torch {env['torch']})", ylabel)
    if complete:
        print("\n".join(md), flush=True)
    print("wrote " + ", ".join(str(p) for p in paths + ([chart] if chart else [])), flush=True)
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--entry", default=None,
                   help="the adapter entry point to time (default: the family's first, e.g. denoise, prefill)")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--frames", type=int, default=None)
    p.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE",
                   help="a family-specific example_inputs argument, repeatable (e.g. text_len=32, ctx_len=256)")
    p.add_argument("--layers", type=int, default=None,
                   help="build the variant with N layers (families in LAYER_VARIANTS: qwen3_omni thinker layers)")
    p.add_argument("--one-layer-encoders", action="store_true",
                   help="the published denoiser depth with one-layer text / image encoders (a faster build; the "
                        "timed denoiser entry never runs the encoders)")
    p.add_argument("--backend", default=None,
                   help="every compiled region's backend (e.g. eager / aot_eager for CPU smoke runs)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/<the model's topic>)")
    common.add_commit_argument(p)
    p.add_argument("--stem", default=None,
                   help="file name stem of the results (default: the model, plus _<entry> / _<N>L when given, "
                        "and the card: wan2.1-t2v-1.3b_h100)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--smoke", action="store_true",
                   help="a plumbing check, not a measurement: allows --warmup < 2 / --runs < 5")
    p.add_argument("--cfg", action="store_true", help="also report s/step with CFG (2 forwards)")
    p.add_argument("--no-warm-start", action="store_true", help="skip the warm-start processes")
    p.add_argument("--warm-repeats", type=int, default=1,
                   help="warm-start processes per strategy; the table shows their median")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also compare every strategy with an fp32 call of the same weights")
    p.add_argument("--timeout", type=float, default=900, help="seconds per strategy process")
    # internal: one strategy in this process
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default="cold", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--zoo-cache", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.worker is None:
        common.measured_commit()  # refused before anything is measured where the commit cannot be known
        if (args.warmup < 2 or args.runs < 5) and not args.smoke:
            raise SystemExit("--warmup must be >= 2 and --runs >= 5 (docs/methodology.md); --smoke for a plumbing check")
        if args.warmup < 0 or args.runs < 1:
            raise SystemExit("--warmup must be >= 0 and --runs >= 1")
        return parent(args)
    try:
        rec = worker(args)
    except Exception as e:  # recorded, so the table shows the failure and its error
        rec = {"strategy": args.worker, "phase": args.phase, "status": "error",
               "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    Path(args.result).write_text(json.dumps(rec, default=str))
    return rec


if __name__ == "__main__":
    main()
