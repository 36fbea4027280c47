"""Plan sections: the typed settings a plan carries per region.

A plan layer maps each *section* (``compile``, ``attention``, and later ``precision``,
``recompute``, ``offload``, ``parallel``) to region keys, and each key to one spec of that
section -- or, for sections whose specs apply per method, to ``{method: spec}``.

Adding a section is one pydantic model here-style (a `SectionSpec` subclass decorated with
`register_section`) plus one engine module with its step; resolution (user > GPU section >
model default > engine default; exact path > glob > class name; field-wise fold), spec-file
parsing, `magi-zoo spec` and the report handle every registered section the same way.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from typing import Any, ClassVar, Mapping, Union

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

SECTIONS: dict[str, type["SectionSpec"]] = {}  # section name -> spec class, in registration order


class SectionSpec(BaseModel):
    """Base of every section's per-region spec: frozen, unknown fields rejected, strict types
    (``fullgraph = "yes"`` or ``1`` is refused, never read as True; an int where a float goes
    is the one conversion kept, since it does not change the meaning).

    Class attributes a section sets:
    - `section`: its name in plans and TOML files (``[default.<section>]``);
    - `per_method`: whether a key may map to ``{method: spec}`` (compile does: each method of
      a module is its own compiled region); other sections apply to the module as a whole.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    section: ClassVar[str]
    per_method: ClassVar[bool] = False
    # Fields a release renamed: old name -> new name. Given the old name, every way of
    # building the spec (keyword, plan dict, spec file) says what to write instead.
    renamed_fields: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            old = [k for k in data if k in cls.renamed_fields]
            if old:
                raise ValueError("; ".join(renamed_field_message(cls, k, data[k]) for k in old))
        return data

    @classmethod
    def from_shorthand(cls, value: Any) -> "SectionSpec":
        """A non-mapping value written in place of a spec (e.g. ``vae = false`` for compile)."""
        raise ValueError(f"expected a {cls.__name__} or a table of its fields "
                         f"({', '.join(cls.model_fields)}), got {type(value).__name__} {value!r}")

    @classmethod
    def engine_default(cls) -> dict[str, "SectionSpec"]:
        """The engine-default layer of this section when no layer has any entry for it."""
        return {}

    def explicit(self) -> dict[str, Any]:
        """Only the fields that were set explicitly (what an override layer contributes)."""
        return {k: getattr(self, k) for k in self.model_fields_set}

    def short(self) -> str:
        """One-line summary for tables: the non-default fields, or 'default'."""
        default = type(self)()
        parts = [f"{k}={getattr(self, k)}" for k in type(self).model_fields
                 if getattr(self, k) != getattr(default, k)]
        return ", ".join(parts) or "default"

    def __hash__(self) -> int:
        # pydantic's frozen hash hashes the field values, which fails on a dict field (a
        # compile spec's inductor `options`); specs are grouped by value (one region per
        # spec), so hash what equality compares: the dumped fields.
        return hash(self.digest())

    def digest(self) -> str:
        """Stable hash of the spec (used in cache keys)."""
        blob = json.dumps({"section": self.section, **self.model_dump()}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def register_section(cls: type[SectionSpec]) -> type[SectionSpec]:
    """Class decorator: make `cls` a plan section under `cls.section`."""
    name = cls.section
    if name in SECTIONS and SECTIONS[name] is not cls:
        raise ValueError(f"plan section {name!r} is already registered by {SECTIONS[name].__name__}")
    SECTIONS[name] = cls
    return cls


def section_class(name: str) -> type[SectionSpec]:
    """The spec class of a section; unknown names get a did-you-mean and the list."""
    if name not in SECTIONS:
        raise ValueError(f"unknown plan section {name!r}{did_you_mean(name, SECTIONS)}; "
                         f"sections: {', '.join(SECTIONS)}")
    return SECTIONS[name]


def did_you_mean(name: str, choices, cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=cutoff)
    return f" -- did you mean {close[0]!r}?" if close else ""


def flat_error(e: Exception) -> str:
    """One line from a pydantic ValidationError (or any error): the messages, without
    pydantic's headers and 'Value error, ' prefixes."""
    if isinstance(e, ValidationError):
        return "; ".join(err["msg"].replace("Value error, ", "") for err in e.errors())
    return str(e)


# What a strict type error expected, in the words of a spec file (pydantic error type -> words).
_EXPECTED = {"bool_type": "a boolean (true or false)", "int_type": "an integer", "float_type": "a number",
             "string_type": "a string", "tuple_type": "a list", "list_type": "a list", "dict_type": "a table",
             "int_from_float": "an integer"}


def field_error(err: Mapping[str, Any]) -> str:
    """One pydantic error as 'field: message': a type error says the type expected and what
    was given (``fullgraph: expected a boolean (true or false), got str 'yes'``)."""
    where = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "tagged-union")))
    if err["type"] in _EXPECTED:
        value = err.get("input")
        msg = f"expected {_EXPECTED[err['type']]}, got {type(value).__name__} {value!r}"
    else:
        msg = err["msg"].replace("Value error, ", "")
    return f"{where or 'spec'}: {msg}"


def renamed_field_message(cls: type[SectionSpec], old: str, value: Any = ...) -> str:
    """What to write instead of a field `cls.renamed_fields` lists as renamed."""
    new = cls.renamed_fields[old]
    return f"field {old!r} was renamed {new!r}: write {new}={'...' if value is ... else repr(value)} instead"


def _fields_error(cls: type[SectionSpec], where: str, unknown: list[str]) -> ValueError:
    fields = list(cls.model_fields)
    parts = [renamed_field_message(cls, u) if u in cls.renamed_fields else
             f"unknown field {u!r}{did_you_mean(u, fields)}" for u in unknown]
    return ValueError(f"{where}: {'; '.join(parts)} (valid {cls.section} fields: {', '.join(fields)})")


def build_spec(cls: type[SectionSpec], data: Mapping[str, Any], where: str) -> SectionSpec:
    """`cls(**data)` with errors that name the plan key and suggest the field meant."""
    unknown = [k for k in data if k not in cls.model_fields]
    if unknown:
        raise _fields_error(cls, where, unknown)
    try:
        return cls(**data)
    except ValidationError as e:
        raise ValueError(f"{where}: {'; '.join(_dedup(field_error(err) for err in e.errors()))}") from None


def _dedup(msgs) -> list[str]:
    # A union (`bool | None`) may report one error per member; the 'None' one adds nothing.
    msgs = list(dict.fromkeys(msgs))
    return [m for m in msgs if "Input should be None" not in m] or msgs


Entry = Union[SectionSpec, dict[str, SectionSpec]]


def _looks_like_field(cls: type[SectionSpec], name: str, value: Any) -> bool:
    """Is `name: value` inside a key's table a misspelt field rather than a method entry?
    A scalar that is not a bool cannot be a method entry; a bool can (``decode = false``),
    so a bool counts as a field only when the name is close to a real field."""
    if isinstance(value, (Mapping, SectionSpec)):
        return False
    if not isinstance(value, bool):
        return True
    return bool(difflib.get_close_matches(name, list(cls.model_fields), n=1, cutoff=0.75))


def coerce_entry(cls: type[SectionSpec], key: str, value: Any) -> Entry:
    """A spec, or (per-method sections) ``{method: spec}``; plain dicts are told apart by keys."""
    where = f"plan key {key!r} ({cls.section})"
    if isinstance(value, cls):
        return value
    if isinstance(value, SectionSpec):
        raise ValueError(f"{where}: got a {type(value).__name__}, which belongs in the "
                         f"{value.section!r} section, not {cls.section!r}")
    if not isinstance(value, Mapping):
        try:
            return cls.from_shorthand(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    keys = [str(k) for k in value]
    if set(keys) <= set(cls.model_fields):
        return build_spec(cls, value, where)
    typos = [k for k in keys if k not in cls.model_fields and _looks_like_field(cls, k, value[k])]
    if not cls.per_method or typos or set(keys) & set(cls.model_fields):
        # A table mixing fields with other names is a misspelt spec, never a method table
        # (methods named like spec fields are not supported).
        raise _fields_error(cls, where, typos or [k for k in keys if k not in cls.model_fields])
    out: dict[str, SectionSpec] = {}
    for method, spec in value.items():
        out[str(method)] = coerce_entry(cls, f"{key}.{method}", spec) if not isinstance(spec, cls) else spec
        if isinstance(out[str(method)], dict):
            raise ValueError(f"{where}: method {method!r} maps to another method table; "
                             "write {method: {field: value}}")
    return out
