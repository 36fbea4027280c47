"""`CudaGraphSpec`: capture a whole call of a module in one CUDA graph (the plan's
``cuda_graphs`` section)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from .section import SectionSpec, register_section


@register_section
class CudaGraphSpec(SectionSpec):
    """Capture each call of a method (a denoiser's `forward`, a decode step) in one CUDA
    graph and replay it, around whatever the compile section made of the blocks inside.

    Why not `mode="reduce-overhead"` on the blocks: repeated blocks share one compiled
    graph and inductor's CUDA graph trees reuse its output memory at every call, so the
    next block overwrites the previous one's output (the compile step refuses it). One
    graph around the whole call has no such sharing: the regional compile keeps its short
    cold start, and the host time between kernels (launches, guards, Python) is paid once
    at capture instead of every call.

    Contract: the captured method must be a function of its tensor arguments and the
    module's weights (a diffusers transformer's forward, a static-cache decode step). Each
    call copies the tensor arguments into the graph's own input buffers and returns clones
    of its outputs; Python-side effects inside the call happen at warm-up and capture only.
    A call the graph cannot serve (autograd on, inputs not on CUDA, an argument that is not
    a tensor or a plain value, more input signatures than `max_graphs`) runs the method
    uncaptured, and the report counts it with the reason.
    """

    section: ClassVar[str] = "cuda_graphs"
    per_method: ClassVar[bool] = True  # like compile: `forward` unless a method is named

    enabled: bool = Field(False, description="Capture this method's calls in CUDA graphs.")
    max_graphs: int = Field(
        4, ge=1,
        description="Distinct input signatures (shapes, dtypes, non-tensor argument values) "
        "captured per module; calls with further signatures run uncaptured (counted, warned once). "
        "Each graph keeps its own activation memory.",
    )
    warmup: int = Field(
        2, ge=1,
        description="Uncaptured calls of a new signature before its capture: compilation, "
        "autotuning and library workspaces must happen outside the capture.",
    )

    @classmethod
    def from_shorthand(cls, value: Any) -> "CudaGraphSpec":
        # `transformer = true` is shorthand for enabled=true.
        if isinstance(value, bool):
            return cls(enabled=value)
        return super().from_shorthand(value)

    def short(self) -> str:
        return "off" if not self.enabled else super().short()
