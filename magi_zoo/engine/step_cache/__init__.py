"""The step_cache step: diffusers' step-caching hooks (first block cache, MagCache, ...) on a
denoiser, applied after compile so they wrap the compiled blocks from outside (`step.py`)."""

from .step import config_for, full_passes, step_cache_step

__all__ = ["config_for", "full_passes", "step_cache_step"]
