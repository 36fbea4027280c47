"""FLUX.2's attention on the engine's fused q/k norm + text/image join + rope (kernels/
joint_attention.py), when the precision step marks the norms (`fuse_norm_rope`); the adapter
installs both classes with `joint_norm_rope_preparation`. The double
blocks' `Flux2AttnProcessor` is called as Flux.1's, so the engine builds its replacement
(`flux_style_processor`); the single blocks' `Flux2ParallelSelfAttnProcessor` projects q, k, v and
the MLP's input in one linear, so its replacement here splits that as diffusers (0.42) does and
fuses only the norms and rope. Any call the kernel cannot take is the class's own."""

from __future__ import annotations

import functools

import torch

from ...engine import JOINT_NORMS, flux_style_processor, joint_norm_rope_attention, real_rope_fusable
from ...engine.compat.diffusers import flux2_qkv_projections


@functools.lru_cache(maxsize=None)
def processor_classes():
    """The two processor classes, built once on first use (diffusers' FLUX.2 module is imported lazily)."""
    # lazy: diffusers costs seconds; the classes are built when a plan first installs them
    from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor

    class NormRopeFlux2ParallelSelfAttnProcessor(Flux2ParallelSelfAttnProcessor):
        """`Flux2ParallelSelfAttnProcessor` with q/k RMSNorm + RoPE fused on marked layers."""

        FUSES_NORM_ROPE = JOINT_NORMS[:2]  # the text is joined before the block: one stream

        def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
            if not real_rope_fusable(attn, None, image_rotary_emb, attn.head_dim):
                return super().__call__(attn, hidden_states, attention_mask, image_rotary_emb)
            projected = attn.to_qkv_mlp_proj(hidden_states)
            # the split by the global ratio, as diffusers makes it (a column-sharded projection too)
            qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
            local_qkv = projected.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
            qkv, mlp = torch.split(projected, [local_qkv, projected.shape[-1] - local_qkv], dim=-1)
            out = joint_norm_rope_attention(self, attn, qkv.chunk(3, dim=-1), None, image_rotary_emb, attention_mask,
                                            head_dim=attn.head_dim)
            return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))

    return flux_style_processor(Flux2AttnProcessor, flux2_qkv_projections()), NormRopeFlux2ParallelSelfAttnProcessor
