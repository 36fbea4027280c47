"""FLUX.2 (text-to-image and image-conditioned generation, a 32B Flux successor with a
Mistral-Small-3.2 text encoder) over diffusers' Flux2Pipeline: `config` (the published and tiny
configs), `adapter` (variants, build, the denoiser's inputs)."""

from .adapter import Flux2Adapter
from .config import VARIANTS

__all__ = ["Flux2Adapter", "VARIANTS"]
