"""Flux.1 (text-to-image) over diffusers' FluxPipeline.

Modules: `attention` (the fused per-head q/k norm + join + rope processor), `single_blocks`
(the single-stream blocks' input layouts and fused MLP), `adapter` (published configs,
variants, build, the denoiser's inputs).
"""

from .adapter import VARIANTS, FluxAdapter

__all__ = ["FluxAdapter", "VARIANTS"]
