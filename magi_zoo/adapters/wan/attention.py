"""Wan's self-attention with the q/k RMSNorm and the rotary embedding in one kernel
(`magi_zoo::rms_norm_rope`, engine/kernels/norm_rope.py), when the precision step allows it.

The preparation puts a `NormRopeWanAttnProcessor` on every `WanAttention` of the transformers.
It is diffusers' `WanAttnProcessor` (0.42) except on the one path it changes -- self-attention
with a rotary embedding whose `norm_q` / `norm_k` the precision step marked (`fuse_norm_rope`,
NORM_ROPE_MARK): there q and k come out of one pass each, in the (batch, tokens, heads, head_dim)
layout attention takes. Everything else (cross-attention, I2V's image keys, unmarked norms)
is the class's own call. The processor keeps the state of the one it replaces (attention
backend, parallel config), so the later steps see it like diffusers' own.
"""

from __future__ import annotations

import functools

import torch.nn as nn

from ...engine import Preparation, apply_norm_rope, marked_norm, processor_preparation
from ...engine.compat.diffusers import wan_qkv_projections


@functools.lru_cache(maxsize=None)
def _processor_class():
    """The processor class, built once on first use (diffusers' Wan module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor  # lazy: as above

    qkv_projections = wan_qkv_projections()

    class NormRopeWanAttnProcessor(WanAttnProcessor):
        """`WanAttnProcessor` with q/k RMSNorm + RoPE fused on marked self-attention layers."""

        FUSES_NORM_ROPE = ("norm_q", "norm_k")  # the norms the precision step marks (fuse_norm_rope)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
            if not fusable(attn, encoder_hidden_states, rotary_emb):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
            query, key, value = qkv_projections(attn, hidden_states, None)
            query = apply_norm_rope(query, attn.norm_q, rotary_emb, attn.heads)
            key = apply_norm_rope(key, attn.norm_k, rotary_emb, attn.heads)
            value = value.unflatten(2, (attn.heads, -1))
            out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                        backend=self._attention_backend, parallel_config=self._parallel_config)
            out = out.flatten(2, 3).type_as(query)
            return attn.to_out[1](attn.to_out[0](out))

    return NormRopeWanAttnProcessor


def fusable(attn: nn.Module, encoder_hidden_states, rotary_emb) -> bool:
    """Self-attention with a rotary embedding, q/k normalised over all heads by marked RMSNorms."""
    if encoder_hidden_states is not None or rotary_emb is None or getattr(attn, "add_k_proj", None) is not None:
        return False
    return all(marked_norm(n, attn.inner_dim) for n in (attn.norm_q, attn.norm_k))


def norm_rope_preparation(*transformers: nn.Module) -> Preparation:
    """Install `NormRopeWanAttnProcessor` in place of every diffusers `WanAttnProcessor` under
    `transformers`; undo restores the original processors (their state included)."""
    return processor_preparation("fused q/k norm + rope",
                                 "Wan's self-attention normalises q and k and applies the rotary embedding in one "
                                 "kernel (magi_zoo::rms_norm_rope) where the precision step's fuse_norm_rope marks "
                                 "its norms", transformers, _processor_class)

