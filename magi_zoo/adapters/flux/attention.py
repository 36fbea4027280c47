"""Flux's attention on the engine's fused q/k norm + text/image join + rope
(`flux_style_processor`, engine/kernels/joint_attention.py), when the precision step allows it.

The adapter's preparation (`joint_norm_rope_preparation`) puts a `NormRopeFluxAttnProcessor` in place of every diffusers `FluxAttnProcessor`.
It is diffusers' processor (0.42) except on the path it changes -- attention with a (cos, sin)
rotary embedding whose norms the precision step marked (`fuse_norm_rope`, NORM_ROPE_MARK), of one
eps: it chooses diffusers' own projections (fused or separate) and hands them on, with the text
stream in the double blocks, without one in the single blocks. Anything else (no rotary
embedding, unmarked norms, norms of different eps) is the class's own call.
"""

from __future__ import annotations

import functools

from ...engine import flux_style_processor
from ...engine.compat.diffusers import flux_qkv_projections


@functools.lru_cache(maxsize=None)
def processor_class():
    """The processor class, built once on first use (diffusers' Flux module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    return flux_style_processor(FluxAttnProcessor, flux_qkv_projections())
