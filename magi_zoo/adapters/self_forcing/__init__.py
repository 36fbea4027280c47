"""Self-Forcing: Wan2.1-T2V-1.3B made causal and autoregressive (guandeh17/Self-Forcing),
run block by block on a static KV cache with one compiled graph per step, streaming
decoded frames per block.

Modules: config (published schedule, block offsets), model (the causal transformer on
diffusers' Wan modules), attention (attention over the cache without data-dependent
shapes), rope, kv_cache (the static cache), naive (the reference's control flow, kept as
a benchmark strategy and an equality oracle), vae_stream (causal VAE decode across
blocks), pipeline (the block loop, `stream`), checkpoint (official .pt -> diffusers
names), adapter (variants, build, entry point, `magi-zoo run`).
"""

from .adapter import VARIANTS, SelfForcingAdapter

__all__ = ["SelfForcingAdapter", "VARIANTS"]
