"""Flux's attention with the per-head q/k RMSNorms, the text/image join and the rotary embedding
in one kernel (`magi_zoo::rms_norm_rope_heads`, engine/kernels/norm_rope.py), when the precision
step allows it.

The preparation puts a `NormRopeFluxAttnProcessor` in place of every diffusers `FluxAttnProcessor`.
It is diffusers' processor (0.42) except on the path it changes -- attention with a rotary
embedding whose norms the precision step marked (`fuse_norm_rope`, NORM_ROPE_MARK): there q and
k come out of one pass each, already joined (text tokens first, as diffusers concatenates them)
and rotated, in the (batch, tokens, heads, head_dim) layout attention takes. The values are
joined as diffusers does. Anything else (no rotary embedding, unmarked norms, norms of different
eps) is the class's own call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...engine import Preparation, apply_norm_rope_heads, marked_norm, processor_preparation
from ...engine.compat.diffusers import flux_qkv_projections


@functools.lru_cache(maxsize=None)
def _processor_class():
    """The processor class, built once on first use (diffusers' Flux module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor  # lazy: as above

    qkv_projections = flux_qkv_projections()

    class NormRopeFluxAttnProcessor(FluxAttnProcessor):
        """`FluxAttnProcessor` with q/k RMSNorm + join + RoPE fused on marked layers."""

        # the norms the precision step marks (fuse_norm_rope); the added ones exist on double blocks
        FUSES_NORM_ROPE = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            if not fusable(attn, encoder_hidden_states, image_rotary_emb):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
            query, key, value, e_query, e_key, e_value = qkv_projections(attn, hidden_states, encoder_hidden_states)
            heads = lambda t: t.unflatten(-1, (-1, attn.head_dim))
            joint = encoder_hidden_states is not None
            query = apply_norm_rope_heads(heads(query), attn.norm_q, image_rotary_emb,
                                          heads(e_query) if joint else None, attn.norm_added_q if joint else None)
            key = apply_norm_rope_heads(heads(key), attn.norm_k, image_rotary_emb,
                                        heads(e_key) if joint else None, attn.norm_added_k if joint else None)
            value = torch.cat([heads(e_value), heads(value)], dim=1) if joint else heads(value)
            out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                                        parallel_config=self._parallel_config)
            out = out.flatten(2, 3).to(query.dtype)
            if not joint:
                return out
            text = encoder_hidden_states.shape[1]
            e_out, out = out.split_with_sizes([text, out.shape[1] - text], dim=1)
            out = attn.to_out[1](attn.to_out[0](out.contiguous()))
            return out, attn.to_add_out(e_out.contiguous())

    return NormRopeFluxAttnProcessor


def fusable(attn: nn.Module, encoder_hidden_states, image_rotary_emb) -> bool:
    """A (cos, sin) rotary embedding of (tokens, head_dim), q/k normalised per head by marked
    RMSNorms -- and, with a text stream, its added projections and marked norms of the same eps."""
    if not (isinstance(image_rotary_emb, tuple) and len(image_rotary_emb) == 2 and image_rotary_emb[0].dim() == 2):
        return False
    norms = [attn.norm_q, attn.norm_k]
    if encoder_hidden_states is not None:
        if getattr(attn, "added_kv_proj_dim", None) is None:
            return False
        norms += [getattr(attn, "norm_added_q", None), getattr(attn, "norm_added_k", None)]
    return all(marked_norm(n, attn.head_dim) for n in norms) and len({n.eps for n in norms}) == 1


def norm_rope_preparation(transformer: nn.Module) -> Preparation:
    """Install `NormRopeFluxAttnProcessor` in place of every diffusers `FluxAttnProcessor`;
    undo restores the original processors (their state included)."""
    return processor_preparation("fused q/k norm + rope",
                                 "Flux's attention normalises q and k per head, joins the text and image streams and "
                                 "applies the rotary embedding in one kernel (magi_zoo::rms_norm_rope_heads) where "
                                 "the precision step's fuse_norm_rope marks its norms", [transformer], _processor_class)
