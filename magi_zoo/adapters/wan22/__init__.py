"""Wan2.2 (A14B's two experts, TI2V-5B) over diffusers' WanPipeline: Wan2.1's adapter with
Wan2.2's variants (`adapter`)."""

from .adapter import VARIANTS, Wan22Adapter

__all__ = ["Wan22Adapter", "VARIANTS"]
