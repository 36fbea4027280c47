"""`TorchCompileSpec`: how one region (a submodule, or one method of it) is compiled.

The defaults are exactly the defaults of `torch.compile(...)`, so a region whose spec
sets nothing compiles as a plain `torch.compile` call would.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from .section import SectionSpec, register_section

# The modes `torch.compile(mode=...)` accepts (torch/__init__.py, `_TorchCompileInductorWrapper`).
VALID_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@register_section
class TorchCompileSpec(SectionSpec):
    """How to compile one region (the plan's ``compile`` section). Frozen; unknown fields
    are rejected."""

    section: ClassVar[str] = "compile"
    per_method: ClassVar[bool] = True  # each method of a module is its own compiled region

    enabled: bool = Field(
        True,
        description="Compile this region. False fences it off like `torch.compiler.disable`.",
    )
    dynamic: bool | None = Field(
        None,
        description="True: symbolic shapes from the first call; False: never; None: torch's "
        "automatic dynamic (recompile once with dynamic shapes when a size changes).",
    )
    mode: str | None = Field(
        None, description=f"torch.compile mode, one of {', '.join(VALID_MODES)}; None = default."
    )
    fullgraph: bool = Field(
        False, description="Error on any graph break instead of splitting the region."
    )
    backend: str = Field(
        "inductor", description="torch.compile backend: 'inductor', 'aot_eager', 'eager', ..."
    )
    options: dict[str, Any] | None = Field(
        None, description="Backend options (inductor config), passed as `options=`."
    )

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, v: str | None) -> str | None:
        if v is not None and v not in VALID_MODES:
            raise ValueError(f"unknown mode {v!r}; valid modes: {', '.join(VALID_MODES)} (or None)")
        return v

    @model_validator(mode="after")
    def _mode_xor_options(self) -> "TorchCompileSpec":
        # torch.compile raises "Either mode or options can be specified, but both can't be
        # specified at the same time." -- say it here, at validation time, with the fix.
        if self.mode is not None and self.options:
            raise ValueError(
                "mode and options cannot both be set (torch.compile forbids the pair); "
                "express the mode through options instead, e.g. options={'triton.cudagraphs': True}"
            )
        return self

    def compile_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `torch.compile` (everything but `enabled`)."""
        kw: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": self.backend}
        if self.mode is not None:
            kw["mode"] = self.mode
        if self.options:
            kw["options"] = dict(self.options)
        return kw

    @classmethod
    def from_shorthand(cls, value: Any) -> "TorchCompileSpec":
        # `vae = false` is shorthand for enabled=False; true for the default spec.
        if isinstance(value, bool):
            return cls(enabled=value)
        return super().from_shorthand(value)

    @classmethod
    def engine_default(cls) -> dict[str, "TorchCompileSpec"]:
        # No layer names any compile region: the root compiled as `torch.compile(root)`.
        return {"": cls()}

    def short(self) -> str:
        return "disabled" if not self.enabled else super().short()
