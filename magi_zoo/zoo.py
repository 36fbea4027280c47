"""`magi_zoo.load`: registry -> adapter.build -> spec layers -> engine.apply -> handle."""

from __future__ import annotations

import functools
import inspect
import time
import typing
from pathlib import Path
from typing import Any, Mapping

import pydantic
import torch
import torch.nn as nn

from . import adapters
from . import checkpoints
from .adapters import lora as lora_loader
from .adapters.fp8_checkpoint import read_manifest
from .engine import PlanError, Report, apply, needs_streaming, offload
from .engine.compile import CompileCache, resolve_cache_dir
from .engine.observe.explain import explain_call
from .io import check_writable
from .overrides import activation_reserves, has_auto_recompute, name_plan_source, spec_layers
from .specs import PlanLayer, get_profile
from .specs.gpu_profiles import GpuProfile
from .specs.section import did_you_mean
from .train import calibrate as calibrate_handle
from .train import set_train_mode, trainable_module


# The dtypes a model may be built in, by the names `load` and `--dtype` take (case-insensitive):
# the floating-point types the pipelines run in. float64 and the integer / bool / complex types
# are no model dtype (torch refuses them as a default dtype deep inside the build).
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


def _dtype(dtype: str | torch.dtype | None, profile: GpuProfile) -> torch.dtype:
    if dtype is None:
        dtype = profile.default_dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype}: models are built in bfloat16, float16 or float32")
        return dtype
    if not isinstance(dtype, str) or dtype.lower() not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use bfloat16, float16 or float32 (bf16 / fp16 / fp32, or the "
                         "torch.dtype)")
    return DTYPES[dtype.lower()]


def _device(device: str | torch.device | None, profile: GpuProfile, gpu: str) -> torch.device:
    """The device to build on: `device=` if given, else the profile's; one this machine has,
    checked before the build (torch's own errors came from deep inside it, or named no fix)."""
    try:
        dev = torch.device(device if device is not None else profile.device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a torch device ({e}); pass 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: models are built on 'cpu' or 'cuda' ('cuda:N' for card N)")
    asked = f"device={device!r}" if device is not None else f"gpu={gpu!r}"
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{asked} needs CUDA, which is not available here; use gpu='cpu'"
                           + (" and no device= (or device='cpu')" if device is not None else ""))
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise ValueError(f"{asked}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return dev


class ZooPipeline:
    """What `load` returns: call it like the native pipeline.

    `.pipe` is the native object, `.modules` the named component roots the plan is keyed
    on, `.plan` the resolved plan, and `.report()` what was compiled and what torch did.
    """

    def __init__(self, native: Any, modules: nn.ModuleDict, report: Report | None, *,
                 adapter: adapters.Adapter, variant: adapters.Variant, profile: GpuProfile,
                 dtype: torch.dtype, device: torch.device, layers: list[tuple[str, PlanLayer]],
                 cache: CompileCache | None = None, train: bool = False):
        self.pipe = native
        self.training = train  # load(train=True): plan applied for training
        self.modules = modules
        self._report = report
        self.adapter = adapter
        self.variant = variant
        self.profile = profile
        self.dtype = dtype
        self.device = device
        self.layers = layers
        self.cache = cache
        # Seconds `load` spent per phase: plan_s (spec layers, the offload plan on a meta
        # copy), build_s (the model, on the card or in host memory), apply_s (the engine's
        # steps, offload placement included), calibrate_s (recompute="auto" measuring).
        self.timings: dict[str, float] = {}
        self.lora: lora_loader.LoraState | None = None  # the LoRAs loaded (load(lora=...)), their scales, the mode

    def save_pretrained(self, path: str | Path, *, precision: str | None = None, overwrite: bool = False) -> Path:
        """Write the model so that `load(name, weights=path)` reads it back; precision="fp8"
        stores the fp8 regions' linears quantized, read back without a bf16 copy
        (`magi_zoo.checkpoints`; docs/lora.md#fp8-checkpoints). A directory that holds files is
        refused unless `overwrite=True`."""
        strict_arguments(ZooPipeline.save_pretrained, locals())
        return checkpoints.save_pretrained(self, path, precision=precision, overwrite=overwrite)

    def swap_lora(self, source: str | Path, scale: float = 1.0) -> None:
        """Replace the hot-swappable LoRA (`load(..., lora=[...], lora_hotswap=True)`) with
        another, in place: diffusers' hotswap over peft changes tensors only, so compiled regions
        recompile nothing. The new LoRA is read and checked against this model first."""
        if self.lora is None or not self.lora.hotswap:
            raise ValueError("swap_lora needs a load with lora=[...] and lora_hotswap=True (a fused LoRA is merged "
                             "into the weights; load again to change it)")
        slot = self.lora.specs[0]
        # not converted: LoraSpec refuses a scale that is no finite number, a source that is no path
        spec = lora_loader.LoraSpec(source, scale, slot.component)
        state = lora_loader.prepare([spec], self.pipe, self.adapter.components(self.pipe), self.variant.name)[0]
        lora_loader.swap(self.pipe, self.lora, spec, state)
        if self._report is not None:
            self._report.notes[:] = self.lora.lines()

    @property
    def trainable(self) -> nn.Module:
        """The module a fine-tune optimises (the denoiser; `load(train=True)` put it in train mode)."""
        return trainable_module(self.adapter, self.pipe)

    @property
    def plan(self):
        """The resolved plan (None when compile=False)."""
        return self._report.plan if self._report else None

    def call_defaults(self) -> dict[str, Any]:
        """What a call fills in when the caller leaves it out (the variant's call defaults,
        e.g. a tiny variant's small resolution)."""
        return self.adapter.call_defaults(self.variant)

    def check_call(self, call: dict[str, Any]) -> dict[str, Any]:
        """`call` with the call defaults filled in, checked against the family's limits before
        any work (`Adapter.check_call`: counts, sizes, the output against the memory)."""
        given, call = call, {**self.call_defaults(), **call}
        self.adapter.check_call(self.variant, call, given=given,
                                device_gib=self.profile.memory_gib if self.device.type == "cuda" else None)
        return call

    def __call__(self, *args, **kwargs):
        args, kwargs = _by_name(self.pipe.__call__, args, kwargs)
        _check_keywords(self.pipe.__call__, kwargs, f"{self.variant.name}'s call")
        out = self.pipe(*args, **self.check_call(kwargs))
        self._maybe_save_cache()
        return out

    def stream(self, *args, **kwargs):
        """Streaming generation, for families whose native pipeline streams (Self-Forcing:
        each block's decoded frames as they are made); call defaults filled in as for a call."""
        if not callable(getattr(self.pipe, "stream", None)):
            raise TypeError(f"{self.variant.name} does not stream; call the handle instead")
        args, kwargs = _by_name(self.pipe.stream, args, kwargs)
        _check_keywords(self.pipe.stream, kwargs, f"{self.variant.name}'s stream")
        yield from self.pipe.stream(*args, **self.check_call(kwargs))
        self._maybe_save_cache()

    def refit_offload(self, *args, activation_gib: dict[str, float] | None = None, margin: float = 0.25,
                      floor_gib: float = 0.25, **kwargs) -> dict[str, Any]:
        """Re-plan the weight offload on measured activation peaks (`offload.refit`): runs one
        generation with these arguments (call defaults filled in; e.g. the resolution you will
        use and num_inference_steps=1), measures each component's peak, and keeps more blocks
        resident where the spec's reserves were generous (fewer where they were short). With
        `activation_gib={component: GiB}` no generation runs: those reserves as given.
        Returns what moved. ValueError when nothing streams."""
        run = None if activation_gib is not None else (lambda: self(*args, **kwargs))
        return offload.refit(self.modules, run, activation_gib=activation_gib, margin=margin, floor_gib=floor_gib)

    def _maybe_save_cache(self) -> None:
        # Save after the first compile, and again whenever later calls compiled more
        # (a new shape); calls that compiled nothing cost one integer comparison.
        if self.cache is not None and self._report is not None and self._report.frames > self.cache.saved_frames:
            self.save_compile_cache()

    def save_compile_cache(self) -> bool:
        """Write the compile artifacts of this process to the cache now (if one is set).
        Calls through the handle do this by themselves; call it after running submodules
        directly (as benchmarks do)."""
        if self.cache is None:
            return False
        # CompileCache.save never raises: a failing write is a warning, never a lost result.
        return self.cache.save(self._report.frames if self._report else None)

    def apply_plan(self) -> Report:
        """Apply the resolved spec layers now (after a `compile=False` load, e.g. to time
        eager first); replaces any plan applied before."""
        self._report = apply(self.modules, layers=self.layers, gpu=self.profile,
                             preparations=self.adapter.preparations(self.pipe), train=self.training)
        return self._report

    def explain(self, out_dir: str | Path, entry: str | None = None):
        """Call one entry point (default: the family's first, e.g. the denoiser step) once on
        the adapter's example inputs with torch's compile trace captured, and write a folder
        a user can read under `out_dir`: per region the graphs captured, every graph break
        with the user's file:line and a fix, guards and recompile reasons, inductor's
        output code and a one-page summary.md. Returns the `Explanation`.

        Resets torch's in-process compile caches first, so what is shown is a real compile.
        """
        if self._report is None:
            raise ValueError("explain needs the plan applied: load without compile=False, or call apply_plan()")
        entry = entry or (self.adapter.entry_points[0] if self.adapter.entry_points else None)
        if entry is None:
            raise ValueError(f"{self.adapter.family} declares no entry point to explain")
        self.adapter.check_entry(entry)
        module, method = self.adapter.entry(self.pipe, entry)
        kwargs = self.adapter.example_inputs(self.pipe, self.variant, entry)
        return explain_call(getattr(module, method), kwargs, out_dir, report=self._report)

    def report(self) -> Report | None:
        """The live report: regions, specs, compile seconds, graphs, breaks, recompiles."""
        return self._report

    def __repr__(self) -> str:
        n = len(self._report.regions) if self._report else 0
        return f"ZooPipeline({self.variant.name}, gpu={self.profile.name}, dtype={self.dtype}, regions={n})"


_STRICT: dict[Any, Any] = {}  # function -> its arguments' strict pydantic model, made on first use


def _by_name(fn, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Positional arguments of a pipeline call, as the keywords they bind to in `fn`'s signature,
    so the checks before any work see them too (a count passed by position is checked where it
    lands). Left positional where the signature takes `*args` or cannot be read; a name given
    twice is the TypeError Python would raise, before the pipeline runs."""
    if not args:
        return args, kwargs
    try:
        sig = inspect.signature(fn)
        bound = sig.bind_partial(*args)
    except (TypeError, ValueError):
        return args, kwargs  # no readable signature, or too many positionals: the pipeline says so
    if any(sig.parameters[k].kind is inspect.Parameter.VAR_POSITIONAL for k in bound.arguments):
        return args, kwargs
    twice = sorted(set(bound.arguments) & set(kwargs))
    if twice:
        raise TypeError(f"{getattr(fn, '__qualname__', 'the pipeline call')}() got multiple values for "
                        f"argument {twice[0]!r} (by position and by name)")
    return (), {**bound.arguments, **kwargs}


def _check_keywords(fn, kwargs: Mapping[str, Any], what: str) -> None:
    """A keyword `fn` does not take is a TypeError naming the closest one it does and all it
    takes, before the defaults are merged or any work runs (Python's own error names neither);
    `what` words the callee ("wan2.1-tiny's call"). Skipped where `fn` takes `**kwargs` or has
    no readable signature."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = sorted(n for n, p in params.items()
                   if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        guess = did_you_mean(unknown[0], takes)
        raise TypeError(f"{what} takes no argument {unknown[0]!r}{guess}{'' if guess else '.'} "
                        f"It takes: {', '.join(takes)}")


def named_keywords(fn):
    """`fn` with an unknown keyword refused by `_check_keywords` (closest name, all it takes)
    before Python's bare "unexpected keyword argument"; signature and docstring kept."""
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        _check_keywords(fn, kwargs, f"{fn.__name__}()")
        return fn(*args, **kwargs)
    return checked


def strict_arguments(fn: Any, values: Mapping[str, Any]) -> None:
    """`fn`'s arguments in `values` checked against its annotations, strictly (pydantic's strict
    mode: 1 is not True, "4" is not 4, a bool is not a number; an int is a float). A wrong type
    is a TypeError naming the argument, the types it takes and what it got: coercing would
    turn `train=1` into a training load, or a typo'd value into a silent default."""
    model = _STRICT.get(fn)
    if model is None:
        hints = typing.get_type_hints(fn)
        params = inspect.signature(fn).parameters
        model = _STRICT[fn] = pydantic.create_model(
            f"{fn.__name__}_arguments", __config__=pydantic.ConfigDict(strict=True, arbitrary_types_allowed=True),
            **{k: (hints[k], ...) for k in params if k in hints})
    try:
        model(**{k: values[k] for k in model.model_fields})
    except pydantic.ValidationError as e:
        order = list(model.model_fields)
        k = min((x["loc"][0] for x in e.errors()), key=order.index)
        wanted = inspect.signature(fn).parameters[k].annotation
        raise TypeError(f"{fn.__name__}({k}={values[k]!r}): {k} takes {wanted}, got {type(values[k]).__name__}; "
                        "values are not converted (pass e.g. True, not 1; 4.0 or 4, not '4')") from None


def list_models() -> list[str]:
    """The registered model variants (aliases such as 'wan2.1' resolve too)."""
    return adapters.list_models()


def _build_device(adapter, variant, layers, profile: GpuProfile, dev: torch.device, dt: torch.dtype,
                  compile: Any, budget_given: bool = False) -> torch.device:
    """Where to build: the card, unless the offload plan streams weights (then host memory,
    and the offload step places them: the card may not hold the model even for a moment).
    The plan is made on the real module tree at its real sizes, built on the meta device, so
    a budget no plan can meet is refused before anything is built."""
    if not (dev.type == "cuda" or budget_given) or not any(layer.entries("offload") for _, layer in layers):
        return dev
    meta = adapter.build(variant, weights="random", dtype=dt, device=torch.device("meta"))
    plan = needs_streaming(nn.ModuleDict(adapter.components(meta)), layers, profile, adapter.preparations(meta))
    if plan is None or dev.type != "cuda":
        return dev
    if compile is False:
        raise ValueError(f"{variant.name} does not fit the {plan.budget / 2**30:.1f} GiB budget on {profile.name} and "
                         "must stream weights, which is part of the plan; compile=False applies no plan. Load with "
                         "compile={...} overrides instead (e.g. {'WanTransformerBlock': {'enabled': False}} for eager "
                         "blocks), or a larger memory_budget_gib")
    return torch.device("cpu")


@named_keywords
def load(name: str, *, gpu: str = "auto", weights: str | Path | None = None,
         dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
         compile: Any = None, overrides: Any = None, precision: str | None = None,
         spec_file: str | Path | None = None, cache_dir: str | Path | None = None,
         memory_budget_gib: float | None = None, train: bool = False, recompute: Any = None,
         calibrate: bool = True, parallel: Mapping[str, Any] | None = None, lora: Any = None,
         lora_scale: float = 1.0, lora_hotswap: bool | int = False) -> ZooPipeline:
    """Build a model with its compile spec for a GPU applied.

    The plan's layers come from `magi_zoo.overrides.spec_layers`: the spec file's, then one
    user layer from `overrides`, `compile`, `precision`, `parallel`, `train` / `recompute`
    and `memory_budget_gib`, in that order (a named argument beats `overrides`).

    name: a model variant or alias (`magi_zoo.list_models()`).
    gpu: a profile ("auto", "cpu", "h100", "h200", "a100", "l40s", "rtx4090", "rtx5090");
        picks the spec's [gpu.<name>] section and the default dtype/device.
    weights: None (tiny: random; published: its hub id), "random" (published config,
        random init, no download), a local directory, or a hub id.
    compile: None/True (the shipped spec), False (eager, nothing applied), or a dict of
        compile overrides {key: spec or {method: spec}}, the highest-precedence layer.
    overrides: a user layer for any section, {section: {key: spec}} (e.g.
        {"attention": {"transformer": {"backend": "flash"}}}); `compile=` goes on top of it.
    precision: None (the spec's), "bf16" or "fp8": the matmul format of every region the
        spec's precision section declares (the repeated blocks' linears); fp8 needs a card
        with fp8 matmuls and is refused elsewhere.
    spec_file: a TOML file replacing the shipped spec.
    cache_dir: warm-start cache of compile artifacts (default: $MAGI_ZOO_CACHE_DIR; unset =
        off). Loaded before the first compile, saved after it; keyed by plan, versions,
        device, dtype and model, so a stale entry is never used.
    memory_budget_gib: the offload plan's budget: device memory for weights + streaming
        buffers + activations (default: the GPU profile's memory; a training step's peak is
        recompute's `train_peak_gib`, not this). When the model does not fit, the blocks and
        components the spec's offload section names stream from pinned host memory
        (docs/offload.md); the model is then built in host memory and placed by the offload step.
    train: the denoiser in train mode with gradients (other components frozen, eval), the
        plan applied for training: recompute on the spec's declared blocks, the plan's
        attention (fa3 trains with cuDNN's backward). `handle.trainable` is the module to optimise.
    recompute: with train=True, the blocks' activation recompute: "full" (default), "none",
        "selective" or a dict of RecomputeSpec fields, e.g. {"policy": "auto",
        "train_peak_gib": 16} (measured on the example inputs at load; docs/training.md).
    calibrate: with recompute "auto", measure the blocks and choose at load (default). False
        defers it to `magi_zoo.train.calibrate(handle)`: FSDP2 flows call it after
        `magi_zoo.train.shard`, so the choice sees per-rank memory and load never runs the
        unsharded model's training forward. Until then a training forward is refused.
    parallel: ParallelSpec fields, e.g. {"ulysses_degree": 2} or {"cfg": True}, set on every
        region the spec's parallel section declares (the denoiser): its forward is split over
        the processes of a torchrun job (what `magi-zoo run --nproc N` passes). Not with
        compile=False, which applies no plan.
    lora: LoRAs to load (`magi_zoo.adapters.lora`): each a .safetensors path or hub id
        ("org/name/file.safetensors"), a (source, scale) pair or {"source", "scale",
        "component"} ("transformer_2": Wan2.2 A14B's low-noise expert). Read through
        diffusers' LoRA loaders (its own, peft, Kohya / musubi and original-Wan key layouts,
        LightX2V's distill LoRAs included) and checked against the model before it is built;
        merged by diffusers' `fuse_lora` before the plan applies (no extra compile). Needs peft
        (the `lora` extra). `report()` and `handle.lora` list them.
    lora_scale: multiplies every LoRA's scale (default 1.0).
    lora_hotswap: keep one LoRA unfused in peft layers prepared by diffusers'
        `enable_lora_hotswap` (an int: the largest rank to come), so `handle.swap_lora(...)`
        replaces it on the compiled model without a recompile. Not with fp8 (which quantizes
        plain linears) or a memory budget.
    """
    strict_arguments(load, locals())  # train=1, memory_budget_gib="4": refused, never coerced
    mark = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(phase: str | None = None) -> None:  # the seconds since the previous mark, under `phase`
        nonlocal mark
        now = time.perf_counter()
        if phase is not None:
            timings[phase] = now - mark
        mark = now

    adapter, variant = adapters.lookup(name)
    adapter.weights_source(variant, weights)  # a missing local path, another family's weights: refused now
    profile = get_profile(gpu)
    dt = _dtype(dtype, profile)
    dev = _device(device, profile, gpu)
    if precision is None and profile.fp8 and weights is not None and Path(str(weights)).is_dir() \
            and read_manifest(weights) is not None:
        precision = "fp8"  # an fp8 checkpoint: its regions' plan is fp8 (fusions included), on a card with fp8
    layers = spec_layers(adapter, profile, spec_file=spec_file, compile=compile, overrides=overrides,
                         precision=precision, parallel=parallel, train=train, recompute=recompute,
                         memory_budget_gib=memory_budget_gib)
    # the offload reserves sized for the call defaults' shape, not the spec's fixed numbers (docs/offload.md)
    layers = activation_reserves(layers, adapter.activation_estimate(variant, adapter.call_defaults(variant), dt.itemsize))
    # the training plan has a recompute='auto' region (from recompute= or the spec): measured below
    auto = train and compile is not False and has_auto_recompute(layers)
    if calibrate is not True and not auto:
        raise ValueError("calibrate= defers the measuring of recompute='auto' (e.g. until after FSDP2 sharding): "
                         "pass it with train=True and recompute={'policy': 'auto', ...}")
    # a -distill-lora variant's own LoRAs unless lora= is given (lora=[]: the base model alone)
    loras = lora_loader.lora_specs(variant.config.get("lora") if lora is None else lora, lora_scale)
    if lora_hotswap and (not loras or precision == "fp8" or memory_budget_gib is not None):
        raise ValueError("lora_hotswap=True needs lora=[...] (the LoRA in the slot), and keeps peft layers in the "
                         "graph: not with precision='fp8' or memory_budget_gib (fuse the LoRA: lora_hotswap=False)")
    lora_states = lora_loader.check_for(adapter, variant, loras, dt)  # read and checked before the build
    if lora_hotswap:
        lora_loader.refuse_deltas_for_hotswap([s.source for s in loras], lora_states)
    directory = resolve_cache_dir(cache_dir)
    if directory is not None:  # a directory the cache can be saved to, or an error now, not after the run
        check_writable(directory, what="cache_dir", directory=True, overwrite=True)
    try:
        build_dev = _build_device(adapter, variant, layers, profile, dev, dt, compile, memory_budget_gib is not None)
    except PlanError as e:  # the offload plan resolves the layers on a meta copy: name the file
        raise name_plan_source(e, spec_file or adapter.spec_path(), profile.name, shipped=spec_file is None) from None
    lap("plan_s")
    native = adapter.build(variant, weights=weights, dtype=dt, device=build_dev)
    lap("build_s")
    lora_state = lora_loader.attach(native, loras, lora_states, hotswap=lora_hotswap) if loras else None
    modules = nn.ModuleDict(adapter.components(native))
    if train:
        set_train_mode(adapter, native)
    try:
        # built in host memory to stream: no host copy of the bf16 originals beside the fp8 linears
        report = None if compile is False else apply(modules, layers=layers, gpu=profile,
                                                     preparations=adapter.preparations(native), train=train,
                                                     keep_originals=build_dev == dev)
    except PlanError as e:  # name the file (or argument) the key came from
        raise name_plan_source(e, spec_file or adapter.spec_path(), profile.name, shipped=spec_file is None) from None
    if build_dev != dev and report is not None:
        if offload.runtime(modules) is None:  # the applied plan streams nothing after all (fp8 weights fit): place it whole
            modules.to(dev)
    lap("apply_s")
    if report is not None and lora_state is not None:
        report.notes[:] = lora_state.lines()
    cache = None
    if report is not None and directory is not None:
        cache = CompileCache(directory, {
            "model": f"{adapter.family}/{variant.name}", "dtype": str(dt), "device": dev.type,
            "gpu_profile": profile.name, "plan": report.plan.digests(),
        })
        cache.load()  # before any compile: the first call then hits torch's warm caches
    handle = ZooPipeline(native, modules, report, adapter=adapter, variant=variant, profile=profile,
                         dtype=dt, device=dev, layers=layers, cache=cache, train=train)
    handle.lora = lora_state
    if auto and calibrate and report is not None:
        lap()  # the cache and the handle are not a phase of their own
        calibrate_handle(handle)  # recompute='auto': measure the blocks on the example inputs, choose
        lap("calibrate_s")
    handle.timings = {k: round(v, 2) for k, v in timings.items()}
    return handle
