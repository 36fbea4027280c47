"""Qwen-Image (text-to-image, 20B MMDiT with a Qwen2.5-VL text encoder) over diffusers'
QwenImagePipeline: `config` (the published and tiny configs, the variants), `adapter` (build,
the denoiser's inputs), `attention` (the q/k norm + rope fusion's processor)."""

from .adapter import QwenImageAdapter
from .config import VARIANTS

__all__ = ["QwenImageAdapter", "VARIANTS"]
