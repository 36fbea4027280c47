"""Wan2.1's published configurations (the Wan-AI/*-Diffusers repositories' config.json
files) and the tiny one, as keyword arguments of the diffusers / transformers classes.
Wan2.2 and Self-Forcing build on these (the same text encoder, VAE and DiT shapes)."""

from __future__ import annotations

# -- published configs ---------------------------------------------------------------------
# UMT5-XXL encoder (google/umt5-xxl, as shipped in Wan-AI/*-Diffusers/text_encoder).
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=False)
VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
           temperal_downsample=[False, True, True], dropout=0.0)
# UniPC with flow sigmas, shift 3.0 for 480p (5.0 for 720p), as in the published scheduler_config.
# UMT5 tokens Wan's official code pads every prompt to (`text_len` in its shared config): the
# DiT never saw a longer context, and diffusers' I2V attention splits image from text tokens at
# 512 from the end (`encoder_hidden_states.shape[1] - 512` in transformer_wan.py).
TEXT_LEN = 512
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
                 flow_shift=3.0, solver_order=2, solver_type="bh2", timestep_spacing="linspace")
T2V_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
T2V_14B = dict(T2V_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
I2V_14B = dict(T2V_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
# CLIP ViT-H/14 image encoder of the I2V model.
CLIP_H = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
              image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu")

# Tiny: a few layers, small dims; 4 blocks so "N blocks, one compile" is visible. Only widths,
# depths and table sizes shrink; every other constant is the published one (T5's relative
# distance 128 included): tests/conformance/test_tiny_configs.py compares field by field.
TINY = dict(
    transformer=dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                     out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=4,
                     cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32),
    text_encoder=dict(vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=False),
    vae=dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
             temperal_downsample=[False, True, True], dropout=0.0),
    scheduler=SCHEDULER, tokenizer_vocab=512,
)
# The I2V image encoder in small: CLIP-H's width (Wan's WanModel hard-codes 1280 for its image
# MLP) and activation, 2 narrow layers. tests/conformance/test_tiny_configs.py lists what may differ.
TINY_CLIP = dict(CLIP_H, intermediate_size=128, num_hidden_layers=2)
# The I2V model in small: I2V-14B's structure (36 input channels: noise, mask and image latents;
# CLIP image tokens through the added K/V) at the tiny widths. Its text is 512 tokens, as
# published: diffusers' Wan attention takes the last 512 context tokens as text and the ones
# before them as image tokens (`encoder_hidden_states.shape[1] - 512`).
TINY_I2V = dict(TINY, transformer=dict(TINY["transformer"], in_channels=36, image_dim=1280, added_kv_proj_dim=32),
                image_encoder=TINY_CLIP)
TINY_I2V_CALL = dict(height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=5.0,
                     max_sequence_length=512)
