"""The joint (text + image) attention of a diffusers MMDiT processor on the per-head q/k norm +
rope kernel (`magi_zoo::rms_norm_rope_heads`, `norm_rope.py`): `joint_norm_rope_attention`, the
body Flux.1's, FLUX.2's and Qwen-Image's processors share; `joint_rope_table`, complex rotary
tables as the kernel's real (cos, sin); and `flux_style_processor`, the whole fused processor for
a diffusers class called as Flux's (Flux.1's `FluxAttnProcessor`, FLUX.2's `Flux2AttnProcessor`),
built from the class and its projections alone. The adapters keep what differs: how q, k and v
are projected, the mask, the rotary table's form, and when to fuse at all (`precision.marked_norms`).

Why: diffusers normalises q and k per head (an RMSNorm over head_dim), joins the text stream's
q/k (normalised by their own norms) in front of the image stream's, and rotates the joint
sequence; unfused that is a norm kernel, a concatenation's copy and a rotation per tensor (Flux's
numbers: `norm_rope.py`). Qwen-Image gains most: diffusers applies its rotary embedding as a
complex multiplication (``view_as_complex(x.float()) * freqs``). Inductor does not generate code
for complex tensors, so under torch.compile each of the four rotations per block (image and text,
q and k) is an eager aten kernel over fp32 complex values, with an fp32 tensor written before it
and read after it. On one H200 at 1328^2 (benchmarks/results/profiles/profile_qwen-image_bf16_h200.md)
those eager multiplications alone were 6.5 ms of a 237 ms forward (240 calls: 4 per block x 60),
beside 3.7 ms of the norms that feed them and 3.8 ms of the casts and concatenation after them
(fused: profile_qwen-image_fused_h200.md).

The rotation is the same arithmetic in real numbers: pair (x[2j], x[2j+1]) as (re, im) times
(cos t_j + i sin t_j) is (x[2j] cos - x[2j+1] sin, x[2j] sin + x[2j+1] cos), which is the
interleaved-pair rotation the kernel applies with cos and sin each repeated over the pair. The
text tokens come first in the joint sequence (as diffusers concatenates them), so the cos/sin
table is the text's angles followed by the image's (`joint_rope_table`, tables in join order).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..compat import diffusers as diffusers_compat
from ..custom_ops import register_custom_op
from ..precision.fusions import marked_norms
from ..prepare.rewrites import processor_preparation
from ..prepare.step import Preparation
from .norm_rope import apply_heads

# The q/k RMSNorms of diffusers' MMDiT attention, as its processors name them: the image stream's
# q, k, then the text stream's (absent in a single-stream block, whose text is already joined).
JOINT_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")


def joint_norm_rope_attention(processor, attn: nn.Module, image: Sequence[torch.Tensor],
                              text: Sequence[torch.Tensor] | None, rotary_emb, attention_mask=None, *,
                              head_dim: int):
    """diffusers' joint attention from the projections on: q and k each come out of one kernel
    call, normalised, joined (text first) and rotated, in the (batch, tokens, heads, head_dim)
    layout attention takes (`norm_rope.apply_heads`: `attn.norm_q` / `norm_k` for the image
    stream, `norm_added_q` / `norm_added_k` for the text's; the kernel takes one eps, so the
    caller checks `marked_norms` first); then `dispatch_attention_fn` with `processor`'s backend
    and parallel config, the split and the output projections, as diffusers' Flux and Qwen-Image
    processors (0.42) run them.

    image, text: each stream's (query, key, value) as projected, (batch, tokens, heads * head_dim);
    text None: one stream (Flux's single blocks). rotary_emb: the kernel's (cos, sin), (text +
    image tokens, head_dim). Returns (image output through `attn.to_out`, text output through
    `attn.to_add_out`); with one stream, the attention output (batch, tokens, heads * head_dim),
    unprojected, as diffusers' processors return a single-stream block's."""
    # lazy: diffusers costs seconds; `import magi_zoo` never imports it (a no-op once imported)
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    heads = lambda t: None if t is None else t.unflatten(-1, (-1, head_dim))  # noqa: E731
    joint = text is not None
    query, key, value = image
    text_q, text_k, text_v = text if joint else (None, None, None)
    query = apply_heads(heads(query), attn.norm_q, rotary_emb, heads(text_q), attn.norm_added_q if joint else None)
    key = apply_heads(heads(key), attn.norm_k, rotary_emb, heads(text_k), attn.norm_added_k if joint else None)
    value = torch.cat([heads(text_v), heads(value)], dim=1) if joint else heads(value)
    out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                backend=diffusers_compat.processor_backend(processor),
                                parallel_config=diffusers_compat.processor_parallel_config(processor))
    out = out.flatten(2, 3).to(query.dtype)
    if not joint:
        return out
    text_out, out = out.split_with_sizes([text_q.shape[1], out.shape[1] - text_q.shape[1]], dim=1)
    out = out.contiguous()
    for layer in attn.to_out:  # the projection, then its dropout
        out = layer(out)
    return out, attn.to_add_out(text_out.contiguous())


def _check_tables(freqs) -> None:
    if not freqs or any(not f.is_complex() or f.dim() != 2 or f.shape[1] != freqs[0].shape[1] for f in freqs):
        raise ValueError("joint_rope_table takes complex tables (tokens, head_dim / 2), one per stream, of one "
                         f"width; got {[(tuple(f.shape), f.dtype) for f in freqs]}")


def _joint_rope_table_fake(freqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (sum(f.shape[0] for f in freqs), 2 * freqs[0].shape[1])
    return freqs[0].new_empty(shape, dtype=torch.float32), freqs[0].new_empty(shape, dtype=torch.float32)


@register_custom_op("joint_rope_table", fake=_joint_rope_table_fake)
def joint_rope_table(freqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Complex rotary tables (e^(i t_j) per token and pair: (tokens, head_dim / 2) per stream), in
    the streams' join order, as the kernel's real (cos, sin) of (all tokens, head_dim) in fp32,
    each angle repeated over its pair. Qwen-Image passes [text, image].

    An opaque op, so that inductor never sees complex tensors here: torch 2.11's inductor, fusing
    the (tokens, head_dim / 2, 2) real view of these tables into a neighbouring kernel, failed in
    its tiling code (an internal TypeError, CantSplit, at 1328^2 in Qwen-Image's shipped-path GPU
    test). Its cost is a few small kernels per block on tables of tokens x head_dim fp32 values
    (7,145 x 128 at 1328^2: 3.7 MB each)."""
    _check_tables(freqs)
    angles = torch.cat([torch.view_as_real(f) for f in freqs]).float()  # (tokens, head_dim / 2, 2)
    cos, sin = angles.unbind(-1)
    return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)


def rope_tables_fit(freqs, lengths: Sequence[int], head_dim: int) -> bool:
    """Whether `freqs` is one complex table per stream of (that stream's tokens, head_dim / 2):
    what `joint_rope_table` turns into the kernel's (cos, sin) for those streams."""
    return (isinstance(freqs, (tuple, list)) and len(freqs) == len(lengths)
            and all(isinstance(f, torch.Tensor) and f.is_complex() and tuple(f.shape) == (n, head_dim // 2)
                    for f, n in zip(freqs, lengths)))


def norms_fusable(attn: nn.Module, encoder_hidden_states, head_dim: int) -> bool:
    """Whether `attn`'s q and k are normalised per head by marked RMSNorms of one eps (the kernel
    takes one) -- and, with a text stream, whether its added projections and norms are there too,
    marked, of the same eps. The rotary table's form is the caller's check."""
    if encoder_hidden_states is not None and getattr(attn, "added_kv_proj_dim", None) is None:
        return False
    names = JOINT_NORMS if encoder_hidden_states is not None else JOINT_NORMS[:2]
    return marked_norms([getattr(attn, name, None) for name in names], head_dim)


def real_rope_fusable(attn: nn.Module, encoder_hidden_states, rotary_emb, head_dim: int) -> bool:
    """Whether a Flux-style call may take the kernel: a real (cos, sin) rotary embedding of
    (tokens, head_dim) each, and `norms_fusable`."""
    return (isinstance(rotary_emb, tuple) and len(rotary_emb) == 2 and rotary_emb[0].dim() == 2
            and norms_fusable(attn, encoder_hidden_states, head_dim))


def joint_norm_rope_preparation(model: str, transformers, processor_class: Callable[[], type | tuple[type, ...]]
                                ) -> Preparation:
    """The preparation that installs a family's joint-attention processor(s) built on
    `joint_norm_rope_attention` (`processor_preparation`: each replaces its diffusers base class
    under `transformers`; the undo restores the original processors, their state included).
    `model` names the family in the report's line."""
    return processor_preparation("fused q/k norm + rope",
                                 f"{model}'s attention normalises q and k per head, joins the text and image streams "
                                 "and applies the rotary embedding in one kernel (magi_zoo::rms_norm_rope_heads) "
                                 "where the precision step's fuse_norm_rope marks its norms", list(transformers),
                                 processor_class)


def flux_style_processor(base: type, qkv_projections: Callable) -> type:
    """A subclass of `base`, a diffusers processor called as Flux's is (attn, hidden_states,
    encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None) with per-head q/k
    RMSNorms and a real (cos, sin) rotary table over the joint sequence (Flux.1's
    `FluxAttnProcessor`, FLUX.2's `Flux2AttnProcessor`): where `real_rope_fusable` allows, q and k
    come out of `joint_norm_rope_attention`; any other call is `base`'s own. `qkv_projections` is
    diffusers' `(attn, hidden_states, encoder_hidden_states) -> (query, key, value, encoder_query,
    encoder_key, encoder_value)` for the model, fused or separate projections alike. Named
    ``NormRope<base>``; FUSES_NORM_ROPE tells the precision step which norms to mark."""

    class NormRopeProcessor(base):
        FUSES_NORM_ROPE = JOINT_NORMS  # the norms the precision step marks (fuse_norm_rope)

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                     image_rotary_emb=None):
            if not real_rope_fusable(attn, encoder_hidden_states, image_rotary_emb, attn.head_dim):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
            query, key, value, e_query, e_key, e_value = qkv_projections(attn, hidden_states, encoder_hidden_states)
            text = (e_query, e_key, e_value) if encoder_hidden_states is not None else None
            return joint_norm_rope_attention(self, attn, (query, key, value), text, image_rotary_emb, attention_mask,
                                             head_dim=attn.head_dim)

    NormRopeProcessor.__name__ = NormRopeProcessor.__qualname__ = f"NormRope{base.__name__}"
    return NormRopeProcessor
