"""The memory_format step: convolution weights kept channels-last where the plan says.

`step` holds `memory_format_step` and `convolutions` (the layers it converts).
"""

from .step import convolutions, memory_format_step

__all__ = ["convolutions", "memory_format_step"]
