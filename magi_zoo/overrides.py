"""What a user asks for at load time, turned into plan layers: the one path from
`magi_zoo.load`'s arguments and the CLI's flags to the layers the engine applies.

`user_layer` builds the one ``user`` layer; `spec_layers` puts it on the spec file's layers
for a profile (``model default``, ``gpu``) and is what `load` and every CLI command call. The
user layer is built in this order:

1. `overrides`: any section, ``{section: {key: spec}}`` (or compile shorthand);
2. `compile`: compile overrides ``{key: spec}`` (False / None / True add nothing);
3. `precision`: the matmul format on every region the precision section declares;
4. `parallel`: ParallelSpec fields on every region the parallel section declares;
5. training (`train` / `recompute`): the recompute policy on every region the recompute
   section declares;
6. `memory_budget_gib`: the offload plan's device memory budget (its root key ``""``).

Each later step merges over the earlier ones field by field, so a named argument beats the
same field in `overrides`; steps 2-6 set different sections (or fields) and never meet.
Steps 3-6 set only the regions the spec declares for them: a spec with none refuses the
argument, since the model's spec does not say which of its modules may change.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Mapping

from .specs import MATMUL_FORMATS, PlanLayer, SpecFile
from .specs.plan import flat_options
from .specs.gpu_profiles import GpuProfile
from .specs.recompute_spec import with_recompute
from .specs.section import flat_error

Layers = list[tuple[str, PlanLayer]]

DEFAULT_RECOMPUTE = "full"  # train=True without recompute=: what always fits one block at a time


def spec_layers(adapter: Any, profile: GpuProfile, *, spec_file: str | Path | None = None,
                **user: Any) -> Layers:
    """The layers one load applies: the spec file's for `profile` (`spec_file`, default the
    shipped `adapter.spec_path()`), then the `user_layer` built from the other keyword
    arguments (those of `user_layer`) when it sets anything."""
    layers = SpecFile.from_toml(spec_file if spec_file is not None else adapter.spec_path()).layers_for(profile.name)
    top = user_layer(layers, profile, **user)
    out = [*layers, ("user", top)] if top else layers
    check_plan_names(out)
    return out


def check_plan_names(layers: Layers) -> None:
    """The names a plan gives to libraries, checked before anything is built: each attention
    backend against the engine's and diffusers' names, each compile backend against
    torch.compile's registry, each inductor option against inductor's config. The steps would
    meet a typo only after the build (torch.compile checks its options when it wraps a region)."""
    # lazy: the engine's names need diffusers and torch's dynamo, which a spec read alone does not
    from .engine.attention import check_name
    from .engine.compat import torch as torch_compat  # lazy: as above

    backends = None
    for layer_name, layer in layers:
        where = "your overrides" if layer_name == "user" else f"the spec's {layer_name} layer"
        for key, _, spec in layer.items("attention"):
            if spec.backend is not None and spec.backend != "auto":
                try:
                    check_name(spec.backend)
                except ValueError as e:
                    raise ValueError(f"[attention] {key!r} in {where}: {e}") from None
        for key, method, spec in layer.items("compile"):
            at = key if method == "forward" else f"{key}.{method}"
            if "backend" in spec.explicit():
                backends = backends or torch_compat.compile_backends()
                if spec.backend not in backends:
                    close = difflib.get_close_matches(spec.backend, backends, n=1)
                    raise ValueError(f"[compile] {at!r} in {where}: backend {spec.backend!r} is not a torch.compile "
                                     f"backend{f' -- did you mean {close[0]!r}?' if close else ''}; e.g. 'inductor', "
                                     "'aot_eager', 'eager'")
            if spec.options and spec.backend == "inductor":
                bad = [name for name in flat_options(spec.options) if not torch_compat.inductor_has_option(name)]
                if bad:
                    raise ValueError(f"[compile] {at!r} in {where}: {', '.join(map(repr, bad))} "
                                     f"{'is not an inductor option' if len(bad) == 1 else 'are not inductor options'} "
                                     "(torch._inductor.config names them, e.g. 'max_autotune', 'triton.cudagraphs')")


def user_layer(base: Layers, profile: GpuProfile, *, compile: Any = None, overrides: Any = None,
               precision: str | None = None, parallel: Mapping[str, Any] | None = None, train: bool = False,
               recompute: Any = None, memory_budget_gib: float | None = None) -> PlanLayer:
    """The user layer over `base` (the spec file's layers, which say the regions each named
    argument may set), built in the module's documented order. The arguments mean what they
    mean to `magi_zoo.load`."""
    if any(name == "user" for name, _ in base):
        raise ValueError("user_layer builds the user layer: pass the layers below it (model default, gpu) as base")
    layers = list(base)
    top = _compile_over(PlanLayer.coerce(overrides), compile)
    if top:
        layers.append(("user", top))
    if precision is not None:
        if precision not in MATMUL_FORMATS:
            raise ValueError(f"precision={precision!r}; choices: {', '.join(MATMUL_FORMATS)}")
        if precision == "fp8" and not profile.fp8:
            raise ValueError(f"precision='fp8' needs a card with fp8 matmuls (Hopper, Ada, Blackwell); "
                             f"profile {profile.name!r} has none")
        layers = with_precision(layers, precision)
    if parallel is not None:
        if compile is False:
            raise ValueError("parallel= splits regions of the plan, which compile=False does not apply; for eager "
                             "regions pass a compile override that disables them (magi_zoo.overrides.eager_compile)")
        layers = with_parallel(layers, parallel)
    if recompute is not None and (not train or compile is False):
        raise ValueError("recompute= sets activation recompute for training: pass train=True (and not compile=False, "
                         "which applies no plan; for eager blocks use compile={'<Block>': {'enabled': False}})")
    if train and compile is not False:
        layers = training_layers(layers, recompute)
    if memory_budget_gib is not None:
        layers = with_memory_budget(layers, memory_budget_gib)
    return layers[-1][1] if len(layers) > len(base) else PlanLayer()


def _compile_over(user: PlanLayer, compile: Any) -> PlanLayer:
    """`compile` (a compile override, or None / True / False: nothing to add) on top of `user`."""
    if isinstance(compile, PlanLayer):
        return compile.merged_over(user)
    if isinstance(compile, Mapping):
        return PlanLayer(compile=compile).merged_over(user)
    if not any(compile is v for v in (None, True, False)):  # identity: 0 == False and 1 == True, but mean neither
        raise TypeError(
            "compile= takes None/True (use the spec), False (run eager), or a compile override "
            f"{{submodule key: spec}}; got {type(compile).__name__} {compile!r}"
        )
    return user


def _on_top(layers: Layers, top: PlanLayer) -> Layers:
    """`layers` with `top` merged over their user layer (or added as the user layer)."""
    if layers and layers[-1][0] == "user":
        return [*layers[:-1], ("user", top.merged_over(layers[-1][1]))]
    return [*layers, ("user", top)]


def _declared(layers: Layers, section: str) -> list[str]:
    """The region keys any layer names in `section`, first mention first."""
    return list(dict.fromkeys(key for _, layer in layers for key in layer.entries(section)))


def fp8_region_keys(layers: Layers) -> list[str]:
    """The precision regions any layer names with a `matmul` (first mention first): the regions a
    spec file declares eligible for fp8. A region listed only for its fusions (the Wan VAE's
    `fuse_norm_act`) is not one."""
    return list(dict.fromkeys(key for _, layer in layers for key, _, spec in layer.items("precision")
                              if "matmul" in spec.model_fields_set))


def with_precision(layers: Layers, matmul: str) -> Layers:
    """The layers plus a user layer setting `matmul` and `attention` on every region the
    precision section names with a `matmul` in any layer (the regions a spec file declares eligible; a
    region listed only for its fusions is not one). No such region is an error: the model's spec does
    not say which of its matmuls may change format."""
    keys = fp8_region_keys(layers)
    if not keys:
        raise ValueError(f"precision={matmul!r}: this spec declares no fp8 regions (no [*.precision] key names a "
                         "`matmul`), so no matmul may change format. A spec that lists its blocks for their "
                         "fusions only says in its comment why fp8 is not offered (`magi-zoo spec MODEL` names "
                         "the file); to declare a region, add e.g. `Block = { matmul = \"bf16\" }` under "
                         "[default.precision]")
    return _on_top(layers, PlanLayer(precision={k: {"matmul": matmul, "attention": matmul} for k in keys}))


def with_parallel(layers: Layers, fields: Mapping[str, Any]) -> Layers:
    """The layers plus a user layer setting `fields` (ParallelSpec fields) on every region the
    parallel section names in any layer (the regions a spec file declares parallelisable).
    No such region is an error: the model's spec does not say what may be split."""
    keys = _declared(layers, "parallel")
    if not keys:
        raise ValueError("this model's spec declares no [*.parallel] region, so nothing can be spread over "
                         "processes; add e.g. `Transformer = { cfg = false }` under [default.parallel] for the "
                         "denoiser (multi-process inference covers diffusers transformers: Wan, Flux)")
    try:
        top = PlanLayer(parallel={k: dict(fields) for k in keys})
    except ValueError as e:  # pydantic's error, one line, naming the argument (a typo'd field, a bad value)
        raise ValueError(f"parallel={dict(fields)!r}: {flat_error(e)}") from None
    return _on_top(layers, top)


def training_layers(layers: Layers, recompute: Any) -> Layers:
    """`layers` with the recompute policy (`recompute`, default `DEFAULT_RECOMPUTE`) on every
    region the spec declares in its recompute section (the repeated blocks)."""
    return with_recompute(layers, DEFAULT_RECOMPUTE if recompute is None else recompute)


def with_memory_budget(layers: Layers, gib: float) -> Layers:
    """The layers plus a user layer setting the offload plan's budget (root key "") to `gib`:
    what `load(..., memory_budget_gib=...)` and `magi-zoo run --memory-budget` add."""
    if not isinstance(gib, (int, float)) or isinstance(gib, bool) or not 0 < gib < float("inf"):
        raise ValueError(f"memory_budget_gib must be a positive, finite number of GiB, got {gib!r} (for no budget, "
                         "leave it out)")
    if not any(layer.entries("offload") for _, layer in layers):
        raise ValueError("memory_budget_gib: this spec names no [*.offload] units, so nothing may stream; add "
                         "e.g. `Block = \"auto\"` under [default.offload] for the repeated blocks")
    return _on_top(layers, PlanLayer(offload={"": {"memory_budget_gib": float(gib)}}))


def has_auto_recompute(layers: Layers) -> bool:
    """Whether any layer sets recompute policy 'auto' (measured at load, or by `train.calibrate`)."""
    return any(spec.policy == "auto" for _, layer in layers for _, _, spec in layer.items("recompute"))


def eager_compile(spec: SpecFile) -> dict[str, dict[str, dict[str, bool]]]:
    """A compile override disabling every compile key of `spec` (any of its tables): the plan
    still applies (its parallel split, say) with every region eager. `compile=False` would
    apply no plan at all."""
    off: dict[str, dict[str, dict[str, bool]]] = {}
    for layer in (spec.default, *spec.gpu.values()):
        for key, method, _ in layer.items("compile"):
            off.setdefault(key, {})[method] = {"enabled": False}
    return off


def name_plan_source(error: ValueError, spec_file: str | Path, profile: str, *, shipped: bool) -> ValueError:
    """`error` (a `PlanError`: a plan key that matches nothing) with where the key was written
    and what to do: the spec file's table for the spec's layers (`[default.<section>]`,
    `[gpu.<profile>.<section>]`), the caller's arguments for the user layer. The resolver
    knows the layer, not the file: the caller names it."""
    layer, section = getattr(error, "layer", None), getattr(error, "section", None)
    fix = ("the shipped spec fits the published module tree, so these weights are likely not this model's; "
           "check --weights, or pass a corrected copy of the file with --spec-file / spec_file="
           if shipped else "fix or remove the key there")
    if layer == "user":
        where = "it comes from your overrides (--compile / --step-cache, or load's compile= / overrides=); fix that key"
    elif layer in ("model default", "gpu") and section:
        table = f"[default.{section}]" if layer == "model default" else f"[gpu.{profile}.{section}] (or a table it inherits)"
        where = f"it comes from {table} of the spec file {str(spec_file)!r}: {fix}"
    else:
        where = f"the key comes from the spec file {str(spec_file)!r} or your overrides: {fix}"
    return type(error)(f"{error} ({where})", layer=layer, section=section)


# The offload reserve over an activation estimate: +25%, at least +0.25 GiB (what `offload.refit`
# adds to a measured peak: the estimate counts tensors, not the allocator's rounding and caching).
RESERVE_MARGIN = 0.25
RESERVE_FLOOR_GIB = 0.25


def reserve_gib(estimate_gib: float) -> float:
    """The reserve for an estimated activation peak: max(estimate x 1.25, estimate + 0.25 GiB)."""
    return round(max(estimate_gib * (1 + RESERVE_MARGIN), estimate_gib + RESERVE_FLOOR_GIB), 3)


def reserve_section(layers: Layers, estimate: Mapping[str, float] | None) -> dict[str, dict[str, float]]:
    """The offload section that sizes the activation reserves from `estimate` ({offload key:
    GiB}, an adapter's `activation_estimate` for the call's shape: "" the plan-wide
    `activation_gib`, a unit key its phase's `phase_activation_gib`), each `reserve_gib(estimate)`,
    replacing the spec's fixed numbers. Keys the spec's offload section does not name, and
    reserves the user layer already sets (an override, or the CLI's estimate for its own
    shape), are left out; {} when the spec has no offload section."""
    declared = set(_declared(layers, "offload"))
    if not estimate or not declared:
        return {}
    mine = {key: spec.explicit() for name, layer in layers if name == "user" for key, _, spec in layer.items("offload")}
    section: dict[str, dict[str, float]] = {}
    for key, gib in estimate.items():
        field = "activation_gib" if key == "" else "phase_activation_gib"
        if (key != "" and key not in declared) or field in mine.get(key, {}):
            continue
        section[key] = {field: reserve_gib(gib)}
    return section


def activation_reserves(layers: Layers, estimate: Mapping[str, float] | None) -> Layers:
    """`layers` with `reserve_section(layers, estimate)` merged over their user layer (what
    `load` does with the adapter's estimate at the call defaults' shape)."""
    section = reserve_section(layers, estimate)
    return _on_top(layers, PlanLayer(offload=section)) if section else layers
