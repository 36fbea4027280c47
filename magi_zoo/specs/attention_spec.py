"""`AttentionSpec`: which attention kernel a region's attention layers call (the plan's
``attention`` section)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

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
        "(= '_native_cudnn'), 'efficient' (= '_native_efficient'); 'fa3' = FlashAttention-3 forward (CUDA, bf16; "
        "with gradients, cuDNN's backward; masked calls on SDPA; the 'hopper' extra, an error without it); "
        "'fa3_varlen' = the same kernel taking a boolean mask as key padding (diffusers' varlen contract); "
        "'auto' = the first of the GPU profile's `attention_backends` that can run here (one warning "
        "names what it skipped); None = leave the library default.",
    )
    masks: Literal["any", "padding"] = Field(
        "any",
        description="What the region's boolean attention masks are. 'any' (the default): anything, so "
        "'fa3' runs a masked call on SDPA. 'padding': every boolean mask only hides padded keys "
        "(a key is valid when any query may see it, and every query sees exactly the valid keys: "
        "diffusers' varlen contract; in a square mask a position may see itself exactly when it is a "
        "valid key, which is how fa3_varlen reads it), so 'fa3' (named, or picked by 'auto') becomes 'fa3_varlen' "
        "and masked calls stay on FA3. A model author's statement about the model's masks, "
        "checked by the fp32-reference tests, not at run time.",
    )

    @classmethod
    def from_shorthand(cls, value: Any) -> "AttentionSpec":
        # `transformer = "flash"` is shorthand for { backend = "flash" }.
        if isinstance(value, str) or value is None:
            return cls(backend=value)
        return super().from_shorthand(value)
