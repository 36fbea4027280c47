"""Z-Image's attention with q/k RMSNorm + RoPE in one kernel (`magi_zoo::rms_norm_rope_heads`),
when the precision step allows it. A `NormRopeZImageAttnProcessor` replaces every diffusers
`ZSingleStreamAttnProcessor` (0.42). Why: diffusers rotates q and k as complex numbers in fp32,
which inductor cannot generate code for ("does not support code generation for complex
operators"), so under compile each block's rotation runs as eager kernels over fp32 copies of
q and k; the kernel normalises and rotates them in one pass from the projections' bf16 output
(the rotation in real arithmetic, each complex table as (cos, sin): `joint_rope_table`).

The kernel takes one (cos, sin) table for the batch: a call whose batch holds one sequence
(a single prompt; the Turbo model runs no CFG) takes it. A batch of several sequences (CFG's
prompt and negative prompt, or several prompts) has a table per sequence, and unmarked norms
or tables of another shape are the class's own call."""

from __future__ import annotations

import functools

import torch.nn as nn

from ...engine import joint_norm_rope_attention, joint_rope_table, norms_fusable, processor_preparation


@functools.lru_cache(maxsize=None)
def processor_class():
    """The processor class, built once on first use (diffusers' Z-Image module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

    class NormRopeZImageAttnProcessor(ZSingleStreamAttnProcessor):
        """`ZSingleStreamAttnProcessor` with q/k RMSNorm + RoPE fused on marked layers."""

        FUSES_NORM_ROPE = ("norm_q", "norm_k")  # the norms the precision step marks (fuse_norm_rope)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
            if encoder_hidden_states is not None or not fusable(attn, hidden_states, freqs_cis):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
            if attention_mask is not None and attention_mask.ndim == 2:  # (batch, keys), as diffusers broadcasts it
                attention_mask = attention_mask[:, None, None, :]
            qkv = [proj(hidden_states) for proj in (attn.to_q, attn.to_k, attn.to_v)]
            out = joint_norm_rope_attention(self, attn, qkv, None, joint_rope_table([freqs_cis[0]]), attention_mask,
                                            head_dim=qkv[0].shape[-1] // attn.heads)
            for layer in attn.to_out:  # the projection, then its dropout
                out = layer(out)
            return out

    return NormRopeZImageAttnProcessor


def fusable(attn: nn.Module, hidden_states, freqs_cis) -> bool:
    """One sequence's complex rotary table (1, tokens, head_dim / 2) and the engine's
    `norms_fusable` (marked per-head q/k RMSNorms of one eps)."""
    head_dim = attn.to_q.out_features // attn.heads
    return (freqs_cis is not None and freqs_cis.is_complex() and freqs_cis.dim() == 3
            and tuple(freqs_cis.shape) == (1, hidden_states.shape[1], head_dim // 2)
            and norms_fusable(attn, None, head_dim))


def norm_rope_preparation(transformer: nn.Module):
    """The preparation that installs the processor on `transformer`'s attention layers."""
    return processor_preparation(
        "fused q/k norm + rope",
        "Z-Image's attention normalises q and k per head and applies the rotary embedding in one kernel "
        "(magi_zoo::rms_norm_rope_heads) where the precision step's fuse_norm_rope marks its norms and the "
        "batch holds one sequence", [transformer], processor_class)
