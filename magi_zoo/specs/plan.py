"""Plans: which regions of a module tree get which settings, section by section.

A plan *layer* maps each section (`compile`, `attention`, ...; see `section.SECTIONS`) to
region keys, and each key to that section's spec -- or, for per-method sections such as
compile, to ``{method_name: spec}``::

    {"compile": {"transformer.blocks.*": {"fullgraph": True},          # glob over paths
                 "WanTransformerBlock": {"forward": {"dynamic": True}}, # class name, one method
                 "vae": {"decode": {"enabled": False}}},
     "attention": {"transformer": {"backend": "flash"}}}

A dict whose keys are not section names is shorthand for the compile section
(``{"blocks.*": {"fullgraph": True}}``). Keys are dotted submodule paths (``*`` matches one
path segment, ``**`` one or more), ``""`` for the root module, or a class name. Layers
stack with a fixed precedence -- user override > GPU section > model default > engine
default -- and are resolved against a real module tree by `magi_zoo.engine.resolve`.

Spec files are TOML: a ``[default.<section>]`` table per section, and per GPU profile
``[gpu.<profile>.<section>]`` tables; a GPU table may say ``inherits = "<profile>"`` to
start from another profile's table (see ``magi_zoo/specs/wan.toml``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .gpu_profiles import PROFILES
from .section import SECTIONS, Entry, SectionSpec, coerce_entry, did_you_mean, flat_error, section_class

# Layer names in increasing precedence; the resolver folds them in this order.
LAYER_ORDER = ("engine default", "model default", "gpu", "user")


def _is_sectioned(value: Mapping[str, Any]) -> bool:
    """True for {section: {...}}, False for compile shorthand; a mix is an error."""
    names = [k for k in value if k in SECTIONS]
    if names and len(names) != len(value):
        others = [k for k in value if k not in SECTIONS]
        raise ValueError(
            f"a plan mixes section names {names} with region keys {others}; either write every "
            f"region under its section ({', '.join(SECTIONS)}), or give only compile regions")
    return bool(names)


class PlanLayer(BaseModel):
    """One layer of a plan: section -> {region key -> spec or {method: spec}}.

    Build it as ``PlanLayer(compile={...}, attention={...})``, from a dict with
    `PlanLayer.coerce`, or from a spec file's table.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    sections: dict[str, dict[str, Entry]] = Field(
        default_factory=dict, description="section name -> {region key -> spec or {method: spec}}")

    @model_validator(mode="before")
    @classmethod
    def _sections_as_kwargs(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            raise ValueError(f"a plan layer is a mapping of section -> regions, got {type(data).__name__}")
        data = dict(data)
        if "regions" in data:
            raise ValueError("'regions' is now the 'compile' section: write compile={...} "
                             "(in TOML: [default.compile] instead of [default.regions])")
        sections = dict(data.pop("sections", None) or {})
        for name in list(data):
            if name in SECTIONS:
                sections[name] = data.pop(name)
        if data:
            unknown = sorted(data)
            raise ValueError(f"unknown plan section(s) {unknown}"
                             f"{did_you_mean(unknown[0], SECTIONS)}; sections: {', '.join(SECTIONS)}")
        out: dict[str, dict[str, Entry]] = {}
        for name, regions in sections.items():
            cls_ = section_class(name)
            if regions is None:
                continue
            if not isinstance(regions, Mapping):
                raise ValueError(f"section {name!r}: expected a mapping of region key -> spec, "
                                 f"got {type(regions).__name__}")
            out[name] = {str(k): coerce_entry(cls_, str(k), v) for k, v in regions.items()}
        return {"sections": out}

    @classmethod
    def coerce(cls, value: "PlanLayer | Mapping[str, Any] | None") -> "PlanLayer":
        """Accept a PlanLayer, a {section: regions} dict, a compile-only dict, or None."""
        if value is None:
            return cls()
        if isinstance(value, PlanLayer):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"a plan is a dict of {{section: {{key: spec}}}} or {{key: spec}}, "
                            f"got {type(value).__name__}")
        return cls(**value) if _is_sectioned(value) else cls(compile=value)

    def entries(self, section: str) -> dict[str, Entry]:
        """The region entries of one section (empty if the layer does not set it)."""
        section_class(section)
        return self.sections.get(section, {})

    def items(self, section: str) -> Iterator[tuple[str, str | None, SectionSpec]]:
        """(key, method, spec) triples of one section. Per-method sections give a method
        ('forward' for a bare spec); the others give None."""
        per_method = section_class(section).per_method
        for key, entry in self.entries(section).items():
            if isinstance(entry, SectionSpec):
                yield key, ("forward" if per_method else None), entry
            else:
                for method, spec in entry.items():
                    yield key, method, spec

    def items_by_method(self):
        """Compile-section triples (kept for callers that only compile)."""
        return self.items("compile")

    def merged_over(self, base: "PlanLayer") -> "PlanLayer":
        """This layer on top of `base`, field by field (what `inherits` does in spec files)."""
        out: dict[str, dict[str, Entry]] = {}
        for name in dict.fromkeys([*base.sections, *self.sections]):
            cls_ = section_class(name)
            merged: dict[str, dict[str | None, dict]] = {}
            for layer in (base, self):
                for key, method, spec in layer.items(name):
                    merged.setdefault(key, {}).setdefault(method, {}).update(spec.explicit())
            out[name] = {
                key: (cls_(**by_m[None]) if None in by_m
                      else {m: cls_(**f) for m, f in by_m.items()})
                for key, by_m in merged.items()
            }
        return PlanLayer(sections=out)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (explicit fields only), e.g. for printing or a cache key."""
        out: dict[str, Any] = {}
        for name, regions in self.sections.items():
            out[name] = {k: (e.explicit() if isinstance(e, SectionSpec) else {m: s.explicit() for m, s in e.items()})
                         for k, e in regions.items()}
        return out

    def __bool__(self) -> bool:
        return any(self.sections.values())


# Inductor options a spec FILE may not set: each names a program, a library, a path, or
# pastes raw text onto a compiler command line (from which `-fplugin=...` / `-B<dir>`
# would load any code). A spec file is data -- reading one must never decide what runs
# or where files go -- so these come only from Python, where the caller is already
# running code: `magi_zoo.load(..., compile={key: {"options": {...}}})` or
# `magi_zoo.apply(module, plan)`. Read from torch/_inductor/config.py (torch 2.11 and
# 2.13; `debug_dir` is the name some versions' docs use for `trace.debug_dir`);
# `_REFUSED_SUFFIXES` also catches options of those kinds that a later torch adds.
REFUSED_FILE_OPTIONS: dict[str, str] = {
    # programs and the libraries linked into generated code
    "cpp.cxx": "the C++ compiler to run",
    "cuda.cuda_cxx": "the CUDA compiler (nvcc) to run",
    "aot_inductor.custom_op_libs": "libraries to link",
    "aot_inductor.aoti_shim_library": "a library to link",
    "aot_inductor.aoti_shim_library_path": "a library directory",
    # text pasted onto the compiler's command line
    "cpp.march": "a compiler flag",
    "cpp.enable_floating_point_contract_flag": "a compiler flag",
    "aot_inductor.compile_wrapper_opt_level": "a compiler flag",
    "cuda.compile_opt_level": "a compiler flag",
    "cutlass.compile_opt_level": "a compiler flag",
    "xpu.compile_opt_level": "a compiler flag",
    "rocm.compile_opt_level": "a compiler flag",
    # directories and files read or written (headers found there are compiled in)
    "debug_dir": "a debug output directory",
    "trace.debug_dir": "a debug output directory",
    "global_cache_dir": "a cache directory",
    "cuda.cutlass_dir": "a source directory compiled in",
    "cutlass.cutlass_dir": "a source directory compiled in",
    "xpu.cutlass_dir": "a source directory compiled in",
    "xpu.oneapi_root": "a toolchain directory",
    "rocm.rocm_home": "a toolchain directory",
    "rocm.ck_dir": "a source directory compiled in",
    "aot_inductor.output_path": "an output path",
    "aot_inductor.model_name_for_generated_files": "an output file name",
    "triton.proton_output_dir": "an output directory",
    "profile_bandwidth_output": "an output file",
    "autoheuristic_log_path": "a log file",
    "worker_log_path": "a log file",
    "torchinductor_worker_logpath": "a log file",
    "aten_distributed_optimizations.profile_guided_estimations_profile_path": "an input file",
    # test-only switches that make generated code wrong on purpose
    "cpp.inject_relu_bug_TESTING_ONLY": "a deliberate miscompile (testing only)",
    "cpp.inject_log1p_bug_TESTING_ONLY": "a deliberate miscompile (testing only)",
    "triton.inject_relu_bug_TESTING_ONLY": "a deliberate miscompile (testing only)",
}
_REFUSED_SUFFIXES = {"_dir": "a directory", "_path": "a path", "logpath": "a log file", "_root": "a directory",
                     "_home": "a directory", "_cxx": "a compiler to run", "_libs": "libraries to link",
                     "_library": "a library to link", "_TESTING_ONLY": "a testing-only switch"}


def flat_options(options: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Inductor option names in `options`, nested tables flattened ("triton.cudagraphs")."""
    # TOML's `options = { cpp.cxx = "..." }` (unquoted dotted key) is a nested table; name
    # it as inductor does, "cpp.cxx". Inductor also reads '-' as '_'.
    for k, v in options.items():
        name = f"{prefix}{str(k).replace('-', '_')}"
        if isinstance(v, Mapping):
            yield from flat_options(v, f"{name}.")
        yield name


def refused_file_option(name: str) -> str | None:
    """Why a spec file may not set inductor option `name` (None if it may)."""
    if name in REFUSED_FILE_OPTIONS:
        return REFUSED_FILE_OPTIONS[name]
    leaf = name.rsplit(".", 1)[-1]
    return next((why for suffix, why in _REFUSED_SUFFIXES.items() if leaf.endswith(suffix)), None)


def _check_file_options(layer: "PlanLayer", where: str) -> None:
    """Refuse `REFUSED_FILE_OPTIONS` in a layer read from a spec file."""
    for key, method, spec in layer.items("compile"):
        for name in flat_options(spec.options or {}):
            why = refused_file_option(name)
            if why is not None:
                at = key if method == "forward" else f"{key}.{method}"
                raise ValueError(
                    f"{where}: region {at!r} sets inductor option {name!r} ({why}); a spec file is data "
                    "and may not name programs, libraries, compiler flags or paths; such options are allowed "
                    f"only from Python: magi_zoo.load(..., compile={{{key!r}: {{'options': {{{name!r}: ...}}}}}}) "
                    "or magi_zoo.apply(module, plan)")


class SpecFile(BaseModel):
    """A model's spec file: a default layer plus one layer per GPU profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: PlanLayer = Field(default_factory=PlanLayer, description="applies on every GPU")
    gpu: dict[str, PlanLayer] = Field(default_factory=dict,
                                      description="profile name -> layer (inheritance already applied)")
    source: str | None = Field(None, description="where it was read from")

    @classmethod
    def from_toml(cls, path: str | Path) -> "SpecFile":
        """Read and validate a spec TOML file (`[default.<section>]`, `[gpu.<profile>.<section>]`)."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"spec file {str(path)!r} is a directory; pass a TOML file (e.g. a copy of "
                             "magi_zoo/specs/wan.toml)")
        if not path.is_file():
            raise FileNotFoundError(f"spec file {str(path)!r} does not exist")
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"spec file {str(path)!r} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"spec file {str(path)!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                             f"offset {e.start}); a spec file is a TOML text file") from None
        except OSError as e:
            raise ValueError(f"spec file {str(path)!r} cannot be read: {e.strerror or e}") from None
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "SpecFile":
        """Validate a spec file's parsed tables. A spec file is data: inductor options that
        name programs or paths (`REFUSED_FILE_OPTIONS`) are refused here and allowed only
        from Python (`load(..., compile=...)`, `apply`)."""
        where = f"spec file {source!r}" if source else "spec"
        unknown = set(data) - {"default", "gpu"}
        if unknown:
            raise ValueError(f"{where}: unknown top-level tables {sorted(unknown)}; "
                             "valid: [default] and [gpu.<profile>]")
        for top in ("default", "gpu"):
            if top in data and not isinstance(data[top], Mapping):
                raise ValueError(f"{where}: '{top}' must be a table ([{top}...]), got {type(data[top]).__name__} "
                                 f"{data[top]!r}")
        gpus = dict(data.get("gpu", {}))
        for name, table in gpus.items():
            if not isinstance(table, Mapping):
                raise ValueError(f"{where}: 'gpu.{name}' must be a table ([gpu.{name}.<section>]), got "
                                 f"{type(table).__name__} {table!r}")
            if name not in PROFILES:
                raise ValueError(f"{where}: [gpu.{name}] is not a GPU profile{did_you_mean(name, PROFILES)}; "
                                 f"valid: {', '.join(PROFILES)}")

        def section(name: str, table: Any, allow_inherits: bool) -> tuple[PlanLayer, str | None]:
            table = dict(table or {})
            parent = table.pop("inherits", None) if allow_inherits else None
            if parent is not None and not isinstance(parent, str):
                raise ValueError(f"{where}: [{name}] inherits must be a profile name (a string), got "
                                 f"{type(parent).__name__} {parent!r}")
            if parent is not None and parent not in gpus:
                raise ValueError(f"{where}: [{name}] inherits = {parent!r}, which is not a [gpu.<profile>] "
                                 f"table of this file{did_you_mean(parent, set(gpus) | set(PROFILES))}; tables: {', '.join(gpus)}")
            bad = [k for k in table if k not in SECTIONS]
            if bad:
                hint = " ('regions' is now 'compile')" if "regions" in bad else did_you_mean(bad[0], SECTIONS)
                raise ValueError(f"{where}: [{name}] has unknown keys {sorted(bad)}{hint}; valid: "
                                 f"{', '.join(SECTIONS)}{', inherits' if allow_inherits else ''} "
                                 f"(region keys go under [{name}.<section>])")
            try:
                layer = PlanLayer(**table)
            except ValueError as e:
                raise ValueError(f"{where}, [{name}]: {flat_error(e)}") from None
            _check_file_options(layer, f"{where}, [{name}.compile]")
            return layer, parent

        default, _ = section("default", data.get("default"), allow_inherits=False)
        own = {k: section(f"gpu.{k}", v, allow_inherits=True) for k, v in gpus.items()}

        def resolved(name: str, seen: tuple[str, ...] = ()) -> PlanLayer:
            if name in seen:
                raise ValueError(f"{where}: inheritance cycle {' -> '.join((*seen, name))}")
            layer, parent = own[name]
            return layer if parent is None else layer.merged_over(resolved(parent, (*seen, name)))

        spec = cls(default=default, gpu={k: resolved(k) for k in own}, source=source)
        if not spec.default and not any(spec.gpu.values()):
            raise ValueError(f"{where} sets no region in any section, so it would change nothing (an empty "
                             "compile section compiles the whole model at torch.compile's defaults); a minimal "
                             "spec file is a section table with one region key, e.g. the two lines "
                             "'[default.compile]' and '\"transformer.blocks.*\" = { fullgraph = true }' "
                             f"(sections: {', '.join(SECTIONS)}; the shipped files are magi_zoo/specs/*.toml)")
        return spec

    def layers_for(self, gpu: str | None) -> list[tuple[str, PlanLayer]]:
        """The (layer name, layer) pairs this file contributes for one GPU profile."""
        layers = [("model default", self.default)]
        if gpu is not None and gpu in self.gpu:
            layers.append(("gpu", self.gpu[gpu]))
        return layers


def as_layers(plan: Any, gpu: str | None = None) -> list[tuple[str, PlanLayer]]:
    """Normalise anything a user may pass as a plan into ordered layers.

    Accepts a `PlanLayer`, a dict, a `SpecFile`, or a path to a TOML spec file (a path's
    `[default]` and `[gpu.<gpu>]` layers are used).
    """
    if isinstance(plan, SpecFile):
        return plan.layers_for(gpu)
    if isinstance(plan, (str, Path)):
        return SpecFile.from_toml(plan).layers_for(gpu)
    return [("user", PlanLayer.coerce(plan))]


def with_backend(layers: list[tuple[str, PlanLayer]], backend: str) -> list[tuple[str, PlanLayer]]:
    """The same layers with every compile spec's backend set to `backend` (e.g. "eager" or
    "aot_eager" for tests and probes that check plumbing, not generated code)."""
    cls_ = section_class("compile")
    out = []
    for name, layer in layers:
        sections = dict(layer.sections)
        if "compile" in sections:
            sections["compile"] = {
                key: (cls_(**{**e.explicit(), "backend": backend}) if isinstance(e, SectionSpec)
                      else {m: cls_(**{**s.explicit(), "backend": backend}) for m, s in e.items()})
                for key, e in sections["compile"].items()}
        out.append((name, PlanLayer(sections=sections)))
    return out

