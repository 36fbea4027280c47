"""`magi-zoo run`'s flags, checked and turned into `load`'s arguments before anything is built
(a bad option costs nothing; under `--nproc` it is refused before torchrun starts)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from ... import adapters, distributed
from ...adapters import lora
from ...engine.compile import resolve_cache_dir
from ...io import check_writable
from ...overrides import eager_compile, reserve_section
from ...specs import SpecFile, get_profile
from ...specs.compile_spec import TorchCompileSpec
from ...specs.parallel_spec import ParallelSpec, default_parallel
from ...specs.section import flat_error
from ...specs.step_cache_spec import parse_cli as parse_step_cache
from ..console import one_line


@dataclasses.dataclass
class RunRequest:
    """What a checked `run` command asks for."""

    adapter: adapters.Adapter
    options: dict[str, Any]  # the generation's options (adapter.check_run has seen them)
    compile: Any  # load's compile=: False (eager), None (the spec) or compile overrides
    overrides: dict[str, Any] | None  # load's overrides=: the step_cache section, if asked for
    parallel: dict[str, Any] | None  # load's parallel=: ParallelSpec fields; None = one process
    lora: list[Any] | None = None  # load's lora=: `--lora` parsed (LoraSpecs)


def check_run(args) -> RunRequest:
    """Everything about `run`'s arguments that can be checked before a build."""
    opts = dict(image=args.image, audio_out=args.audio_out, num_inference_steps=args.steps, height=args.height,
                width=args.width, num_frames=args.frames, max_new_tokens=args.max_new_tokens, seed=args.seed)
    opts.update(task=args.task, think=args.think or None)  # BAGEL: which task; reason first
    opts.update(audio=args.audio, voice=args.voice)  # Qwen3-Omni: audio prompt, speech voice
    adapter, variant = adapters.lookup(args.model)
    adapter.check_inputs(adapter.check_run(variant, opts, Path(args.out)))
    check_output_paths(args)
    loras = parse_loras(getattr(args, "lora", None))
    compile_overrides = parse_compile_overrides(args.compile_overrides)
    step_cache = step_cache_override(args, adapter)
    if compile_overrides is not None and not args.compile:
        raise ValueError("--compile and --no-compile contradict each other; pass one")
    if getattr(args, "cache_dir", None) is not None and not args.compile:
        raise ValueError("--cache-dir keeps compiled code for the next run, and --no-compile compiles none; drop one")
    if args.spec_file is not None:  # read strictly now: under --nproc an error here is printed once, not per rank
        if not Path(args.spec_file).is_file():
            raise ValueError(f"--spec-file {args.spec_file!r}: no such file")
        SpecFile.from_toml(args.spec_file).layers_for(get_profile(args.gpu).name)
    world = distributed.world_size()
    if distributed.is_launched() and args.nproc not in (None, world):
        raise ValueError(f"--nproc {args.nproc} but this torchrun job has {world} processes; drop --nproc or match it")
    runs_cfg = getattr(adapter, "runs_cfg", lambda call, variant: False)({**adapter.call_defaults(variant), **opts},
                                                                          variant)
    par = run_parallel_fields(world if distributed.is_launched() else args.nproc,
                              ulysses=args.ulysses, ring=args.ring, cfg=args.cfg_parallel,
                              uneven=args.uneven, runs_cfg=runs_cfg,
                              heads=variant.config.get("transformer", {}).get("num_attention_heads"))
    on_cpu = par is not None and get_profile(args.gpu).device == "cpu"  # --gpu auto without CUDA too
    if on_cpu and (par.get("ulysses_degree", 1) > 1 or par.get("ring_degree", 1) > 1):
        given = [f for f, v in (("--ulysses", args.ulysses), ("--ring", args.ring)) if (v or 1) > 1]
        what = (f"{' / '.join(given)} use diffusers' context parallelism" if given else  # or the split --nproc picked
                f"--nproc {args.nproc or distributed.world_size()} would split the sequence (Ulysses / ring: "
                "diffusers' context parallelism)")
        raise ValueError(f"{what}, which runs on GPUs; on the CPU (--gpu cpu, or auto without CUDA) only "
                         "--cfg-parallel splits the work (--nproc 2, a model that runs CFG)")
    if args.compile:
        compile_arg = compile_overrides
    elif par is not None:  # the parallel split is part of the plan: it applies, every region eager
        compile_arg = eager_compile(SpecFile.from_toml(args.spec_file or adapter.spec_path()))
    else:
        compile_arg = False
    overrides = {**step_cache, **activation_override(args, adapter, variant, opts)}
    return RunRequest(adapter, opts, compile_arg, overrides or None, par, loras)


def parse_loras(items: list[str] | None) -> list[lora.LoraSpec] | None:
    """`--lora [COMPONENT=]PATH[:SCALE]` (repeatable) -> LoraSpecs; peft's presence and each
    local file checked now (the keys against the model at load, before the build)."""
    if not items:
        return None
    specs = lora.lora_specs([lora.parse_cli(t) for t in items])
    lora.require_peft()
    for spec in specs:
        lora.check_source(spec)
    return specs


def activation_override(args, adapter: adapters.Adapter, variant: adapters.Variant, options: dict[str, Any]) -> dict:
    """The offload reserves for this run's shape (`--height` / `--width` / `--frames` over the
    call defaults), from the adapter's activation estimate: `{"offload": {...}}`, or {} where
    the adapter estimates nothing or the spec has no offload section. `load` would size them
    for the call defaults; the flags may ask for more, or less."""
    profile = get_profile(args.gpu)
    call = {**adapter.call_defaults(variant), **{k: v for k, v in options.items() if v is not None}}
    dtype = (args.dtype or profile.default_dtype).lower()
    per_element = 4 if dtype in ("float32", "fp32", "float") else 2  # bf16 / fp16 (fp8 matmuls keep bf16 activations)
    estimate = adapter.activation_estimate(variant, call, per_element)
    layers = SpecFile.from_toml(args.spec_file or adapter.spec_path()).layers_for(profile.name)
    section = reserve_section(layers, estimate)
    return {"offload": section} if section else {}


def check_plan_keys(args, request: RunRequest) -> None:
    """The plan's keys (the spec file's and the overrides') resolved against the model's module
    tree built on the meta device (no memory, no weights): what `--nproc` checks before torchrun
    starts, so a key that matches nothing is one error naming its file, not one per rank after
    every rank has built the model."""
    import torch  # lazy: torch costs seconds; --help never needs it
    import torch.nn as nn  # lazy: as above

    from ...engine import PlanError, preview  # lazy: the engine imports torch
    from ...overrides import name_plan_source, spec_layers  # lazy: as above

    if request.compile is False:  # eager: no plan is applied
        return
    profile = get_profile(args.gpu)
    layers = spec_layers(request.adapter, profile, spec_file=args.spec_file, compile=request.compile,
                         overrides=request.overrides, parallel=request.parallel,
                         memory_budget_gib=args.memory_budget)
    variant = adapters.lookup(args.model)[1]
    native = request.adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    try:
        preview(nn.ModuleDict(request.adapter.components(native)), layers, request.adapter.preparations(native))
    except PlanError as e:
        raise name_plan_source(e, args.spec_file or request.adapter.spec_path(), profile.name,
                               shipped=args.spec_file is None) from None


def check_output_files(out, audio_out=None, *, overwrite: bool, inputs: dict[str, Any] | None = None) -> None:
    """`--out` and `--audio-out` (when given) writable, not one file, and none of `inputs`
    (flag -> the path an input option reads, e.g. {"--image": ...}): what `magi-zoo run` checks
    before the build and `generate_to` again before it generates."""
    inputs = {k: v for k, v in (inputs or {}).items() if isinstance(v, (str, os.PathLike))}
    outs = [("--out", out)] + ([("--audio-out", audio_out)] if audio_out else [])
    for flag, path in outs:
        check_writable(path, what=flag, overwrite=overwrite, overwrite_hint="pass --overwrite")
    if len(outs) == 2 and Path(outs[0][1]).resolve() == Path(outs[1][1]).resolve():
        raise ValueError(f"--out and --audio-out name the same file {str(out)!r}; give each its own")
    for out_flag, path in outs:  # --overwrite replaces an earlier output, never the run's own input
        for in_flag, source in inputs.items():
            if Path(source).resolve() == Path(path).resolve():
                raise ValueError(f"{out_flag} {str(path)!r} is the {in_flag} file this run reads; write the output "
                                 "elsewhere (--overwrite never replaces an input)")


def check_output_paths(args) -> None:
    """Every path the run writes -- `--out`, `--audio-out`, the compile cache -- checked now,
    so a finished generation is never lost to a path that cannot be written: not an existing
    directory, not an existing file without `--overwrite`, in a writable directory."""
    check_output_files(args.out, getattr(args, "audio_out", None), overwrite=bool(getattr(args, "overwrite", False)),
                       inputs={"--image": getattr(args, "image", None), "--audio": getattr(args, "audio", None)})
    cache = resolve_cache_dir(getattr(args, "cache_dir", None))
    if cache is not None:  # a cache directory is reused: it may hold files already
        what = "--cache-dir" if getattr(args, "cache_dir", None) is not None else "$MAGI_ZOO_CACHE_DIR"
        check_writable(cache, what=what, directory=True, overwrite=True)


def parse_compile_overrides(items: list[str] | None) -> dict | None:
    """`--compile KEY=JSON` (repeatable) -> a compile override {key: spec}, every spec
    validated now (unknown field, bad value: the error names the flag), before any build."""
    if not items:
        return None
    out: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--compile {item!r}: expected KEY=JSON, e.g. "
                             "--compile 'WanTransformerBlock={\"dynamic\": false}'")
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--compile {key}: the value is not JSON ({e.msg} at column {e.colno}): {text!r}; "
                             "e.g. '{\"dynamic\": false}' or false") from None
        if isinstance(spec, bool):  # KEY=false: the enabled switch alone
            spec = {"enabled": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"--compile {key}: expected a JSON object of TorchCompileSpec fields "
                             f"(or true/false), got {text!r}")
        fields = set(TorchCompileSpec.model_fields)
        methods = spec if spec and not fields & set(spec) and all(isinstance(v, dict) for v in spec.values()) else None
        try:
            for one in (methods.values() if methods else [spec]):  # {method: spec} or one spec
                TorchCompileSpec.model_validate(one)
        except Exception as e:  # pydantic's ValidationError names the field and the choices
            errors = getattr(e, "errors", None)
            text = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}" for x in errors()) \
                if callable(errors) else one_line(e)
            if "extra" in text.lower() or "not permitted" in text:
                text += f" (fields: {', '.join(TorchCompileSpec.model_fields)})"
            raise ValueError(f"--compile {key}: {text}") from None
        out[key.strip()] = spec
    return out


def step_cache_override(args, adapter) -> dict:
    """`--step-cache METHOD[:THRESHOLD|:NAME=VALUE,...]` as a plan layer's step_cache section,
    keyed on the pipeline's denoiser(s) (`transformer`, and Wan2.2's `transformer_2` by the
    glob); {} without the flag. Validated here, before anything is built."""
    text = getattr(args, "step_cache", None)
    if text is None:
        return {}
    if "transformer" not in getattr(adapter, "component_names", ()):
        raise ValueError(f"--step-cache uses diffusers' caching hooks on a pipeline's transformer; "
                         f"{args.model} has none (Wan and Flux models do)")
    if not args.compile:
        raise ValueError("--step-cache is part of the plan, which --no-compile does not apply; drop --no-compile "
                         "(to run the blocks eager, e.g. for pab: --compile 'WanTransformerBlock=false')")
    return {"step_cache": {"transformer*": parse_step_cache(text)}}


def run_parallel_fields(nproc: int | None, *, ulysses: int | None, ring: int | None, cfg: bool | None,
                        uneven: bool, runs_cfg: bool, heads: int | None = None) -> dict[str, Any] | None:
    """The parallel-section fields for a `run` command (None: not a parallel run).

    `nproc` is the process count asked for (--nproc; inside a torchrun job, WORLD_SIZE).
    Degrees not given are chosen by `default_parallel` (from the process count, whether the
    call runs CFG and the denoiser's attention `heads`); the product is checked against the
    process count here, before anything is built or launched."""
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be a positive integer (the number of processes), got {nproc}")
    for flag, degree in (("--ulysses", ulysses), ("--ring", ring)):
        if degree is not None and degree < 1:
            raise ValueError(f"{flag} must be a positive integer (a degree; 1 = no split), got {degree}")
    given = {k: v for k, v in dict(ulysses_degree=ulysses, ring_degree=ring, cfg=cfg).items() if v is not None}
    if uneven:
        given["uneven"] = True
    n = nproc or 1
    # what only a split run can use: a degree above 1, either CFG flag, --uneven (a degree of 1
    # asks for no split, so it is consistent with one process)
    asked = [flag for flag, on in (("--ulysses", (ulysses or 1) > 1), ("--ring", (ring or 1) > 1),
                                   ("--cfg-parallel" if cfg else "--no-cfg-parallel", cfg is not None),
                                   ("--uneven", uneven)) if on]
    if n == 1 and not asked:
        return None
    if n == 1:
        raise ValueError(f"{' / '.join(asked)} only apply to a run split over processes: add --nproc N "
                         "(or launch with torchrun)")
    if not {"ulysses_degree", "ring_degree", "cfg"} & set(given):
        given = {**default_parallel(n, runs_cfg, heads), **given}
        if given.get("cfg") and not runs_cfg:  # pragma: no cover - default_parallel never does this
            given.pop("cfg")
    if given.get("cfg") and not runs_cfg:
        raise ValueError("--cfg-parallel splits classifier-free guidance, which this model's run does not use; "
                         "use --ulysses / --ring instead")
    try:
        spec = ParallelSpec(**given)
    except Exception as e:  # pydantic: names the field
        raise ValueError(f"parallel options: {flat_error(e)}") from None
    spec.check_world(n, where="--nproc")
    return spec.model_dump(exclude_defaults=True)
