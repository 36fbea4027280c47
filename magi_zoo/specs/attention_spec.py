"""`AttentionSpec`: which attention kernel a region's attention layers call (the plan's
``attention`` section)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from .section import SectionSpec, register_section


@register_section
class AttentionSpec(SectionSpec):
    """The attention backend of every attention layer under a region. Frozen."""

    section: ClassVar[str] = "attention"

    backend: str | None = Field(
        None,
        description="A diffusers attention backend name ('native', '_native_cudnn', 'flash', "
        "...), or the short names 'sdpa' (= 'native', torch SDPA's own pick), 'cudnn' "
        "(= '_native_cudnn'), 'efficient' (= '_native_efficient'); 'fa3' = FlashAttention-3 forward (CUDA, bf16, inference only; the 'hopper' extra, "
        "an error without it); 'auto' = the first of the GPU profile's `attention_backends` that "
        "can run here (one warning names what it skipped); None = leave the library default.",
    )

    @classmethod
    def from_shorthand(cls, value: Any) -> "AttentionSpec":
        # `transformer = "flash"` is shorthand for { backend = "flash" }.
        if isinstance(value, str) or value is None:
            return cls(backend=value)
        return super().from_shorthand(value)
