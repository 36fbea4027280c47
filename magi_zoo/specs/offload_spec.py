"""`OffloadSpec`: which weights stay on the card and which stream from host memory under a
memory budget (the plan's ``offload`` section).

Keys are the *units* that may stream: a repeated block class (``WanTransformerBlock``:
every instance is one unit) or a whole component (``text_encoder``, ``vae``: the weights of
that subtree not owned by a smaller unit inside it). A unit streams as a whole: its weights
come onto the card before its forward and leave after it. The root key ``""`` carries the
plan-wide settings (the budget, the activation reserve, the prefetch depth); only it may
set them, and it is never a unit itself::

    [default.offload]
    "" = { activation_gib = 4 }
    WanTransformerBlock = {}                 # may stream (mode auto)
    text_encoder = { mode = "auto" }         # whole component: on the card only while it runs

`magi_zoo.load(..., memory_budget_gib=24)` / `magi-zoo run --memory-budget 24` set the root's
budget; with none set it is the GPU profile's memory, so `gpu="rtx4090"` streams exactly
when the model does not fit in 24 GiB and changes nothing when it does.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from .section import SectionSpec, register_section

OFFLOAD_MODES = ("auto", "resident", "stream")
ROOT_FIELDS = ("memory_budget_gib", "activation_gib", "prefetch", "host_bandwidth_gbs", "phase_residency")  # root key "" only


@register_section
class OffloadSpec(SectionSpec):
    """Offload settings of one unit (any key) or of the whole plan (root key "" only)."""

    section: ClassVar[str] = "offload"

    mode: Literal["auto", "resident", "stream"] = Field(
        "auto",
        description="'auto': the planner keeps the unit on the card if the budget allows, else "
        "streams it; 'resident': pinned on the card (a pin the budget must hold); 'stream': "
        "always streamed from pinned host memory.",
    )
    once: bool = Field(
        False,
        description="The unit runs once per generation (a text encoder, a VAE), not once per "
        "denoising step: the planner streams such units before any per-step block, since "
        "their copies cost once instead of every step.",
    )
    memory_budget_gib: float | None = Field(
        None,
        description="Root key only. Device memory the weights, the streaming buffers and the "
        "activations may use together, in GiB; None = the GPU profile's memory_gib.",
    )
    activation_gib: float | None = Field(
        None,
        description="Root key only. Memory reserved for activations (the largest step's peak), "
        "in GiB; None = 10% of the budget. The first call on CUDA measures the real peak and "
        "warns when it exceeds this reserve.",
    )
    phase_activation_gib: float | None = Field(
        None,
        description="Unit keys only. The activation peak while this unit's component (its phase) "
        "runs, in GiB, when it is larger than the plan-wide activation_gib: e.g. a video VAE "
        "encoding or decoding 81 frames needs more than one transformer block. The planner "
        "then fits each phase's own peak: the resident weights stay on the card through every "
        "phase, so the largest phase peak decides how many stay.",
    )
    prefetch: int = Field(
        1,
        description="Root key only. How many streamed units' copies may be in flight ahead of "
        "use (each holds one device buffer of its block's size): 1 = the copy of the next "
        "streamed block runs while the current one computes.",
    )
    host_bandwidth_gbs: float = Field(
        55.0,
        description="Root key only. Pinned host->device copy rate the planner assumes, GB/s "
        "(measured 55 on an H100 over PCIe 5; pageable memory gives ~4.4).",
    )

    phase_residency: bool = Field(
        False,
        description="Root key only. While one component runs (the VAE decoding, the text encoder), "
        "resident blocks of another component (the denoiser) may leave the card to make room for "
        "its peak, and come back (a copy, once per return) before their component runs again: "
        "then only each component's own needs limit how many blocks stay resident. Costs pinned "
        "host memory for the blocks that may leave.",
    )

    @field_validator("memory_budget_gib", "host_bandwidth_gbs")
    @classmethod
    def _positive(cls, v, info):
        if v is not None and not v > 0:
            raise ValueError(f"{info.field_name} must be > 0, got {v!r}")
        return v

    @field_validator("activation_gib", "phase_activation_gib")
    @classmethod
    def _non_negative(cls, v, info):
        if v is not None and v < 0:
            raise ValueError(f"{info.field_name} must be >= 0, got {v!r}")
        return v

    @field_validator("prefetch")
    @classmethod
    def _prefetch(cls, v):
        if not 1 <= v <= 8:
            raise ValueError(f"prefetch must be 1..8 (copies in flight ahead of use), got {v!r}")
        return v

    @classmethod
    def from_shorthand(cls, value: Any) -> "OffloadSpec":
        # `WanTransformerBlock = "resident"` is shorthand for { mode = "resident" }.
        if isinstance(value, str):
            if value == "once":  # `text_encoder = "once"`: may stream, runs once per generation
                return cls(once=True)
            if value not in OFFLOAD_MODES:
                raise ValueError(f"offload mode {value!r}; choices: {', '.join(OFFLOAD_MODES)}, or 'once' "
                                 "(= { once = true }: may stream, runs once per generation)")
            return cls(mode=value)
        return super().from_shorthand(value)

    def root_fields(self) -> dict[str, Any]:
        """The plan-wide fields this spec set explicitly."""
        return {k: getattr(self, k) for k in ROOT_FIELDS if k in self.model_fields_set}

