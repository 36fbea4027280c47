"""Flux's attention on the engine's fused q/k norm + text/image join + rope
(`joint_norm_rope_attention`, engine/kernels/joint_attention.py), when the precision step allows it.

The preparation puts a `NormRopeFluxAttnProcessor` in place of every diffusers `FluxAttnProcessor`.
It is diffusers' processor (0.42) except on the path it changes -- attention with a (cos, sin)
rotary embedding whose norms the precision step marked (`fuse_norm_rope`, NORM_ROPE_MARK), of one
eps: it chooses diffusers' own projections (fused or separate) and hands them on, with the text
stream in the double blocks, without one in the single blocks. Anything else (no rotary
embedding, unmarked norms, norms of different eps) is the class's own call.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ...engine import Preparation, joint_norm_rope_attention, marked_norms, processor_preparation
from ...engine.compat.diffusers import flux_qkv_projections

NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")  # image q, k; text q, k (double blocks only)


@functools.lru_cache(maxsize=None)
def _processor_class():
    """The processor class, built once on first use (diffusers' Flux module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    qkv_projections = flux_qkv_projections()

    class NormRopeFluxAttnProcessor(FluxAttnProcessor):
        """`FluxAttnProcessor` with q/k RMSNorm + join + RoPE fused on marked layers."""

        FUSES_NORM_ROPE = NORMS  # the norms the precision step marks (fuse_norm_rope)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            if not fusable(attn, encoder_hidden_states, image_rotary_emb):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
            query, key, value, e_query, e_key, e_value = qkv_projections(attn, hidden_states, encoder_hidden_states)
            text = (e_query, e_key, e_value) if encoder_hidden_states is not None else None
            return joint_norm_rope_attention(self, attn, (query, key, value), text, image_rotary_emb, attention_mask,
                                             head_dim=attn.head_dim)

    return NormRopeFluxAttnProcessor


def fusable(attn: nn.Module, encoder_hidden_states, image_rotary_emb) -> bool:
    """A (cos, sin) rotary embedding of (tokens, head_dim), q/k normalised per head by marked
    RMSNorms -- and, with a text stream, its added projections and marked norms of the same eps."""
    if not (isinstance(image_rotary_emb, tuple) and len(image_rotary_emb) == 2 and image_rotary_emb[0].dim() == 2):
        return False
    if encoder_hidden_states is not None and getattr(attn, "added_kv_proj_dim", None) is None:
        return False
    names = NORMS if encoder_hidden_states is not None else NORMS[:2]
    return marked_norms([getattr(attn, name, None) for name in names], attn.head_dim)


def norm_rope_preparation(transformer: nn.Module) -> Preparation:
    """Install `NormRopeFluxAttnProcessor` in place of every diffusers `FluxAttnProcessor`;
    undo restores the original processors (their state included)."""
    return processor_preparation("fused q/k norm + rope",
                                 "Flux's attention normalises q and k per head, joins the text and image streams and "
                                 "applies the rotary embedding in one kernel (magi_zoo::rms_norm_rope_heads) where "
                                 "the precision step's fuse_norm_rope marks its norms", [transformer], _processor_class)
