"""The joint (text + image) attention of a diffusers MMDiT processor on the per-head q/k norm +
rope kernel (`magi_zoo::rms_norm_rope_heads`, `norm_rope.py`): `joint_norm_rope_attention`, the
body Flux.1's and Qwen-Image's processors share, and `joint_rope_table`, complex rotary tables
as the kernel's real (cos, sin). The adapters keep what differs: how q, k and v are projected,
the mask, the rotary table's form, and when to fuse at all (`precision.marked_norms`).

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

from typing import Sequence

import torch
import torch.nn as nn

from ..compat import diffusers as diffusers_compat
from ..custom_ops import register_custom_op
from .norm_rope import apply_heads


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
