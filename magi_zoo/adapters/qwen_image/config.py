"""Qwen-Image's published configuration (the Qwen/Qwen-Image repository's diffusers layout) and
the tiny one, as keyword arguments of the diffusers / transformers classes, and the variants
over them (the config tables; the adapter is `adapter.py`).

Where each number comes from:
- transformer/config.json (QwenImageTransformer2DModel): patch 2, 64 input channels (16 latent
  channels x 2x2), 16 out, 60 layers, 24 heads x 128, joint_attention_dim 3584 (the text
  encoder's hidden size), axes_dims_rope (16, 56, 56), guidance_embeds false; the later flags
  (zero_cond_t, use_additional_t_cond, use_layer3d_rope) are the class defaults the published
  file predates (false: those are Qwen-Image-Edit-2511 / Layered features).
- vae/config.json (AutoencoderKLQwenImage): base_dim 96, z_dim 16, dim_mult (1, 2, 4, 4), 2 res
  blocks, temporal downsample (False, True, True), per-channel latents mean / std -- the Wan2.1
  VAE's numbers (the class defaults of diffusers 0.42 equal them).
- text_encoder/config.json: Qwen2.5-VL-7B-Instruct (Qwen2_5_VLForConditionalGeneration):
  hidden 3584, FFN 18944, 28 layers, 28 heads / 4 KV heads, vocab 152064, rope theta 1e6 with
  mrope sections (16, 24, 24), RMS eps 1e-6; the vision tower 32 layers x 1280, FFN 3420, 16
  heads, patch 14, merge 2, window 112, full attention at blocks (7, 15, 23, 31).
- scheduler/scheduler_config.json: FlowMatchEuler with dynamic exponential shift, mu from
  0.5 (256 image tokens) to 0.9 (8192 tokens), shift_terminal 0.02.
- call defaults: the model card's example -- 50 steps, true_cfg_scale 4.0 with the negative
  prompt " ", 1328x1328 (its 1:1 size); max_sequence_length is QwenImagePipeline's 512.
"""

from __future__ import annotations

from ..base import Variant
from ..wan.config import VAE as _WAN_VAE

TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                   num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                   axes_dims_rope=(16, 56, 56), zero_cond_t=False, use_additional_t_cond=False,
                   use_layer3d_rope=False)
VAE = dict(_WAN_VAE, input_channels=3)
TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
            num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=128000,
            rms_norm_eps=1e-6, max_window_layers=28, sliding_window=32768, use_sliding_window=False,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[16, 24, 24]))
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, hidden_act="silu", in_channels=3,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=112,
              out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31])
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
PUBLISHED = dict(transformer=TRANSFORMER, vae=VAE, text=TEXT, vision=VISION, scheduler=SCHEDULER,
                 tokenizer_vocab=4096)
CALL = dict(height=1328, width=1328, num_inference_steps=50, true_cfg_scale=4.0, negative_prompt=" ",
            max_sequence_length=512)

# Tiny: widths and depths shrink, every other constant is published (tests/conformance/
# test_tiny_configs.py). Head dim 16 = RoPE axes (4, 6, 6) in the published 1:3.5:3.5 spirit,
# the text encoder's head dim 8 = 2 x mrope (1, 1, 2); the 16 latent channels, 2x2 patches and
# 8x VAE (three downsamples) stay, so 32x32 pixels -> 4x4 latents -> 2x2 = 4 image tokens.
# The vision tower keeps 8 blocks so block 7 is its full-attention block, as published.
TINY = dict(
    transformer=dict(TRANSFORMER, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                     axes_dims_rope=(4, 6, 6)),
    vae=dict(VAE, base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    text=dict(TEXT, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2,
              rope_parameters=dict(TEXT["rope_parameters"], mrope_section=[1, 1, 2])),
    vision=dict(VISION, depth=8, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32),
    scheduler=SCHEDULER, tokenizer_vocab=512,
)
TINY_CALL = dict(height=32, width=32, num_inference_steps=2, true_cfg_scale=4.0, negative_prompt=" ",
                 max_sequence_length=512)

VARIANTS = {v.name: v for v in [
    Variant(name="qwen-image", family="qwen_image", config=PUBLISHED, hub_id="Qwen/Qwen-Image",
            description="text-to-image, 20B MMDiT, Qwen2.5-VL-7B text encoder", call_defaults=CALL),
    Variant(name="qwen-image-tiny", family="qwen_image", config=TINY, tiny=True,
            description="2 blocks, dim 32, a 2-layer Qwen2.5-VL; random, offline", call_defaults=TINY_CALL),
]}
# Qwen's chat markers, the ones QwenImagePipeline's prompt template uses (ids 0..2 in-process).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
