"""Wan2.1 (text/image-to-video) over diffusers' Wan pipelines.

Modules: `config` (the published configurations and the tiny one), `attention` (the fused
q/k norm + rope processor), `original` (weights in the original Wan release layout, converted
on load), `adapter` (variants, build, `magi-zoo run`).
"""

from .adapter import VARIANTS, WanAdapter

__all__ = ["WanAdapter", "VARIANTS"]
