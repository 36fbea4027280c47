"""Plans: which regions of a module tree get which `TorchCompileSpec`.

A plan *layer* maps a submodule key to a spec, or to ``{method_name: spec}``::

    {"transformer.blocks.*": TorchCompileSpec(fullgraph=True),      # glob over paths
     "WanTransformerBlock": {"forward": TorchCompileSpec(dynamic=True)},  # class name
     "vae": {"decode": {"enabled": False}}}                           # plain dicts work too

Keys are dotted submodule paths (``*`` matches one path segment, ``**`` one or more),
``""`` for the root module, or a class name. Several layers are stacked with a fixed
precedence -- user override > GPU section > model default > engine default -- and
resolved against a real module tree by `magi_zoo.engine.resolve`.

Spec files are TOML with a ``[default]`` table and one ``[gpu.<profile>]`` table per GPU
profile; see ``magi_zoo/specs/wan.toml``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .compile_spec import TorchCompileSpec

# Layer names in increasing precedence; the resolver folds them in this order.
LAYER_ORDER = ("engine default", "model default", "gpu", "user")

_SPEC_FIELDS = frozenset(TorchCompileSpec.model_fields)

Entry = Union[TorchCompileSpec, dict[str, TorchCompileSpec]]


def _coerce_entry(key: str, value: Any) -> Entry:
    """A spec, or {method: spec}. Plain dicts are told apart by their keys."""
    if isinstance(value, TorchCompileSpec):
        return value
    if isinstance(value, bool):
        # `"vae": False` is shorthand for enabled=False; True for the default spec.
        return TorchCompileSpec(enabled=value)
    if not isinstance(value, Mapping):
        raise ValueError(
            f"plan key {key!r}: expected a TorchCompileSpec, a dict of its fields, or "
            f"{{method_name: spec}}; got {type(value).__name__}"
        )
    keys = set(value)
    if keys <= _SPEC_FIELDS:
        return TorchCompileSpec(**value)
    # A dict mixing spec fields with other names is a typo'd spec, never a method table
    # (methods named like spec fields are not supported).
    if keys & _SPEC_FIELDS:
        unknown = sorted(keys - _SPEC_FIELDS)
        raise ValueError(
            f"plan key {key!r}: {unknown} are not TorchCompileSpec fields "
            f"(valid: {', '.join(sorted(_SPEC_FIELDS))}); for per-method specs write "
            f"{{method_name: {{...}}}} with a dict for every method"
        )
    out: dict[str, TorchCompileSpec] = {}
    for method, spec in value.items():
        if isinstance(spec, bool):
            spec = TorchCompileSpec(enabled=spec)
        elif isinstance(spec, Mapping):
            spec = TorchCompileSpec(**spec)
        elif not isinstance(spec, TorchCompileSpec):
            raise ValueError(
                f"plan key {key!r}, method {method!r}: expected a spec or dict of its fields, "
                f"got {type(spec).__name__}"
            )
        out[str(method)] = spec
    return out


class PlanLayer(BaseModel):
    """One layer of a plan: submodule key -> spec or {method: spec}."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    regions: dict[str, Entry] = Field(default_factory=dict, description="key -> spec or {method: spec}")
    attention_backend: str | None = Field(
        None, description="diffusers attention backend for every model that supports it "
        "(e.g. '_native_cudnn', 'flash', 'native'); None leaves the library default")

    @field_validator("regions", mode="before")
    @classmethod
    def _coerce(cls, v: Any) -> dict[str, Entry]:
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            raise ValueError(f"a plan is a mapping of submodule key -> spec, got {type(v).__name__}")
        return {str(k): _coerce_entry(str(k), val) for k, val in v.items()}

    @classmethod
    def coerce(cls, value: "PlanLayer | Mapping[str, Any] | None") -> "PlanLayer":
        """Accept a PlanLayer, a plain dict of regions, or None."""
        if value is None:
            return cls()
        if isinstance(value, PlanLayer):
            return value
        return cls(regions=value)

    def items_by_method(self):
        """Yield (key, method, spec) triples; a bare spec means method 'forward'."""
        for key, entry in self.regions.items():
            if isinstance(entry, TorchCompileSpec):
                yield key, "forward", entry
            else:
                for method, spec in entry.items():
                    yield key, method, spec

    def __bool__(self) -> bool:
        return bool(self.regions) or self.attention_backend is not None


class SpecFile(BaseModel):
    """A model's spec file: a default layer plus one layer per GPU profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: PlanLayer = Field(default_factory=PlanLayer, description="applies on every GPU")
    gpu: dict[str, PlanLayer] = Field(default_factory=dict, description="profile name -> layer")
    source: str | None = Field(None, description="where it was read from")

    @classmethod
    def from_toml(cls, path: str | Path) -> "SpecFile":
        """Read and validate a spec TOML file (`[default]`, `[gpu.<profile>]`)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"spec file {str(path)!r} does not exist")
        with path.open("rb") as f:
            data = tomllib.load(f)
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> "SpecFile":
        from .gpu_profiles import PROFILES  # profiles are data too; checked here, early

        unknown = set(data) - {"default", "gpu"}
        if unknown:
            raise ValueError(
                f"spec file {source or ''}: unknown top-level tables {sorted(unknown)}; "
                "valid: [default] and [gpu.<profile>]"
            )
        gpus = dict(data.get("gpu", {}))
        for name in gpus:
            if name not in PROFILES:
                raise ValueError(
                    f"spec file {source or ''}: [gpu.{name}] is not a GPU profile; "
                    f"valid: {', '.join(PROFILES)}"
                )
        def section(name: str, table: Any) -> PlanLayer:
            # In files every section is structured: `regions` + optional settings.
            table = dict(table or {})
            bad = set(table) - set(PlanLayer.model_fields)
            if bad:
                raise ValueError(
                    f"spec file {source or ''}: [{name}] has unknown keys {sorted(bad)}; valid: "
                    f"{', '.join(PlanLayer.model_fields)} (region keys go under [{name}.regions])"
                )
            return PlanLayer(**table)

        return cls(
            default=section("default", data.get("default")),
            gpu={k: section(f"gpu.{k}", v) for k, v in gpus.items()},
            source=source,
        )

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


def attention_backend(layers: list[tuple[str, PlanLayer]]) -> str | None:
    """The attention backend of the highest layer that sets one."""
    chosen = None
    for _, layer in sorted(layers, key=lambda nl: LAYER_ORDER.index(nl[0])):
        if layer.attention_backend is not None:
            chosen = layer.attention_backend
    return chosen
