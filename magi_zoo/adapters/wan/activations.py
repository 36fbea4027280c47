"""The activation peaks of a Wan generation, estimated from the config and the call's shape:
the offload plan's reserves (`Adapter.activation_estimate`; docs/offload.md has the
arithmetic and what it was measured against).

Two phases matter. The transformer (the plan-wide reserve, offload key ""): one block's
forward holds the hidden state, its q / k / v / attention output / residual (~6 hidden
widths) and the FFN's intermediate, over every token of the video, in the weights' dtype;
diffusers runs the conditional and unconditional branches as separate calls, so batch 1. The
text tokens add the condition embedder's projection and a block's cross-attention K / V (what
dominates a tiny model; a published one's 32,760 video tokens dwarf them). Attention scores are
not counted: flash / memory-efficient attention never holds them (CPU's math path does, for a
tiny model a few KiB).
The VAE (its encoder's and decoder's phase): it runs one latent frame (4 video frames) at a
time with a causal cache, so its peak is a multiple of the widest full-resolution feature
map, 4 x H x W x (base_dim x dim_mult[0]) in fp32 (the Wan VAE runs in fp32, as published);
`VAE_LIVE_MAPS` of them alive at once, calibrated on the published shape (below).
"""

from __future__ import annotations

import math
from typing import Any

GIB = 2**30
HIDDEN_WIDTHS = 6  # hidden state, q, k, v, attention output, residual: each tokens x dim
# The VAE's live feature maps at its peak, in units of the widest full-resolution map. The
# published 480 x 832 x 81 I2V-14B generation measured 8.7 GiB of activations on an H100, in the
# VAE (wan.toml); its widest map is 4 x 480 x 832 x 96 x 4 B = 0.571 GiB, so 8.7 / 0.571 = 15.2
# maps: 16 covers it (9.14 GiB).
VAE_LIVE_MAPS = 16
VAE_CHUNK_FRAMES = 4  # video frames per latent frame (the temporal factor): what one decode call makes


def tokens(config: dict[str, Any], call: dict[str, Any]) -> int:
    """The transformer's tokens for a call: latent frames x latent height x latent width, over
    the patch (1 + (F - 1) / 4 latent frames; the VAE's 8x spatial factor, 16x for Wan2.2 TI2V)."""
    t, v = config["transformer"], config["vae"]
    pt, ph, pw = t["patch_size"]
    spatial = v.get("scale_factor_spatial", 8)
    temporal = v.get("scale_factor_temporal", 4)
    frames = ((call.get("num_frames") or 1) - 1) // temporal + 1
    return (math.ceil(frames / pt) * math.ceil(call["height"] / spatial / ph)
            * math.ceil(call["width"] / spatial / pw))


def activation_gib(config: dict[str, Any], call: dict[str, Any], bytes_per_element: int) -> dict[str, float]:
    """{offload key: GiB}: "" the transformer's peak (the plan-wide reserve), "vae.encoder" /
    "vae.decoder" the VAE's (their phase's reserve). Estimates, not reserves: the caller adds
    its margin (`magi_zoo.overrides.activation_reserves`)."""
    t, v = config["transformer"], config["vae"]
    dim = t["num_attention_heads"] * t["attention_head_dim"]
    n = tokens(config, call)
    text = call.get("max_sequence_length") or 512
    # video tokens through one block, + the text tokens: the condition embedder's projection
    # (text_dim in, dim out through a dim-wide GELU) and one block's cross-attention K / V
    transformer = (n * (t["ffn_dim"] + HIDDEN_WIDTHS * dim) + text * (t["text_dim"] + 4 * dim)) * bytes_per_element
    channels = v.get("base_dim", 96) * (v.get("dim_mult") or [1])[0]
    frames = min(VAE_CHUNK_FRAMES, call.get("num_frames") or 1)
    vae = VAE_LIVE_MAPS * frames * call["height"] * call["width"] * channels * 4  # fp32
    return {"": transformer / GIB, "vae.encoder": vae / GIB, "vae.decoder": vae / GIB}
