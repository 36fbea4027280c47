"""Wan2.2 (text/text+image-to-video) over diffusers' WanPipeline: the Wan2.1 adapter with
Wan2.2's variants table.

What Wan2.2 adds, all handled by WanPipeline itself (diffusers >= 0.35):
- A14B is two experts of the Wan2.1-14B shape: `transformer` denoises the high-noise steps
  (t >= boundary_ratio * 1000), `transformer_2` the low-noise ones, each with its own
  guidance scale (`guidance_scale`, `guidance_scale_2`).
- TI2V-5B is one transformer on the Wan2.2 VAE (48 latent channels, 16x spatial, 4x
  temporal) with `expand_timesteps`: one timestep per patch token instead of per sample.

The compile spec is Wan2.1's (`wan.toml`): every key matches in every Wan2.2 variant, and
its class key `WanTransformerBlock` matches the blocks of both experts, so one compiled
block serves the whole A14B run (the two experts have the same shapes; dynamo guards on
type and tensor metadata, not identity).

Where each number comes from (the diffusers-format repos were written by diffusers'
`scripts/convert_wan_to_diffusers.py`, which holds every config literally):
- transformer / transformer_2 config.json: the conversion script's "Wan2.2-T2V-A14B" and
  "Wan2.2-TI2V-5B" configs; A14B's transformer_2/config.json also read from the published
  repo page. WanTransformer3DModel defaults supply the rest (rope_max_seq_len 1024,
  image_dim / added_kv_proj_dim / pos_embed_seq_len null), as the published files list them.
- vae/config.json: the script's `vae22_diffusers_config` for TI2V-5B (also read from a
  published copy whose _name_or_path is Wan-AI/Wan2.2-TI2V-5B-Diffusers); A14B ships the
  Wan2.1 VAE (the script's `convert_vae()`, AutoencoderKLWan() defaults).
- scheduler_config.json: UniPC, flow_prediction, flow sigmas, flow_shift 5.0 for TI2V and
  3.0 for T2V-A14B (the script's `flow_shift` branch).
- model_index.json: boundary_ratio 0.875 (T2V-A14B), expand_timesteps true and
  boundary_ratio null (TI2V-5B) -- the script's pipeline constructors; the 5B values also
  read from a published copy of the 5B model_index.json.
- call defaults: TI2V-5B 704x1280, 121 frames, 50 steps, guidance 5.0, 24 fps (the
  model card example and Wan-Video/Wan2.2 wan/configs/wan_ti2v_5B.py). T2V-A14B: 40 steps,
  guidance_scale 4.0 (high noise) / guidance_scale_2 3.0 (low noise), 81 frames, 16 fps
  (the model card example; wan_t2v_A14B.py's sample_guide_scale = (3.0, 4.0), "low noise,
  high noise"); 480x832 is WanPipeline's default size and the resolution the published
  flow_shift 3.0 is for (the model card example itself renders 720x1280).
"""

from __future__ import annotations

from ..base import Variant
from ..wan import WanAdapter, distill
from ..wan.config import SCHEDULER, T2V_1_3B, T2V_14B, TINY, UMT5_XXL, VAE

# -- published configs ---------------------------------------------------------------------
# TI2V-5B: 24 heads x 128 = 3072 hidden, 30 layers, FFN 14336, 48 latent channels in/out.
_TI2V_5B = dict(T2V_1_3B, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48,
                out_channels=48)
# The Wan2.2 VAE: 48 latent channels; pixels are 2x2-patchified first (3 x 2 x 2 = 12 input
# channels), then three 2x residual downsamples: 2 x 8 = 16x spatial, 4x temporal. The
# published config also carries `clip_output: false`, which AutoencoderKLWan (diffusers
# 0.42) does not take; from_pretrained drops it.
_LATENTS_MEAN_22 = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
_LATENTS_STD_22 = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]
_VAE_22 = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
               attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0, is_residual=True,
               in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
               scale_factor_temporal=4, latents_mean=_LATENTS_MEAN_22, latents_std=_LATENTS_STD_22)

# Tiny: Wan2.1-tiny's modules; two experts of the same shape. With 4 UniPC steps at flow
# shift 3.0 the timesteps are 999, 900, 750, 500, so the published boundary 0.875 x 1000 =
# 875 gives 2 high-noise steps (transformer) and 2 low-noise steps (transformer_2).
_TINY_A14B = dict(TINY, transformer_2=TINY["transformer"], pipeline=dict(boundary_ratio=0.875))
# Tiny TI2V: the 5B path at small width -- 48-channel transformer, a residual, patchified
# 16x VAE, per-token timesteps. 64x64 pixels -> 4x4 latents -> 2x2 tokens per latent frame.
_TINY_TI2V = dict(
    TINY, transformer=dict(TINY["transformer"], in_channels=48, out_channels=48),
    vae=dict(_VAE_22, base_dim=8, decoder_base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1),
    scheduler=dict(SCHEDULER, flow_shift=5.0), pipeline=dict(expand_timesteps=True), fps=24,
)


def _published(name, hub_id, desc, transformers, vae, flow_shift, pipeline, fps, call):
    cfg = dict(transformers, text_encoder=UMT5_XXL, vae=vae, scheduler=dict(SCHEDULER, flow_shift=flow_shift),
               tokenizer_vocab=4096, pipeline=pipeline, fps=fps)
    return Variant(name=name, family="wan22", config=cfg, hub_id=hub_id, description=desc, call_defaults=call)


_A14B_CONFIG = dict(transformer=T2V_14B, transformer_2=T2V_14B, text_encoder=UMT5_XXL, vae=VAE,
                    scheduler=dict(SCHEDULER, flow_shift=3.0), tokenizer_vocab=4096,
                    pipeline=dict(boundary_ratio=0.875), fps=16)

VARIANTS = {
    v.name: v
    for v in [
        _published("wan2.2-ti2v-5b", "Wan-AI/Wan2.2-TI2V-5B-Diffusers", "text(+image)-to-video, 5B, 720p",
                   dict(transformer=_TI2V_5B), _VAE_22, 5.0, dict(expand_timesteps=True), 24,
                   dict(height=704, width=1280, num_frames=121, num_inference_steps=50, guidance_scale=5.0)),
        _published("wan2.2-t2v-a14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                   "text-to-video, 2 x 14B experts (high / low noise)",
                   dict(transformer=T2V_14B, transformer_2=T2V_14B), VAE, 3.0, dict(boundary_ratio=0.875), 16,
                   dict(height=480, width=832, num_frames=81, num_inference_steps=40, guidance_scale=4.0,
                        guidance_scale_2=3.0)),
        Variant(name="wan2.2-tiny", family="wan22", config=_TINY_A14B, tiny=True,
                description="2 experts x 4 blocks, dim 32, switched mid-run; random, offline",
                call_defaults=dict(height=32, width=32, num_frames=9, num_inference_steps=4, guidance_scale=4.0,
                                   guidance_scale_2=3.0, max_sequence_length=16)),
        Variant(name="wan2.2-ti2v-tiny", family="wan22", config=_TINY_TI2V, tiny=True,
                description="the TI2V-5B path (48-ch Wan2.2 VAE, per-token timesteps), 4 blocks, dim 32",
                call_defaults=dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0,
                                   max_sequence_length=16)),
        # LightX2V's 4-step distill LoRAs over T2V-A14B (wan/distill.py lists the sources): the
        # high-noise LoRA into `transformer`, the low-noise one into `transformer_2`; 4 Euler steps
        # at shift 5 put the published boundary 0.875 after step 2 (LightX2V's
        # boundary_step_index 2); guidance 1 on both experts (no CFG forward).
        Variant(name="wan2.2-t2v-a14b-distill-lora", family="wan22", hub_id="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                config=dict(_A14B_CONFIG, distill=distill.CONFIG, lora=distill.LORA_22_T2V),
                description="text-to-video, 2 x 14B experts + LightX2V's 4-step distill LoRAs",
                call_defaults=dict(height=480, width=832, num_frames=81, **distill.CALL, guidance_scale_2=1.0)),
    ]
}


class Wan22Adapter(WanAdapter):
    family = "wan22"
    variants = VARIANTS
    aliases = {"wan2.2": "wan2.2-t2v-a14b", "wan2.2-a14b": "wan2.2-t2v-a14b", "wan2.2-5b": "wan2.2-ti2v-5b"}
    # spec_file, fp32_components, build, denoiser_inputs and run are Wan2.1's. The
    # denoiser benchmarked is `transformer` (A14B: the high-noise expert; both have one shape).
    component_names = ("transformer", "transformer_2", "text_encoder", "vae")
