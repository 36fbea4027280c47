"""Z-Image (text-to-image, a 6B single-stream DiT with a Qwen3-4B text encoder) over diffusers'
ZImagePipeline: `config` (the published and tiny configs, the variants), `adapter` (build, the
denoiser's inputs), `attention` (the q/k norm + rope fusion's processor)."""

from .adapter import ZImageAdapter
from .config import VARIANTS

__all__ = ["VARIANTS", "ZImageAdapter"]
