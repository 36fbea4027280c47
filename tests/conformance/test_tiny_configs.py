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


# -- every registered tiny variant against its published variant -------------------------------
PUBLISHED_OF = {"wan2.1-tiny": "wan2.1-t2v-1.3b", "wan2.2-tiny": "wan2.2-t2v-a14b", "wan2.2-ti2v-tiny": "wan2.2-ti2v-5b",
                "self-forcing-tiny": "self-forcing-wan2.1-1.3b", "flux-tiny": "flux.1-dev", "bagel-tiny": "bagel-7b-mot",
                "qwen-image-tiny": "qwen-image", "flux.2-tiny": "flux.2-dev",
                "hunyuanvideo-1.5-tiny": "hunyuanvideo-1.5-480p-t2v", "ltx-2-tiny": "ltx-2", "z-image-tiny": "z-image-turbo"}
# Leaf field names that are widths, depths or table sizes in every family's configs.
SIZES = {
    # widths
    "hidden_size", "intermediate_size", "num_attention_heads", "attention_head_dim", "num_heads", "d_model", "d_kv",
    "d_ff", "ffn_dim", "freq_dim", "text_dim", "joint_attention_dim", "pooled_projection_dim", "projection_dim",
    "num_key_value_heads", "base_dim", "decoder_base_dim", "dim_mult", "block_out_channels", "norm_num_groups",
    "axes_dims_rope",  # RoPE's split of the head dim (sums to attention_head_dim)
    "mrope_section",  # multimodal RoPE's split of half the head dim (Qwen2.5-VL)
    "out_hidden_size",  # a vision tower's output width (the text model's hidden size)
    "head_dim",  # an LLM's per-head width (Mistral declares it apart from hidden_size / heads)
    # depths
    "num_layers", "num_hidden_layers", "num_single_layers", "num_res_blocks", "layers_per_block", "depth",
    # vocabularies and tables (each row / id is used as published)
    "vocab_size", "tokenizer_vocab", "clip_vocab", "t5_vocab", "relative_attention_num_buckets", "rope_max_seq_len",
    "max_position_embeddings", "max_latent_size", "vit_max_num_patch_per_side", "image_size", "sample_size",
    # HunyuanVideo-1.5 and LTX-2: widths (a RoPE split of the head dim; Gemma's attention scale is
    # its head dim; the DiT's text / image inputs are the encoders' widths), depths (LTX-2's
    # connector input is Gemma's depth + 1 stacked hidden states) and sizes (the default
    # resolution, the vision tower's tokens per image)
    "rope_axes_dim", "query_pre_attn_scalar", "text_embed_dim", "text_embed_2_dim", "image_embed_dim",
    "caption_channels", "cross_attention_dim", "audio_cross_attention_dim", "audio_num_attention_heads",
    "audio_attention_head_dim", "video_connector_num_attention_heads", "video_connector_attention_head_dim",
    "audio_connector_num_attention_heads", "audio_connector_attention_head_dim", "decoder_block_out_channels",
    "hidden_channels", "num_refiner_layers", "video_connector_num_layers", "audio_connector_num_layers",
    "decoder_layers_per_block", "text_proj_in_factor", "target_size", "mm_tokens_per_image",
    # BAGEL: the image-size rule's bounds (scaled to the tiny position tables) and the tokenizer's
    # ids of the same special tokens (a 512-entry vocabulary holds them at other ids)
    "max_size", "min_size", "max_pixels", "special_ids",
    # Z-Image's own names: widths (the model dim, heads, the caption features' width, the RoPE
    # split of the head dim) and the depth of its main blocks
    "dim", "n_heads", "n_kv_heads", "cap_feat_dim", "axes_dims", "n_layers",
}
# Structural differences not fixed yet, each with why; a fix removes its line (the test then
# demands it), a new difference fails.
KNOWN = {
    "wan2.2-tiny": {"fps": "the published variant's output frame rate; the tiny one has none (left for Wan2.2)"},
}


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "special_ids":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


@pytest.mark.parametrize("tiny", sorted(PUBLISHED_OF))
def test_registered_tiny_variants_differ_only_in_sizes(tiny):
    from magi_zoo import adapters

    t, p = (_flat(adapters.lookup(n)[1].config) for n in (tiny, PUBLISHED_OF[tiny]))
    differ = {k for k in t.keys() | p.keys() if t.get(k, "<absent>") != p.get(k, "<absent>")}
    structural = {k for k in differ if k.rsplit(".", 1)[-1] not in SIZES}
    assert structural == set(KNOWN.get(tiny, {})), (
        f"{tiny}: structural differences from {PUBLISHED_OF[tiny]}: new "
        f"{ {k: (t.get(k), p.get(k)) for k in structural - set(KNOWN.get(tiny, {}))} }, "
        f"fixed (remove from KNOWN): {sorted(set(KNOWN.get(tiny, {})) - structural)}")


# Qwen3-Omni's recipes leave the config classes' defaults out, so the built transformers configs
# are compared (defaults filled in). Its own names of widths, depths and counts, each with why:
QWEN3_OMNI_SIZES = {
    **dict.fromkeys(("d_model", "decoder_dim", "downsample_hidden_size", "encoder_attention_heads", "encoder_ffn_dim",
                     "output_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "thinker_hidden_size",
                     "out_hidden_size", "head_dim", "num_heads", "codebook_dim",
                     "vector_quantization_hidden_dimension"), "width"),
    **dict.fromkeys(("encoder_layers", "depth"), "depth"),
    "layer_types": "depth (one entry per layer, all 'full_attention' as published)",
    "mrope_section": "width: the multimodal RoPE's split of the head dim (sums to head_dim / 2)",
    "num_experts": "width: experts per MoE layer (the same normalised top-k routing over fewer)",
    "num_local_experts": "as num_experts (the talker's name for it)",
    "num_experts_per_tok": "width: experts routed per token (the same normalised top-k routing)",
    "num_code_groups": "count: codebooks, the code predictor runs once per group",
    "num_quantizers": "count: as num_code_groups (Code2Wav's name for it)",
    "accept_hidden_layer": "depth: the thinker layer the talker reads, an index within the tiny depth",
    "deepstack_visual_indexes": "depth: the vision layers fed to the thinker, indexes within the tiny depth",
}


def _flat_built(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("speaker_id", "id2label", "label2id"):
            out.update(_flat_built(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_qwen3_omni_tiny_keeps_the_published_constants():
    from magi_zoo.adapters.qwen3_omni.configs import PUBLISHED, TINY, build_config

    t, p = (_flat_built(build_config(c).to_dict()) for c in (TINY, PUBLISHED))
    differ = {k for k in t.keys() | p.keys() if t.get(k, "<absent>") != p.get(k, "<absent>")}
    structural = {k: (t.get(k, "<absent>"), p.get(k, "<absent>")) for k in differ
                  if k.rsplit(".", 1)[-1] not in SIZES | set(QWEN3_OMNI_SIZES)}
    assert not structural, f"qwen3-omni-tiny differs from the published config in structural fields {structural}"
    unused = set(QWEN3_OMNI_SIZES) - {k.rsplit(".", 1)[-1] for k in differ}
    assert not unused, f"listed as sizes but equal in both (remove them): {sorted(unused)}"


COMPARED_ELSEWHERE = {"qwen3-omni-tiny": "test_qwen3_omni_tiny_keeps_the_published_constants"}


def test_every_tiny_variant_is_compared():
    from magi_zoo import adapters

    tinies = {v.name for a in adapters.all_adapters() for v in a.variants.values() if v.tiny}
    assert tinies - set(PUBLISHED_OF) <= set(COMPARED_ELSEWHERE), sorted(tinies - set(PUBLISHED_OF))
