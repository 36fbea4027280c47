"""LTX-2's published configuration and the tiny one, as keyword arguments of the diffusers /
transformers classes (the config tables; the adapter is `adapter.py`).

Where each number comes from: diffusers' `scripts/convert_ltx2_to_diffusers.py` (version
"2.0", model_id Lightricks/LTX-2), which writes every component of the published diffusers
layout from literal configs:
- transformer: `get_ltx2_transformer_config("2.0")`: 48 joint audio-video blocks, video 32
  heads x 128 = 4096 wide, audio 32 heads x 64 = 2048 wide, 128 latent channels each, split
  RoPE in double precision, caption channels 3840 (Gemma-3-12B's width), no gated attention,
  no perturbed attention;
- connectors: `get_ltx2_connectors_config("2.0")`: 2-layer connectors of 30 heads x 128 over
  the 49 stacked Gemma hidden states (48 layers + embeddings), 128 learnable registers;
- vae: `get_ltx2_video_vae_config("2.0")` (32x spatial with a 4x4 patchify, 8x temporal, 128
  latent channels; no timestep conditioning, the script's default), audio_vae:
  `get_ltx2_audio_vae_config("2.0")` (64 mel bins at 16 kHz, hop 160, 4x down to 8 latent
  channels x 16 bins), vocoder: `get_ltx2_vocoder_config("2.0")` (HiFi-GAN-style, x240 up to
  24 kHz stereo);
- scheduler: the script's non-distilled FlowMatchEulerDiscreteScheduler (dynamic shift
  0.95..2.05 over 1024..4096 tokens, shift_terminal 0.1);
- text_encoder: google/gemma-3-12b-it (the script's default `--text_encoder_model_id`), its
  published config (48 layers, 3840 wide, 16 heads / 8 KV heads x 256, sliding window 1024
  on 5 of every 6 layers, linear RoPE scaling x8 on the global layers; SigLIP vision tower);
- call defaults: the LTX2Pipeline docstring example (512x768, 121 frames at 24 fps, 30 steps,
  guidance 3.0); the other guidance knobs are LTX2Pipeline's defaults.
"""

from __future__ import annotations

TRANSFORMER = dict(
    in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=128,
    cross_attention_dim=4096, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048, base_width=2048,
    gated_attn=False, cross_attn_mod=False, audio_in_channels=128, audio_out_channels=128, audio_patch_size=1,
    audio_patch_size_t=1, audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
    audio_scale_factor=4, audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160,
    audio_gated_attn=False, audio_cross_attn_mod=False, num_layers=48, activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=3840,
    attention_bias=True, attention_out_bias=True, rope_theta=10000.0, rope_double_precision=True, causal_offset=1,
    timestep_scale_multiplier=1000, cross_attn_timestep_scale_multiplier=1000, rope_type="split",
    use_prompt_embeddings=True, perturbed_attn=False)
CONNECTORS = dict(
    caption_channels=3840, text_proj_in_factor=49, video_connector_num_attention_heads=30,
    video_connector_attention_head_dim=128, video_connector_num_layers=2, video_connector_num_learnable_registers=128,
    video_gated_attn=False, audio_connector_num_attention_heads=30, audio_connector_attention_head_dim=128,
    audio_connector_num_layers=2, audio_connector_num_learnable_registers=128, audio_gated_attn=False,
    connector_rope_base_seq_len=4096, rope_theta=10000.0, rope_double_precision=True,
    causal_temporal_positioning=False, rope_type="split", per_modality_projections=False, proj_bias=False)
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(256, 512, 1024, 2048),
    down_block_types=("LTX2VideoDownBlock3D",) * 4, decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"), upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2), timestep_conditioning=False, patch_size=4, patch_size_t=1, resnet_norm_eps=1e-6,
    encoder_causal=True, decoder_causal=False, encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect", spatial_compression_ratio=32, temporal_compression_ratio=8)
AUDIO_VAE = dict(
    base_channels=128, output_channels=2, ch_mult=(1, 2, 4), num_res_blocks=2, attn_resolutions=None, in_channels=2,
    resolution=256, latent_channels=8, norm_type="pixel", causality_axis="height", dropout=0.0,
    mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=64, double_z=True)
VOCODER = dict(
    in_channels=128, hidden_channels=1024, out_channels=2, upsample_kernel_sizes=[16, 15, 8, 4, 4],
    upsample_factors=[6, 5, 2, 2, 2], resnet_kernel_sizes=[3, 7, 11], resnet_dilations=[[1, 3, 5]] * 3,
    act_fn="leaky_relu", leaky_relu_negative_slope=0.1, antialias=False, final_act_fn="tanh", final_bias=True,
    output_sampling_rate=24000)
SCHEDULER = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                 max_image_seq_len=4096, shift_terminal=0.1)
# google/gemma-3-12b-it: the text model and its SigLIP vision tower (transformers 5 spells the
# RoPE settings per attention type).
GEMMA3_TEXT = dict(
    vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
    max_position_embeddings=131072, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                         full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0)))
SIGLIP = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=896,
              patch_size=14, vision_use_head=False)
GEMMA3 = dict(mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000, image_token_index=262144)
CALL = dict(height=512, width=768, num_frames=121, frame_rate=24.0, num_inference_steps=30, guidance_scale=3.0,
            max_sequence_length=1024)

# Tiny: the published structure at small widths and depths. Kept: 128 latent channels for video
# and audio (the audio's 8 latent channels x 16 latent mel bins), the VAE's 4 levels behind a
# 4x4 patchify (32x spatial, 8x temporal), the audio VAE's 3 levels over 64 mel bins, the
# vocoder's x240 upsampling to 24 kHz, split RoPE, the connectors' 128 registers (the text is
# 128 tokens, a multiple of them). Gemma at 2 layers (text_proj_in_factor = layers + 1).
TINY = dict(
    transformer=dict(TRANSFORMER, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
                     audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
                     num_layers=2, caption_channels=32),
    connectors=dict(CONNECTORS, caption_channels=32, text_proj_in_factor=3, video_connector_num_attention_heads=2,
                    video_connector_attention_head_dim=16, video_connector_num_layers=1,
                    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=16,
                    audio_connector_num_layers=1),
    vae=dict(VAE, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
             layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1)),
    # base_channels stays 128: the audio VAE sizes its latent statistics by it, which the pipeline
    # applies to the packed 8 channels x 16 bins = 128 features (equal only at the published width).
    audio_vae=dict(AUDIO_VAE, num_res_blocks=1),
    vocoder=dict(VOCODER, hidden_channels=32),
    scheduler=SCHEDULER,
    text_encoder=dict(GEMMA3_TEXT, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16),
    vision=dict(SIGLIP, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                image_size=56),
    gemma=dict(GEMMA3, mm_tokens_per_image=4),
    tokenizer_vocab=512,
)
TINY_CALL = dict(CALL, height=64, width=64, num_frames=9, num_inference_steps=2, max_sequence_length=128)
