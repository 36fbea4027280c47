"""Qwen-Image's joint attention on the engine's fused q/k norm + text/image join + rope
(`joint_norm_rope_attention`; engine/kernels/joint_attention.py says why and how), when the
precision step allows it. A `NormRopeQwenAttnProcessor` replaces every diffusers
`QwenDoubleStreamAttnProcessor2_0` (0.42); it chooses diffusers' separate projections, the joint
mask diffusers builds from the text mask, and the complex rotary tables as the kernel's (cos, sin),
text first (`joint_rope_table`). Anything else -- an external mask, tables of other shapes,
unmarked norms, norms of different eps -- is the class's own call."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...engine import JOINT_NORMS, joint_norm_rope_attention, joint_rope_table, norms_fusable, rope_tables_fit


@functools.lru_cache(maxsize=None)
def processor_class():
    """The processor class, built once on first use (diffusers' Qwen-Image module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    class NormRopeQwenAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
        """`QwenDoubleStreamAttnProcessor2_0` with q/k RMSNorm + join + RoPE fused on marked layers."""

        FUSES_NORM_ROPE = JOINT_NORMS  # the norms the precision step marks (fuse_norm_rope)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                     attention_mask=None, image_rotary_emb=None):
            if attention_mask is not None or not fusable(attn, hidden_states, encoder_hidden_states,
                                                         image_rotary_emb):
                return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                        attention_mask, image_rotary_emb)
            if encoder_hidden_states_mask is not None:  # diffusers' joint mask: text mask, then every image token
                image_mask = hidden_states.new_ones(hidden_states.shape[:2], dtype=torch.bool)
                attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
            image_freqs, text_freqs = image_rotary_emb
            rotary = joint_rope_table([text_freqs, image_freqs])
            image = [proj(hidden_states) for proj in (attn.to_q, attn.to_k, attn.to_v)]
            text = [proj(encoder_hidden_states) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            return joint_norm_rope_attention(self, attn, image, text, rotary, attention_mask,
                                             head_dim=attn.inner_dim // attn.heads)

    return NormRopeQwenAttnProcessor


def fusable(attn: nn.Module, hidden_states, encoder_hidden_states, image_rotary_emb) -> bool:
    """A text stream, complex rotary tables (image, text) of the two streams' lengths, and the
    engine's `norms_fusable` (marked per-head q/k RMSNorms of one eps, the added projections)."""
    head_dim = attn.inner_dim // attn.heads
    return (encoder_hidden_states is not None
            and rope_tables_fit(image_rotary_emb, (hidden_states.shape[1], encoder_hidden_states.shape[1]), head_dim)
            and norms_fusable(attn, encoder_hidden_states, head_dim))
