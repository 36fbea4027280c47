"""`StepCacheSpec`: reuse work across denoising steps (the plan's ``step_cache`` section).

Step caching skips or approximates part of a denoiser's forward on steps where its output
changes little, through diffusers' caching hooks (`CacheMixin.enable_cache`). This section
names the method and its knobs; the engine step (`magi_zoo/engine/step_cache/`) builds
diffusers' config dataclass from them. It is keyed on the denoiser (``transformer``).

The methods are the ones diffusers 0.42.1 ships whose hooks fit the zoo's pipelines; the
names of the knobs are diffusers' own field names, so its documentation applies as is.
This module imports neither torch nor diffusers (`import magi_zoo` stays cheap): the
knob names are a table here, and a test checks the table against diffusers' dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, Mapping

from pydantic import Field, field_validator, model_validator

from .section import SectionSpec, did_you_mean, flat_error, register_section


@dataclasses.dataclass(frozen=True)
class CacheMethod:
    """One step-caching method: diffusers' config class and the knobs a plan may set."""

    config: str | None  # class name in diffusers.hooks (None: no caching)
    knobs: tuple[str, ...]  # fields of that dataclass a plan may set
    what: str  # one line for errors and docs
    threshold: bool = False  # has a `threshold` knob (the spec's `threshold` field sets it)


METHODS: dict[str, CacheMethod] = {
    "none": CacheMethod(None, (), "no caching: every step runs every block"),
    "first_block": CacheMethod(
        "FirstBlockCacheConfig", ("threshold",),
        "First Block Cache: the first block always runs; when its residual changed by less than "
        "`threshold` (relative absmean) since the last full step, the other blocks are skipped and "
        "their cached residual added", threshold=True),
    "mag_cache": CacheMethod(
        "MagCacheConfig",
        ("threshold", "max_skip_steps", "retention_ratio", "num_inference_steps", "mag_ratios", "calibrate"),
        "MagCache: skips the block stack while the accumulated residual-magnitude error stays under "
        "`threshold`; needs the model's `mag_ratios` (or calibrate=true to print them) and the "
        "run's `num_inference_steps`", threshold=True),
    "taylorseer": CacheMethod(
        "TaylorSeerCacheConfig",
        ("cache_interval", "disable_cache_before_step", "disable_cache_after_step", "max_order",
         "taylor_factors_dtype", "skip_predict_identifiers", "cache_identifiers", "use_lite_mode"),
        "TaylorSeer: full forwards every `cache_interval` steps, Taylor-extrapolated outputs in between; "
        "with compiled blocks use use_lite_mode=true (hooks whole blocks and proj_out, not the "
        "attention layers inside them)"),
    "pab": CacheMethod(
        "PyramidAttentionBroadcastConfig",
        ("spatial_attention_block_skip_range", "temporal_attention_block_skip_range",
         "cross_attention_block_skip_range", "spatial_attention_timestep_skip_range",
         "temporal_attention_timestep_skip_range", "cross_attention_timestep_skip_range",
         "spatial_attention_block_identifiers", "temporal_attention_block_identifiers",
         "cross_attention_block_identifiers"),
        "Pyramid Attention Broadcast: reuses attention outputs for `*_block_skip_range` steps while "
        "the timestep (as the transformer receives it: Wan 0-1000, Flux 0-1) is inside "
        "`*_timestep_skip_range`; hooks attention layers, so not with compiled blocks. Its state is per "
        "layer, not per CFG branch: with separate cond/uncond calls (Wan) the uncond call reuses the "
        "cond call's attention"),
    "sea_cache": CacheMethod(
        "SeaCacheConfig",
        ("threshold", "residual_order", "retention_steps", "cache_end_steps", "max_consecutive_cached",
         "power_exp"),
        "SeaCache: reuses the block stack's residual while a spectral indicator's accumulated change "
        "stays under `threshold`; built in for Wan text-to-video (and Cosmos 3)", threshold=True),
}

# Caching hooks diffusers 0.42.1 has that this section does not expose, and why: named
# here so that asking for one says so instead of suggesting an unrelated method.
NOT_EXPOSED: dict[str, str] = {
    "faster_cache": "FasterCache approximates the unconditional branch from a batch that holds "
                    "both CFG branches; the Wan and Flux pipelines run them as separate calls",
    "text_kv_cache": "diffusers' TextKVCache is written for NucleusMoE-Image blocks only",
    "teacache": "diffusers 0.42.1 has no TeaCache; 'first_block' is its generic form (diffusers' "
                "docs: First Block Cache builds on TeaCache) and 'mag_cache' its successor",
}


def _freeze(value: Any) -> Any:
    """Lists -> tuples (recursively): the spec is frozen and hashable (regions group by it)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, Mapping):
        raise ValueError(f"a step_cache option value may not be a table, got {dict(value)!r}")
    return value


def method_error(name: str) -> str:
    """The message for a method name that is not exposed: why, or did-you-mean + choices."""
    if name in NOT_EXPOSED:
        return f"step_cache method {name!r} is not exposed: {NOT_EXPOSED[name]}; methods: {', '.join(METHODS)}"
    return (f"unknown step_cache method {name!r}{did_you_mean(name, [*METHODS, *NOT_EXPOSED])}; "
            f"methods: {', '.join(METHODS)}")


@register_section
class StepCacheSpec(SectionSpec):
    """How a denoiser reuses work across steps, through diffusers' caching hooks. Frozen.

    `method` picks the hook; `threshold` is the main knob of the methods that have one;
    `options` sets any other field of the method's diffusers config (its own names). The
    hooks wrap whole blocks (or the model's forward), outside compiled regions: the engine
    step runs after compile and refuses a method whose hooks would land inside one.
    """

    section: ClassVar[str] = "step_cache"

    method: str = Field(
        "none",
        description="'none' | 'first_block' | 'mag_cache' | 'taylorseer' | 'pab' | 'sea_cache' "
        "(diffusers' FirstBlockCache, MagCache, TaylorSeer, PyramidAttentionBroadcast, SeaCache).",
    )
    threshold: float | None = Field(
        None,
        description="first_block / mag_cache / sea_cache: how much change still counts as 'the same' "
        "(higher = more steps skipped, faster, lower quality); None = diffusers' default "
        "(first_block 0.05, mag_cache 0.06, sea_cache 0.25).",
    )
    options: tuple[tuple[str, Any], ...] | None = Field(
        None,
        description="Other fields of the method's diffusers config, by their diffusers names, e.g. "
        "{cache_interval = 4, use_lite_mode = true} for taylorseer; stored as sorted (name, value) pairs.",
    )

    @field_validator("method", mode="before")
    @classmethod
    def _known_method(cls, v: Any) -> Any:
        if not isinstance(v, str):
            raise ValueError(f"method must be a string, got {type(v).__name__} {v!r}")
        name = v.strip().lower().replace("-", "_")
        if name not in METHODS:
            raise ValueError(method_error(v))
        return name

    @field_validator("options", mode="before")
    @classmethod
    def _options_pairs(cls, v: Any) -> Any:
        if v is None:
            return None
        items = v.items() if isinstance(v, Mapping) else v
        try:
            pairs = sorted((str(k), _freeze(val)) for k, val in items)
        except (TypeError, ValueError) as e:
            raise ValueError(f"options must be a table {{name: value}}: {e}") from None
        return tuple(pairs) or None

    @field_validator("threshold")
    @classmethod
    def _non_negative(cls, v: float | None) -> float | None:
        if v is not None and not v >= 0:
            raise ValueError(f"threshold must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _knobs_fit_method(self) -> "StepCacheSpec":
        m = METHODS[self.method]
        if self.threshold is not None and not m.threshold:
            with_t = [n for n, c in METHODS.items() if c.threshold]
            raise ValueError(f"threshold does not apply to method {self.method!r} (methods with a "
                             f"threshold: {', '.join(with_t)})")
        for name, _ in self.options or ():
            if name not in m.knobs:
                valid = ", ".join(m.knobs) or "none"
                raise ValueError(f"step_cache method {self.method!r} has no option {name!r}"
                                 f"{did_you_mean(name, m.knobs)} (its options: {valid})")
            if name == "threshold" and self.threshold is not None:
                raise ValueError("threshold is set twice (as a field and in options); keep the field")
        return self

    def config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the method's diffusers config (threshold folded in)."""
        kw = dict(self.options or ())
        if self.threshold is not None:
            kw["threshold"] = self.threshold
        return kw

    def short(self) -> str:
        """`method=first_block, threshold=0.1` / `method=taylorseer, cache_interval=3, ...`."""
        parts = [f"method={self.method}"] + [f"{k}={v}" for k, v in self.config_kwargs().items()]
        return ", ".join(parts)

    @classmethod
    def from_shorthand(cls, value: Any) -> "StepCacheSpec":
        # `transformer = "first_block"` is shorthand for { method = "first_block" }.
        if isinstance(value, str):
            return cls(method=value)
        return super().from_shorthand(value)


def _split_top(text: str) -> list[str]:
    """Split on commas outside [...] (a list value keeps its commas)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def parse_cli(text: str) -> dict[str, Any]:
    """`--step-cache METHOD[:THRESHOLD | :NAME=VALUE[,NAME=VALUE...]]` -> a StepCacheSpec dict.

    ``first_block``, ``first_block:0.1``, ``taylorseer:cache_interval=4,use_lite_mode=true``.
    Values are JSON (numbers, true/false, [lists]) or else plain strings. The result is
    validated (did-you-mean on the method and option names) before it is returned.
    """
    method, _, rest = text.partition(":")
    spec: dict[str, Any] = {"method": method}
    rest = rest.strip()
    if rest:
        if "=" not in rest:
            try:
                spec["threshold"] = float(rest)
            except ValueError:
                raise ValueError(f"--step-cache {text!r}: after ':' give a threshold (a number) or "
                                 "NAME=VALUE pairs separated by ','") from None
        else:
            opts: dict[str, Any] = {}
            for part in _split_top(rest):
                name, eq, raw = part.partition("=")
                if not eq or not name.strip():
                    raise ValueError(f"--step-cache {text!r}: {part!r} is not NAME=VALUE")
                try:
                    opts[name.strip()] = json.loads(raw)
                except json.JSONDecodeError:
                    opts[name.strip()] = raw.strip()
            if "threshold" in opts:
                spec["threshold"] = opts.pop("threshold")
            if opts:
                spec["options"] = opts
    try:
        StepCacheSpec(**spec)
    except Exception as e:  # pydantic ValidationError -> one line
        raise ValueError(f"--step-cache {text!r}: {flat_error(e)}") from None
    return spec
