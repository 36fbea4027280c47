"""The activation peaks of a Flux generation, estimated from the config and the call's shape:
the offload plan's reserves (`Adapter.activation_estimate`; docs/offload.md has the arithmetic
and the measurements).

The transformer (the plan-wide reserve, offload key ""): a block's forward over every token,
image and text together (the single-stream blocks run them as one sequence): the MLP's
intermediate and its activation (2 x mlp_ratio x dim) and `HIDDEN_WIDTHS` hidden-wide tensors,
in the weights' dtype, batch 1 (Flux.1-dev is
guidance-distilled: one branch). The VAE decoder (its phase): its widest map is at full
resolution, the second level's channels (block_out_channels[1], upsampled into the last level),
`VAE_LIVE_MAPS` of them alive at once (measured on flux-tiny, below), in the weights' dtype.
"""

from __future__ import annotations

import math
from typing import Any

GIB = 2**30
# Hidden-wide tensors per token besides the MLP's two: hidden state, q, k, v, attention output,
# residual, and the single-stream block's concatenated attention + MLP output (3 more): 9,
# fitted on flux-tiny's measured peak (tests/models/flux/test_flux_activations.py).
HIDDEN_WIDTHS = 9
# Live full-resolution maps at the decoder's peak, in units of the widest: flux-tiny's decode at
# 32 x 32 and 64 x 96 held 3.0 of them (the same test); 4 leaves one for the published
# decoder's second resnet per level (flux-tiny has one).
VAE_LIVE_MAPS = 4


def activation_gib(config: dict[str, Any], call: dict[str, Any], bytes_per_element: int) -> dict[str, float]:
    """{offload key: GiB}: "" the transformer's peak, "vae.decoder" the VAE decode's."""
    t, v = config["transformer"], config["vae"]
    dim = t["num_attention_heads"] * t["attention_head_dim"]
    down = 2 ** (len(v["block_out_channels"]) - 1)  # the VAE's spatial factor (8 as published)
    image = math.ceil(call["height"] / down / 2) * math.ceil(call["width"] / down / 2)  # 2 x 2 packed latents
    text = call.get("max_sequence_length") or 512
    transformer = (image + text) * (2 * t.get("mlp_ratio", 4.0) + HIDDEN_WIDTHS) * dim * bytes_per_element
    channels = v["block_out_channels"][min(1, len(v["block_out_channels"]) - 1)]
    vae = VAE_LIVE_MAPS * call["height"] * call["width"] * channels * bytes_per_element
    return {"": transformer / GIB, "vae.decoder": vae / GIB}
