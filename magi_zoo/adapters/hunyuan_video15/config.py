"""HunyuanVideo-1.5's published configurations and the tiny one, as keyword arguments of the
diffusers / transformers classes (the config tables; the adapter is `adapter.py`).

Where each number comes from:
- transformer/config.json: diffusers' `scripts/convert_hunyuan_video1_5_to_diffusers.py`
  writes `HunyuanVideo15Transformer3DModel(**TRANSFORMER_CONFIGS[type])` over the class
  defaults (16 heads x 128 = 2048 wide, 54 double-stream blocks, 65 input channels = 32 noisy
  latents + 32 condition latents + 1 mask, 2 token-refiner layers, RoPE axes (16, 56, 56), text
  3584 = Qwen2.5-VL-7B's width, ByT5 1472, SigLIP 1152); per type only target_size (480p: 640,
  720p: 960), task_type and use_meanflow differ. The script's "480p_t2v" entry says
  task_type "i2v"; the field only names the task (the forward never reads it), kept as written.
- vae/config.json: `AutoencoderKLHunyuanVideo15()` defaults (the script's `convert_vae`):
  32 latent channels, 16x spatial, 4x temporal, scaling 1.03682.
- scheduler_config.json: FlowMatchEulerDiscreteScheduler(shift=...) with the script's
  SCHEDULER_CONFIGS: 480p 5.0, 720p t2v 9.0; guider: ClassifierFreeGuidance(guidance_scale=6.0)
  (GUIDANCE_CONFIGS; the pipeline takes no guidance argument, the guider component holds it).
- text_encoder: Qwen/Qwen2.5-VL-7B-Instruct's language model (the script's `load_mllm`), its
  published text config (28 layers, 3584 wide, 28 heads / 4 KV heads, mrope (16, 24, 24)).
- text_encoder_2: google/byt5-small's encoder (12 layers, d_model 1472, 6 heads) with the
  Glyph-SDXL-v2 colour and font tokens added (`add_special_token`: the vocabulary grows to
  1510, the value the published text_encoder_2/config.json holds).
- image-to-video: the same transformer config (480p: the class defaults, 720p: target_size 960),
  scheduler shift 480p 5.0 / 720p 7.0, SigLIP from FLUX.1-Redux-dev (the script's `load_siglip`).
- call defaults: 121 frames, 50 steps, 24 fps (Tencent-Hunyuan/HunyuanVideo-1.5's generate.py);
  480x848 / 720x1280 is what the pipeline computes itself for 16:9 at target_size 640 / 960.
"""

from __future__ import annotations

from ..base import Variant

TRANSFORMER = dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128, num_layers=54,
                   num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
                   text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152, rope_theta=256.0,
                   rope_axes_dim=(16, 56, 56), target_size=640, task_type="i2v", use_meanflow=False)
T2V_480P = TRANSFORMER
T2V_720P = dict(TRANSFORMER, target_size=960, task_type="t2v")
I2V_480P = TRANSFORMER  # the script's "480p_i2v" is not in TRANSFORMER_CONFIGS: the class defaults
I2V_720P = dict(TRANSFORMER, target_size=960)
# The image-to-video pipelines' image encoder: FLUX.1-Redux-dev's SigLIP so400m (patch 14 at
# 384^2: 27 x 27 = 729 tokens, the pipeline's vision_num_semantic_tokens, 1152 wide = the
# transformer's image_embed_dim), the script's `load_siglip`; its processor resizes to 384^2 and
# normalizes to [-1, 1].
SIGLIP = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, image_size=384,
              patch_size=14, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
VAE = dict(in_channels=3, out_channels=3, latent_channels=32, block_out_channels=(128, 256, 512, 1024, 1024),
           layers_per_block=2, spatial_compression_ratio=16, temporal_compression_ratio=4,
           downsample_match_channel=True, upsample_match_channel=True, scaling_factor=1.03682)
# Qwen2.5-VL-7B-Instruct's text model (transformers 5 spells rope_scaling as rope_parameters).
QWEN25_VL_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                    num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=128000,
                    rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0,
                                                            mrope_section=[16, 24, 24]))
# google/byt5-small's encoder, vocabulary grown by the Glyph-SDXL-v2 tokens.
BYT5 = dict(vocab_size=1510, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
            layer_norm_epsilon=1e-6, tie_word_embeddings=False)
SCHEDULER = dict(shift=5.0)
CALL = dict(num_frames=121, num_inference_steps=50)

# Tiny: the published structure at small widths and depths. The transformer keeps 65 = 32 + 32 + 1
# input channels against the published VAE geometry (32 latent channels, 16x spatial over 5 levels,
# 4x temporal) at 8 to 64 channels a level (the last a multiple of 2 x 32, as 1024 is: the encoder
# groups its width into the 64 mean + logvar channels, the decoder repeats the latents up to it).
# The RoPE axes split the 32-wide head 4 + 14 + 14 as (16, 56, 56) splits 128. Text: Qwen at 2
# layers (its mrope split scaled the same way), ByT5 at 2 layers. TINY_SIGLIP: the image encoder
# at 1 layer (tests/models/hunyuan_video15 runs image-to-video with it).
# tests/conformance/test_tiny_configs.py compares each field with the published one.
TINY = dict(
    transformer=dict(TRANSFORMER, num_attention_heads=2, attention_head_dim=32, num_layers=2, num_refiner_layers=1,
                     text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=16, rope_axes_dim=(4, 14, 14),
                     target_size=64),
    vae=dict(VAE, block_out_channels=(8, 16, 32, 64, 64), layers_per_block=1),
    text_encoder=dict(QWEN25_VL_7B, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1,
                      rope_parameters=dict(QWEN25_VL_7B["rope_parameters"], mrope_section=[2, 3, 3])),
    text_encoder_2=dict(BYT5, vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4),
    scheduler=SCHEDULER, guidance_scale=6.0, tokenizer_vocab=512, fps=24,
)
TINY_CALL = dict(height=64, width=64, num_frames=5, num_inference_steps=1)
TINY_SIGLIP = dict(SIGLIP, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)


def _variant(name, transformer, hub_id, desc, *, shift, height, width, i2v=False):
    """Text-to-video calls default to height x width (16:9 at the target size, as the pipeline
    computes it); image-to-video takes its size from the image (that pipeline has no height)."""
    cfg = dict(transformer=transformer, vae=VAE, text_encoder=QWEN25_VL_7B, text_encoder_2=BYT5,
               scheduler=dict(SCHEDULER, shift=shift), guidance_scale=6.0, tokenizer_vocab=4096, fps=24,
               **(dict(image_encoder=SIGLIP) if i2v else {}))
    call = dict(CALL) if i2v else dict(CALL, height=height, width=width)
    return Variant(name=name, family="hunyuanvideo15", config=cfg, hub_id=hub_id, description=desc, call_defaults=call)


VARIANTS = {
    v.name: v
    for v in [
        _variant("hunyuanvideo-1.5-480p-t2v", T2V_480P, "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                 "text-to-video, 8.3B, 480p", shift=5.0, height=480, width=848),
        _variant("hunyuanvideo-1.5-720p-t2v", T2V_720P, "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
                 "text-to-video, 8.3B, 720p", shift=9.0, height=720, width=1280),
        _variant("hunyuanvideo-1.5-480p-i2v", I2V_480P, "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v",
                 "image-to-video, 8.3B, 480p", shift=5.0, height=480, width=848, i2v=True),
        _variant("hunyuanvideo-1.5-720p-i2v", I2V_720P, "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v",
                 "image-to-video, 8.3B, 720p", shift=7.0, height=720, width=1280, i2v=True),
        Variant(name="hunyuanvideo-1.5-tiny", family="hunyuanvideo15", config=TINY, tiny=True,
                description="2 blocks, dim 64, both text encoders; random, offline",
                call_defaults=TINY_CALL),
    ]
}
