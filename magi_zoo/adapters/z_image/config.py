"""Z-Image-Turbo's published configuration (the Tongyi-MAI/Z-Image-Turbo repository's diffusers
layout) and the tiny one, as keyword arguments of the diffusers / transformers classes, and the
variants over them (the config tables; the adapter is `adapter.py`).

Where each number comes from:
- transformer/config.json (ZImageTransformer2DModel): 2x2 patches of 16 latent channels, one
  temporal patch, dim 3840, 30 layers after 2 noise-refiner and 2 context-refiner blocks, 30
  heads (x 128; no grouped KV), q/k RMSNorm, eps 1e-5, caption features 2560 wide (the text
  encoder's hidden size), RoPE theta 256 over axes (32, 48, 48) with lengths (1024, 512, 512),
  t_scale 1000 -- diffusers 0.42's class defaults, which were written from it.
- vae/config.json (AutoencoderKL): FLUX.1's VAE -- 16 latent channels, 4 levels of (128, 256,
  512, 512), 2 layers per block, no quant convs, scaling 0.3611, shift 0.1159.
- text_encoder/config.json: Qwen3-4B (Qwen3Model: hidden 2560, FFN 9728, 36 layers, 32 heads /
  8 KV heads x 128, vocab 151936, rope theta 1e6, tied embeddings); ZImagePipeline reads its
  second-to-last hidden state, the prompt's tokens only (the padding is dropped per prompt).
- scheduler/scheduler_config.json: FlowMatchEuler, shift 3.0, no dynamic shifting.
- call defaults: the model card's example -- 1024x1024, 9 steps (8 transformer forwards: the
  last sigma is 0), guidance_scale 0.0 (the Turbo model is guidance-distilled: ZImagePipeline
  runs CFG at guidance_scale > 0), max_sequence_length 512 (ZImagePipeline's).
"""

from __future__ import annotations

from ..base import Variant
from ..flux2.config import QWEN3_4B

TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                   n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                   rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
           layers_per_block=2, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           act_fn="silu", norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159,
           use_quant_conv=False, use_post_quant_conv=False, force_upcast=True, mid_block_add_attention=True)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
PUBLISHED = dict(transformer=TRANSFORMER, vae=VAE, text=QWEN3_4B, scheduler=SCHEDULER, tokenizer_vocab=4096)
CALL = dict(height=1024, width=1024, num_inference_steps=9, guidance_scale=0.0, max_sequence_length=512)

# Tiny: widths and depths shrink, every other constant is published (tests/conformance/
# test_tiny_configs.py). Head dim 16 = RoPE axes (4, 6, 6) in the published 2:3:3 spirit; the
# text encoder keeps 3 layers so its second-to-last hidden state is a layer's output; the 16
# latent channels, 2x2 patches and 8x VAE stay, so 32x32 pixels -> 4x4 latents -> 4 image tokens.
TINY = dict(
    transformer=dict(TRANSFORMER, dim=32, n_layers=2, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6]),
    vae=dict(VAE, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8),
    text=dict(QWEN3_4B, vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    scheduler=SCHEDULER, tokenizer_vocab=512,
)
TINY_CALL = dict(CALL, height=32, width=32, num_inference_steps=2)

VARIANTS = {v.name: v for v in [
    Variant(name="z-image-turbo", family="z_image", config=PUBLISHED, hub_id="Tongyi-MAI/Z-Image-Turbo",
            description="text-to-image, 6B single-stream DiT, 8-step distilled, Qwen3-4B encoder", call_defaults=CALL),
    Variant(name="z-image-tiny", family="z_image", config=TINY, tiny=True,
            description="2 + 2 + 2 blocks, dim 32, a 3-layer Qwen3; random, offline", call_defaults=TINY_CALL),
]}
