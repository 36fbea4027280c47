"""Tiny configs keep the published structural constants; only widths and depths shrink.

A tiny variant exists to run the published code paths at a size CI builds in seconds. Each
tiny config is compared with its published config field by field: a field may differ only
if it is listed below as a width, a depth or a table size, with the reason; every other field
(activations, relative-attention distances, norms, eps, patching, schedulers) must be equal.
A new field in either config fails until it is placed.
"""

from __future__ import annotations

import pytest

from magi_zoo.adapters.wan import config as wan

# component -> (tiny, published, fields allowed to differ: why)
WAN = {
    "umt5 text encoder": (wan.TINY["text_encoder"], wan.UMT5_XXL, {
        "vocab_size": "width (the tiny tokenizer's vocabulary)",
        "d_model": "width", "d_kv": "width", "d_ff": "width", "num_heads": "width", "num_layers": "depth",
        # the bias table's size: its shape is recorded from the official module at the tiny
        # config (tests/data/wan21_original_keys.json); the bucketing distance stays published
        "relative_attention_num_buckets": "table size",
    }),
    "dit": (wan.TINY["transformer"], wan.T2V_1_3B, {
        "num_attention_heads": "width", "attention_head_dim": "width", "text_dim": "width (the T5's d_model)",
        "freq_dim": "width", "ffn_dim": "width", "num_layers": "depth",
        "rope_max_seq_len": "table size (the RoPE table's rows; each row is the published one)",
    }),
    "vae": (wan.TINY["vae"], wan.VAE, {
        "base_dim": "width", "dim_mult": "width (per-level multipliers)", "num_res_blocks": "depth",
    }),
    "scheduler": (wan.TINY["scheduler"], wan.SCHEDULER, {}),
    "i2v dit": (wan.TINY_I2V["transformer"], wan.I2V_14B, {
        "num_attention_heads": "width", "attention_head_dim": "width", "text_dim": "width (the T5's d_model)",
        "freq_dim": "width", "ffn_dim": "width", "num_layers": "depth", "added_kv_proj_dim": "width (the DiT's)",
        "rope_max_seq_len": "table size (the RoPE table's rows; each row is the published one)",
    }),
    "i2v image encoder": (wan.TINY_I2V["image_encoder"], wan.CLIP_H, {
        "intermediate_size": "width", "num_hidden_layers": "depth",
    }),
}


@pytest.mark.parametrize("component", sorted(WAN))
def test_wan_tiny_config_keeps_the_published_constants(component):
    tiny, published, allowed = WAN[component]
    assert tiny.keys() == published.keys(), f"fields only in one: {sorted(tiny.keys() ^ published.keys())}"
    assert set(allowed) <= published.keys(), f"allowed fields that are not fields: {sorted(set(allowed) - published.keys())}"
    differ = {k: (tiny[k], published[k]) for k in published if k not in allowed and tiny[k] != published[k]}
    assert not differ, f"{component}: tiny differs from the published config in structural fields {differ}"


def test_wan_tiny_i2v_text_is_the_published_512_tokens():
    """diffusers' Wan attention splits its context at `length - 512`: image tokens before,
    text after. A shorter text (the tiny I2V test's former 16) takes another path: the split
    falls inside the image tokens."""
    assert wan.TINY_I2V_CALL["max_sequence_length"] == 512
    assert wan.TINY_I2V["text_encoder"] == wan.TINY["text_encoder"] and wan.TINY_I2V["vae"] == wan.TINY["vae"]
