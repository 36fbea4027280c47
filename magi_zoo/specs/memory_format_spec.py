"""`MemoryFormatSpec`: the layout a module's convolution weights are kept in (the plan's
``memory_format`` section)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from .section import SectionSpec, register_section


@register_section
class MemoryFormatSpec(SectionSpec):
    """Keep every 2-D / 3-D convolution weight under a module in channels-last layout
    (NHWC / NDHWC), the layout cuDNN's tensor-core convolution kernels read natively.

    Why weights only: for a convolution whose weight is channels-last, torch asks cuDNN for a
    channels-last output whatever the input's layout, and the elementwise ops between
    convolutions keep the layout they are given, so a VAE's whole conv stack runs NDHWC
    without the NCDHW <-> NDHWC transposes cuDNN otherwise adds around each call. The values
    are the same: only the strides change (cuDNN may pick another algorithm, so outputs can
    differ by rounding). A module with no convolution is an error when the user names it.
    """

    section: ClassVar[str] = "memory_format"

    channels_last: bool = Field(
        False, description="Store this module's Conv2d / Conv3d weights channels-last (channels_last / "
        "channels_last_3d); false keeps them as loaded.")

    @classmethod
    def from_shorthand(cls, value: Any) -> "MemoryFormatSpec":
        # `vae = true` is shorthand for channels_last=true.
        if isinstance(value, bool):
            return cls(channels_last=value)
        return super().from_shorthand(value)

    def short(self) -> str:
        return "channels_last" if self.channels_last else "as loaded"
