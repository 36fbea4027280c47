"""Qwen-Image's joint attention with the per-head q/k RMSNorms, the text/image join and the rotary
embedding in one kernel per tensor (`magi_zoo::rms_norm_rope_heads`, engine/kernels/norm_rope.py,
the kernel Flux's attention uses), when the precision step allows it.

Why: diffusers applies Qwen-Image's rotary embedding as a complex multiplication
(``view_as_complex(x.float()) * freqs``). Inductor does not generate code for complex tensors, so
under torch.compile each of the four rotations per block (image and text, q and k) is an eager
aten kernel over fp32 complex values, with an fp32 tensor written before it and read after it.
On one H200 at 1328^2 (benchmarks/results/profiles/profile_qwen-image_bf16_h200.md) those eager
multiplications alone were 6.5 ms of a 237 ms forward (240 calls: 4 per block x 60), beside
3.7 ms of the norms that feed them and 3.8 ms of the casts and concatenation after them.

The rotation is the same arithmetic in real numbers: pair (x[2j], x[2j+1]) as (re, im) times
(cos t_j + i sin t_j) is (x[2j] cos - x[2j+1] sin, x[2j] sin + x[2j+1] cos), which is the
interleaved-pair rotation the kernel applies with cos and sin each repeated over the pair. The
text tokens come first in the joint sequence (as diffusers concatenates them), so the cos/sin
table is the text's angles followed by the image's.

The preparation puts a `NormRopeQwenAttnProcessor` in place of every diffusers
`QwenDoubleStreamAttnProcessor2_0`. It is diffusers' processor (0.42) except on the path it changes
-- complex rotary tables of the streams' lengths and norms the precision step marked
(`fuse_norm_rope`, NORM_ROPE_MARK) of one eps: there q and k come out of one pass each, already
joined and rotated, in the (batch, tokens, heads, head_dim) layout attention takes. The text mask
is built as diffusers builds it. Anything else is the class's own call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...engine import Preparation, apply_norm_rope_heads, marked_norm, processor_preparation, register_custom_op


@functools.lru_cache(maxsize=None)
def _processor_class():
    """The processor class, built once on first use (diffusers' Qwen-Image module is imported lazily)."""
    # lazy: diffusers costs seconds; the class is built when a plan first installs it
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0  # lazy: as above

    class NormRopeQwenAttnProcessor(QwenDoubleStreamAttnProcessor2_0):
        """`QwenDoubleStreamAttnProcessor2_0` with q/k RMSNorm + join + RoPE fused on marked layers."""

        # the norms the precision step marks (fuse_norm_rope)
        FUSES_NORM_ROPE = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                     attention_mask=None, image_rotary_emb=None):
            if attention_mask is not None or not fusable(attn, hidden_states, encoder_hidden_states,
                                                         image_rotary_emb):
                return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                        attention_mask, image_rotary_emb)
            if encoder_hidden_states_mask is not None:  # diffusers' joint mask: text mask, then every image token
                image_mask = hidden_states.new_ones(hidden_states.shape[:2], dtype=torch.bool)
                attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
            text = encoder_hidden_states.shape[1]
            heads = lambda t: t.unflatten(-1, (-1, attn.inner_dim // attn.heads))  # noqa: E731
            rotary = joint_cos_sin(*image_rotary_emb)
            query = apply_norm_rope_heads(heads(attn.to_q(hidden_states)), attn.norm_q, rotary,
                                          heads(attn.add_q_proj(encoder_hidden_states)), attn.norm_added_q)
            key = apply_norm_rope_heads(heads(attn.to_k(hidden_states)), attn.norm_k, rotary,
                                        heads(attn.add_k_proj(encoder_hidden_states)), attn.norm_added_k)
            value = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), heads(attn.to_v(hidden_states))],
                              dim=1)
            out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                        backend=self._attention_backend, parallel_config=self._parallel_config)
            out = out.flatten(2, 3).to(query.dtype)
            txt_out, img_out = out[:, :text], out[:, text:]
            img_out = attn.to_out[0](img_out.contiguous())
            if len(attn.to_out) > 1:
                img_out = attn.to_out[1](img_out)  # dropout
            return img_out, attn.to_add_out(txt_out.contiguous())

    return NormRopeQwenAttnProcessor


def _joint_cos_sin_fake(image_freqs: torch.Tensor, text_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (text_freqs.shape[0] + image_freqs.shape[0], 2 * image_freqs.shape[1])
    return (image_freqs.new_empty(shape, dtype=torch.float32), image_freqs.new_empty(shape, dtype=torch.float32))


@register_custom_op("qwen_image_rope_table", fake=_joint_cos_sin_fake)
def joint_cos_sin(image_freqs: torch.Tensor, text_freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' complex rotary tables (image (S, D/2), text (T, D/2): e^(i t_j) per token and pair)
    as the kernel's real (cos, sin) of (T + S, D), text first, each angle repeated over its pair.

    An opaque op, so that inductor never sees complex tensors here: torch 2.11's inductor, fusing
    the (T + S, D/2, 2) real view of these tables into a neighbouring kernel, failed in its
    tiling code (an internal TypeError, CantSplit, at 1328^2 in the shipped-path GPU test). Its
    cost is a few small kernels per block on tables of (T + S) x D fp32 values (7,145 x 128 at
    1328^2: 3.7 MB each)."""
    angles = torch.cat([torch.view_as_real(text_freqs), torch.view_as_real(image_freqs)]).float()  # (T+S, D/2, 2)
    cos, sin = angles.unbind(-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def fusable(attn: nn.Module, hidden_states, encoder_hidden_states, image_rotary_emb) -> bool:
    """Complex rotary tables (image, text) of the two streams' lengths, q/k normalised per head by
    marked RMSNorms of one eps, the text stream's added projections present."""
    if encoder_hidden_states is None or getattr(attn, "added_kv_proj_dim", None) is None:
        return False
    if not (isinstance(image_rotary_emb, tuple) and len(image_rotary_emb) == 2):
        return False
    head_dim = attn.inner_dim // attn.heads
    lengths = (hidden_states.shape[1], encoder_hidden_states.shape[1])
    for freqs, n in zip(image_rotary_emb, lengths):
        if not (isinstance(freqs, torch.Tensor) and freqs.is_complex() and tuple(freqs.shape) == (n, head_dim // 2)):
            return False
    norms = [getattr(attn, name, None) for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    return all(marked_norm(n, head_dim) for n in norms) and len({n.eps for n in norms}) == 1


def norm_rope_preparation(transformer: nn.Module) -> Preparation:
    """Install `NormRopeQwenAttnProcessor` in place of every diffusers `QwenDoubleStreamAttnProcessor2_0`;
    undo restores the original processors (their state included)."""
    return processor_preparation("fused q/k norm + rope",
                                 "Qwen-Image's attention normalises q and k per head, joins the text and image "
                                 "streams and applies the rotary embedding in real arithmetic in one kernel "
                                 "(magi_zoo::rms_norm_rope_heads) where the precision step's fuse_norm_rope marks "
                                 "its norms", [transformer], _processor_class)
