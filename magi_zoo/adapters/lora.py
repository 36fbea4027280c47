"""LoRA: low-rank adapters loaded through diffusers' LoRA loaders and peft, fused at load.

`magi_zoo.load(name, lora=[...], lora_scale=...)` and `magi-zoo run --lora PATH[:SCALE]` go
through here. Nothing merges a low-rank layer by hand: the pipeline's own `lora_state_dict`
reads the file and converts the layouts diffusers knows (its own / peft keys, Kohya and
musubi-tuner's ``lora_unet_*`` keys, the original Wan keys
``diffusion_model.blocks.N.self_attn.q.lora_down`` with ``alpha`` and ``diff_b`` entries, as
LightX2V's step-distill LoRAs ship), `load_lora_weights` injects peft layers, `fuse_lora`
merges each at its scale and `unload_lora_weights` drops the peft layers, leaving plain linears
with merged weights.

Two modes:
- fused (default): merged before the engine's steps run, so the compiled graphs are those of
  the base model (no extra compile, no recompile) and fp8 quantizes the merged weights;
- hotswap (`lora_hotswap=True`): diffusers' `enable_lora_hotswap` before the first LoRA, the
  peft layers stay in the graph, and `handle.swap_lora(...)` replaces their weights in place
  (peft's hotswap keeps every scale a tensor): nothing recompiles.

Every LoRA is read and checked before the model is built: its keys (after diffusers'
conversion) must name layers of this model at these shapes; a LoRA that matches nothing, or
another family's, is an error naming the LoRA and the model.

The full deltas some files carry besides their low-rank layers, which diffusers' converter
leaves out, are `lora_deltas`'s.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn

from .lora_deltas import ConvertedLora, add_deltas, check_deltas, describe_deltas, refuse_deltas_for_hotswap, \
    with_deltas

COMPONENTS = ("transformer", "transformer_2")  # what a Wan2.2 A14B LoRA may target (high / low noise)
INSTALL = "pip install 'magi-zoo[lora]' (or pip install peft)"

# Key signatures of LoRA files, for naming what a LoRA that fits nothing here was made for.
_SIGNATURES = (
    ("Flux", re.compile(r"(single_transformer_blocks|double_blocks|single_blocks|transformer_blocks\.\d+\.attn\.to_add_out)")),
    ("Wan", re.compile(r"(blocks[._]\d+[._](self_attn|cross_attn|attn1|attn2|ffn))")),
    ("Stable Diffusion / SDXL (UNet)", re.compile(r"(down_blocks|up_blocks|mid_block|lora_unet_(down|up|mid)_)")),
    ("a text encoder", re.compile(r"(lora_te\d?_|text_model\.encoder)")),
    ("a transformers LLM", re.compile(r"(model\.layers\.\d+\.(self_attn|mlp))")),
)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """One LoRA: where it is, how strongly it is merged, which denoiser it goes into."""

    source: str  # a .safetensors file, a directory holding one, or a hub id ("org/name[/file.safetensors]")
    scale: float = 1.0
    component: str = "transformer"  # Wan2.2 A14B: "transformer_2" is the low-noise expert

    @property
    def name(self) -> str:
        """The peft adapter name: the file's stem, made an identifier."""
        stem = Path(self.source.rstrip("/")).stem or "lora"
        return re.sub(r"\W", "_", stem)

    def __post_init__(self):
        # checked here so every way of making one (API entries, --lora, swap_lora) is held to it;
        # values are not converted: a scale of "2" or True is a mistake to name, not a number to
        # guess. A path object is a path: kept as its text (frozen, hence object.__setattr__)
        if isinstance(self.source, os.PathLike):
            object.__setattr__(self, "source", os.fspath(self.source))
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"lora source {self.source!r}: a .safetensors path, a directory or a hub id (a string)")
        if not _finite_number(self.scale):
            raise ValueError(f"lora {self.source!r}: scale {self.scale!r} is not a finite number; pass e.g. 1.0 "
                             "(or 0.8 for a lighter merge)")
        if not isinstance(self.component, str):
            raise ValueError(f"lora {self.source!r}: component {self.component!r}; choices: {', '.join(COMPONENTS)}")

    def describe(self) -> str:
        where = "" if self.component == "transformer" else f" into {self.component}"
        return f"{self.source} (scale {self.scale:g}{where})"


def _finite_number(x: Any) -> bool:
    """An int or float that is finite (a bool is no number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def lora_specs(lora: Any, lora_scale: float = 1.0) -> list[LoraSpec]:
    """`load(lora=...)` as LoraSpecs. Each entry: a path or hub id (merged at `lora_scale`), a
    (source, scale) pair, a dict of LoraSpec fields, or a LoraSpec; one entry alone is accepted
    too. Per-LoRA scales multiply `lora_scale`."""
    if not _finite_number(lora_scale):
        raise ValueError(f"lora_scale={lora_scale!r}: a finite number (the strength every LoRA is merged at, e.g. 1.0)")
    if lora is None:
        if lora_scale != 1.0:
            raise ValueError(f"lora_scale={lora_scale!r} without lora=: it scales the LoRAs given in lora=[...]; "
                             "pass them, or drop lora_scale")
        return []
    if isinstance(lora, (str, os.PathLike, LoraSpec, Mapping)) or (isinstance(lora, tuple) and len(lora) == 2
                                                                    and isinstance(lora[1], (int, float))):
        lora = [lora]
    if not isinstance(lora, (list, tuple)):
        raise ValueError(f"lora={lora!r}: pass a path or hub id, a (path, scale) pair, a dict, or a list of them")
    out = []
    for item in lora:
        if isinstance(item, LoraSpec):
            spec = item
        elif isinstance(item, (str, os.PathLike)):
            spec = LoraSpec(item)
        elif isinstance(item, tuple) and len(item) == 2:
            spec = LoraSpec(item[0], item[1])
        elif isinstance(item, Mapping):
            bad = set(item) - {f.name for f in dataclasses.fields(LoraSpec)}
            if bad or "source" not in item:
                raise ValueError(f"lora entry {dict(item)!r}: takes the keys source (required), scale, component")
            spec = LoraSpec(item["source"], item.get("scale", 1.0), item.get("component", "transformer"))
        else:
            raise ValueError(f"lora entry {item!r}: pass a path or hub id, a (path, scale) pair or "
                             "{'source': ..., 'scale': ..., 'component': ...}")
        if spec.component not in COMPONENTS:
            raise ValueError(f"lora {spec.source!r}: component {spec.component!r}; choices: {', '.join(COMPONENTS)}")
        out.append(dataclasses.replace(spec, scale=spec.scale * float(lora_scale)))
    names = [s.name + s.component for s in out]
    dup = sorted({s.source for s in out if names.count(s.name + s.component) > 1})
    if dup:
        raise ValueError(f"lora {', '.join(dup)} given twice (or two files with one name); give each once, with "
                         "its scale")
    return out


def parse_cli(text: str) -> LoraSpec:
    """`--lora [COMPONENT=]PATH[:SCALE]`: e.g. `distill.safetensors`, `style.safetensors:0.8`,
    `transformer_2=low_noise.safetensors:1.0` (Wan2.2 A14B's low-noise expert)."""
    component, sep, rest = text.partition("=")
    if not sep or component not in COMPONENTS:
        component, rest = "transformer", text
    source, colon, scale = rest.rpartition(":")
    if colon:
        try:
            value = float(scale)
        except ValueError:
            if not Path(rest).exists():  # a ':' inside an existing path is the path's own; otherwise a bad scale
                raise ValueError(f"--lora {text!r}: no file {rest!r}, and {scale!r} after the last ':' is not a "
                                 "scale (a number): expected [COMPONENT=]PATH[:SCALE], e.g. --lora style.safetensors:0.8"
                                 ) from None
            source, value = rest, 1.0
    else:
        source, value = rest, 1.0
    if not source:
        raise ValueError(f"--lora {text!r}: expected [COMPONENT=]PATH[:SCALE], e.g. --lora style.safetensors:0.8")
    try:
        return LoraSpec(source, value, component)
    except ValueError as e:
        raise ValueError(f"--lora {text!r}: {e}") from None


def require_peft() -> None:
    """peft is the LoRA backend of diffusers; without it, a clear error before anything loads."""
    try:
        import peft  # noqa: F401  # lazy: an optional dependency (the `lora` extra)
    except ImportError:
        raise ValueError(f"LoRA needs peft, which is not installed: {INSTALL}") from None


def check_source(spec: LoraSpec) -> tuple[str, dict[str, Any]]:
    """(what to hand diffusers' `lora_state_dict`, its keyword arguments) for a LoRA source;
    a missing local file is an error now."""
    path = Path(spec.source).expanduser()
    if path.is_file():
        return str(path), {}
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise ValueError(f"lora {spec.source!r}: a directory with {len(files)} .safetensors files; pass the file "
                             f"itself{': ' + ', '.join(f.name for f in files[:6]) if files else ''}")
        return str(files[0]), {}
    parts = spec.source.split("/")
    looks_local = spec.source.startswith((".", "/", "~")) or spec.source.endswith((".safetensors", ".bin")) and len(parts) < 3
    if looks_local or len(parts) < 2:
        raise ValueError(f"lora {spec.source!r}: no such file; pass a LoRA .safetensors file or a hub id "
                         "('org/name' or 'org/name/file.safetensors')")
    repo, rest = "/".join(parts[:2]), parts[2:]
    kw: dict[str, Any] = {}
    if rest:
        kw["weight_name"] = rest[-1]
        if len(rest) > 1:
            kw["subfolder"] = "/".join(rest[:-1])
    return repo, kw


def family_of(keys: Iterable[str]) -> str | None:
    """What a LoRA's keys look like it was made for (None: not recognised)."""
    text = "\n".join(list(keys)[:200])
    for family, pattern in _SIGNATURES:
        if pattern.search(text):
            return family
    return None


def read(spec: LoraSpec, pipeline_cls: type, model_name: str) -> ConvertedLora:
    """The LoRA's state dict in diffusers' names, by the pipeline's own `lora_state_dict`
    (which converts the non-diffusers layouts), with the full deltas it left out. A file it
    cannot convert is an error naming what the file looks like."""
    source, kw = check_source(spec)
    raw_keys: list[str] = []
    if Path(source).is_file():
        from safetensors import safe_open  # lazy: only a local LoRA file is opened here

        try:
            with safe_open(source, framework="pt") as f:
                raw_keys = list(f.keys())
        except Exception as e:  # safetensors raises its own error type for a file that is not safetensors
            raise ValueError(f"lora {spec.source!r}: not a readable .safetensors file ({type(e).__name__}: "
                             f"{' '.join(str(e).split())}); LoRAs load from .safetensors") from None
        if not raw_keys:
            raise ValueError(f"lora {spec.source!r}: the file holds no tensors")
    try:
        state = pipeline_cls.lora_state_dict(source, local_files_only=Path(source).is_file() or None, **kw)
    except (KeyError, IndexError, ValueError, RuntimeError, AttributeError, OSError) as e:
        if not raw_keys:  # a hub id: not in the local hub cache, and not downloadable from here
            raise ValueError(f"lora {spec.source!r}: no such local file, and as a hub id ({source}"
                             f"{', ' + kw['weight_name'] if 'weight_name' in kw else ''}) it is not in the local hub "
                             f"cache and cannot be fetched ({type(e).__name__}); download the .safetensors file and "
                             "pass its path") from None
        looks = family_of(raw_keys)
        what = f"its keys look like a {looks} LoRA" if looks else "its keys are in no layout diffusers converts"
        raise ValueError(f"lora {spec.source!r} cannot be read as a LoRA for {model_name}: {what} (e.g. "
                         f"{raw_keys[0] if raw_keys else '?'!r}); diffusers' {pipeline_cls.__name__}.lora_state_dict "
                         f"said {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if isinstance(state, tuple):  # (state dict, network alphas / metadata) in some loaders
        state = state[0]
    return with_deltas(ConvertedLora(state), source, kw)


def _module_of(key: str) -> tuple[str, str] | None:
    """('<component>', 'path.to.linear') of a converted key such as
    'transformer.blocks.0.attn1.to_q.lora_A.weight'; None for a key that is not a LoRA matrix."""
    m = re.match(r"^(\w+)\.(.+?)\.lora_(A|B|up|down)(\.[\w]+)?\.(weight|bias)$", key)
    return (m.group(1), m.group(2)) if m else None


def check_fits(spec: LoraSpec, state: Mapping[str, torch.Tensor], model: nn.Module, model_name: str) -> int:
    """Each LoRA matrix names a linear of `model` (the component it goes into) at its shape:
    lora_A (rank, in_features), lora_B (out_features, rank). Returns the layers it adapts;
    a LoRA that matches nothing, or matches at other shapes (another size of the model), is a
    ValueError naming both."""
    modules = dict(model.named_modules())
    layers, missing, misshapen = set(), [], []
    for key, t in state.items():
        where = _module_of(key)
        if where is None:
            continue
        path = ".".join(where)
        mod = modules.get(path)
        if mod is None or not hasattr(mod, "in_features"):
            missing.append(path)
            continue
        a = ".lora_A." in key or ".lora_down." in key
        if key.endswith(".weight") and t.ndim == 2:
            want, got = (mod.in_features, t.shape[1]) if a else (mod.out_features, t.shape[0])
            if want != got:
                misshapen.append(f"{path} ({'in' if a else 'out'} {got}, the model's {want})")
                continue
        layers.add(path)
    linears = [p.partition(".")[2] for p, m in modules.items() if isinstance(m, nn.Linear)]
    example = next((p for p in linears if re.search(r"\.\d+\.", p)), linears[0] if linears else "?")  # a block's
    if not layers and not misshapen:
        keys = list(state)
        looks = family_of(keys)
        raise ValueError(f"lora {spec.source!r} matches no layer of {model_name}: "
                         + (f"its keys look like a {looks} LoRA" if looks else "its keys name other layers")
                         + f" (e.g. {keys[0] if keys else '(none)'!r}); {model_name}'s {spec.component} names its "
                         f"layers like {example!r}. Pass a LoRA made for {model_name}")
    if misshapen or missing:
        what = (f"{len(misshapen)} layer(s) at other shapes, e.g. {misshapen[0]}" if misshapen
                else f"{len(set(missing))} layer(s) {model_name} does not have, e.g. {missing[0]!r}")
        raise ValueError(f"lora {spec.source!r} does not fit {model_name}: {what} -- a LoRA for another model or "
                         f"size of it. Pass a LoRA made for {model_name}")
    return len(layers)


@dataclasses.dataclass
class LoraState:
    """What is loaded: the LoRAs, how (fused or hotswap), and how many layers each adapts."""

    specs: list[LoraSpec]
    layers: list[int]
    hotswap: bool = False
    deltas: list[str] = dataclasses.field(default_factory=list)  # per LoRA: its full deltas, in words

    def lines(self) -> list[str]:
        how = "hot-swappable (peft layers, scales as tensors)" if self.hotswap else "fused at load"
        extra = self.deltas or [""] * len(self.specs)
        return [f"LoRA {s.name}: {s.describe()}, {n} layers, {how}{e}"
                for s, n, e in zip(self.specs, self.layers, extra)]


def prepare(specs: list[LoraSpec], meta_native: Any, components: Mapping[str, nn.Module], model_name: str,
            ) -> list[ConvertedLora]:
    """Read and check every LoRA against the model's module tree (a meta-device build: no
    weights), before the real build: the state dicts, in order."""
    if not specs:
        return []
    require_peft()
    if not callable(getattr(meta_native, "load_lora_weights", None)):
        raise ValueError(f"{model_name} does not take LoRA: its pipeline ({type(meta_native).__name__}) has no "
                         "diffusers LoRA loader. LoRA works with the diffusers families (wan, wan22, flux)")
    out = []
    for spec in specs:
        target = components.get(spec.component)
        if target is None:
            raise ValueError(f"lora {spec.source!r}: {model_name} has no {spec.component} (components: "
                             f"{', '.join(components)})")
        state = read(spec, type(meta_native), model_name)
        # diffusers prefixes the denoiser's keys with "transformer." (load_into_transformer_2 reuses them)
        check_fits(spec, state, _prefixed(spec.component, target), model_name)
        check_deltas(spec.source, state, target, model_name)
        out.append(state)
    return out


def _prefixed(component: str, module: nn.Module) -> nn.Module:
    """`module` under the name diffusers' converted keys give it ('transformer.' for both denoisers)."""
    name = "transformer" if component == "transformer_2" else component
    return nn.ModuleDict({name: module})


def attach(native: Any, specs: list[LoraSpec], states: list[dict[str, torch.Tensor]], *,
           hotswap: bool | int = False) -> LoraState:
    """Load the checked LoRAs into the built pipeline. Fused: each one merged at its scale by
    diffusers' `fuse_lora`, then the peft layers unloaded. Hotswap: one LoRA, its peft layers
    kept, prepared by `enable_lora_hotswap` (target rank: `hotswap` if an int, else the
    LoRA's) so that `swap` later changes only tensors."""
    layers = [adapted_layers(s) for s in states]
    deltas = [describe_deltas(s) for s in states]
    if hotswap:
        if len(specs) != 1:
            raise ValueError(f"lora_hotswap keeps one LoRA slot; {len(specs)} LoRAs given (fuse several, "
                             "or swap one at a time)")
        rank = hotswap if isinstance(hotswap, int) and not isinstance(hotswap, bool) else max(_ranks(states[0]))
        refuse_deltas_for_hotswap([s.source for s in specs], states)
        native.enable_lora_hotswap(target_rank=rank)
        _load(native, specs[0], states[0], name="hotswap")
        _scale_in_place(native, specs[0], "hotswap")
        return LoraState(specs, layers, hotswap=True, deltas=deltas)
    # All loaded first, then merged per component at their scales: loading a LoRA activates it
    # alone (peft unmerges what was merged), so merging one at a time would lose the earlier ones.
    for spec, state in zip(specs, states):
        _load(native, spec, state, name=spec.name)
    for component in dict.fromkeys(s.component for s in specs):
        mine = [s for s in specs if s.component == component]
        getattr(native, component).set_adapters([s.name for s in mine], [s.scale for s in mine])
        native.fuse_lora(components=[component], lora_scale=1.0, adapter_names=[s.name for s in mine])
    native.unload_lora_weights()  # the merged weights stay; the peft layers go
    for spec, state in zip(specs, states):
        if getattr(state, "deltas", None):
            add_deltas(getattr(native, spec.component), state, spec.scale)
        if getattr(state, "unmapped", 0):  # in the report too; said now, where a user sees it
            warnings.warn(f"LoRA {spec.name}{describe_deltas(state)}", RuntimeWarning, stacklevel=2)
    return LoraState(specs, layers, deltas=deltas)


def swap(native: Any, state: LoraState, spec: LoraSpec, lora_state: dict[str, torch.Tensor]) -> None:
    """Replace the hot-swappable LoRA's weights in place (peft's hotswap through diffusers'
    `load_lora_weights(hotswap=True)`): a compiled model recompiles nothing."""
    if spec.component != state.specs[0].component:
        raise ValueError(f"swap_lora: the slot is in {state.specs[0].component}, not {spec.component}")
    refuse_deltas_for_hotswap([spec.source], [lora_state])
    _load(native, spec, lora_state, name="hotswap", hotswap=True)
    _scale_in_place(native, spec, "hotswap")
    state.specs = [spec]
    state.layers = [adapted_layers(lora_state)]
    state.deltas = [describe_deltas(lora_state)]


def adapted_layers(state: Mapping[str, torch.Tensor]) -> int:
    """How many layers a (converted) LoRA state dict adapts: its lora_A matrices."""
    return sum(1 for k in state if k.endswith((".lora_A.weight", ".lora_down.weight")))


def _load(native, spec: LoraSpec, state, *, name: str, hotswap: bool = False) -> None:
    kw = {"load_into_transformer_2": True} if spec.component == "transformer_2" else {}
    native.load_lora_weights(dict(state), adapter_name=name, hotswap=hotswap, **kw)


def _ranks(state: Mapping[str, torch.Tensor]) -> list[int]:
    return [t.shape[0] for k, t in state.items() if k.endswith((".lora_A.weight", ".lora_down.weight"))] or [1]


def _scale_in_place(native, spec: LoraSpec, name: str) -> None:
    """Multiply the slot's peft scalings by the user's scale in place: after
    `enable_lora_hotswap` they are tensors the compiled graph reads, so a new value is data,
    not a guard (a float would be a constant baked into the graph)."""
    if spec.scale == 1.0:
        return
    for m in getattr(native, spec.component).modules():
        scaling = getattr(m, "scaling", None)
        if isinstance(scaling, dict) and isinstance(scaling.get(name), torch.Tensor):
            scaling[name].mul_(spec.scale)
        elif isinstance(scaling, dict) and name in scaling:
            scaling[name] = scaling[name] * spec.scale


def check_for(adapter: Any, variant: Any, specs: list[LoraSpec], dtype: torch.dtype) -> list[ConvertedLora]:
    """`prepare` against the variant's module tree built on the meta device (no memory, no
    download): what `load` runs before the real build, so a LoRA that does not fit costs no
    weights read."""
    if not specs:
        return []
    require_peft()
    meta = adapter.build(variant, weights="random", dtype=dtype, device=torch.device("meta"))
    return prepare(specs, meta, adapter.components(meta), variant.name)
