"""Flux.1 (text-to-image) over diffusers' FluxPipeline / FluxTransformer2DModel.

Variants are the published configs, one line each; the numbers are those of the
black-forest-labs/FLUX.1-{dev,schnell} repositories' config.json files (the diffusers
layout: transformer/, text_encoder/ = CLIP ViT-L/14 text model, text_encoder_2/ = T5 v1.1
XXL encoder, vae/, scheduler/), cross-checked with BFL's reference `flux` package
(hidden 3072 = 24 heads x 128, depth 19 + 38, axes_dim (16, 56, 56), AE ch 128,
ch_mult (1, 2, 4, 4), z 16, scale 0.3611, shift 0.1159).
"""

from __future__ import annotations

from typing import Any

import torch

from ...engine import Preparation, joint_norm_rope_preparation
from ...engine.compat.diffusers import flux_latent_image_ids
from .._tokenizers import byte_bpe_tokenizer
from ..base import CallLimits, Variant, init_on
from ..diffusers_pipeline import DiffusersPipelineAdapter
from .activations import activation_gib
from .attention import processor_class
from .single_blocks import fused_mlp_preparation, single_stream_preparation

# -- published configs ---------------------------------------------------------------------
_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56))
_SCHNELL = dict(_DEV, guidance_embeds=False)  # timestep-distilled: no guidance embedder
# openai/clip-vit-large-patch14 text tower (what FLUX.1-*/text_encoder ships).
_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
               num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
               projection_dim=768, layer_norm_eps=1e-5)
# google/t5-v1_1-xxl encoder (FLUX.1-*/text_encoder_2).
_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               relative_attention_num_buckets=32, relative_attention_max_distance=128,
               feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=False)
_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2, norm_num_groups=32, act_fn="silu", sample_size=1024,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
            force_upcast=True)
# FLUX.1-dev: resolution-dependent shift mu, interpolated between 0.5 (256 image tokens)
# and 1.15 (4096 tokens = 1024^2), as in BFL's get_schedule(shift=True).
_SCHED_DEV = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                  max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
# FLUX.1-schnell's published scheduler_config has shift 1.0 and no dynamic shifting: the
# reference sampler calls get_schedule(..., shift=(name != "flux-schnell")), i.e. plain
# linear sigmas for the 4-step distilled model.
_SCHED_SCHNELL = dict(_SCHED_DEV, shift=1.0, use_dynamic_shifting=False)

# Tiny (CPU tests, demo): 2 double + 2 single blocks, inner dim 32 (2 heads x 16), RoPE
# axes (4, 4, 8) summing to the head dim -- diffusers' own tiny Flux test sizes. Every
# structural constant is the published one (tests/conformance/test_tiny_configs.py): the T5's
# relative-attention distance 128, the VAE's 4 levels (x8 down) and 16 latent channels, so
# transformer in_channels = 16 x 2x2 packing = 64. 32x32 images -> 4x4 latents -> 4 tokens.
_TINY = dict(
    transformer=dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16,
                     num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                     guidance_embeds=True, axes_dims_rope=(4, 4, 8)),
    clip=dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=32, layer_norm_eps=1e-5),
    t5=dict(vocab_size=512, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8, relative_attention_max_distance=128,
            feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, tie_word_embeddings=False),
    vae=dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 16, 16),
             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             layers_per_block=1, norm_num_groups=8, act_fn="silu", sample_size=32,
             scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
             force_upcast=True),
    scheduler=_SCHED_DEV, clip_vocab=512, t5_vocab=512,
)


def _variant(name, transformer, scheduler, hub_id, desc, **call):
    cfg = dict(transformer=transformer, clip=_CLIP_L, t5=_T5_XXL, vae=_VAE, scheduler=scheduler,
               clip_vocab=_CLIP_L["vocab_size"], t5_vocab=_T5_XXL["vocab_size"])
    return Variant(name=name, family="flux", config=cfg, hub_id=hub_id, description=desc,
                   call_defaults=dict(height=1024, width=1024, **call))


# Call defaults as the official release samples: BFL's reference CLI (black-forest-labs/flux,
# src/flux/cli.py) takes 50 steps for the guidance-distilled dev model and 4 for schnell,
# guidance 3.5, T5 prompts of 512 / 256 tokens (diffusers' FluxPipeline defaults to 28 steps).
# 1024x1024 is the size of the model cards' examples (the reference CLI defaults to 1360x768).
VARIANTS = {
    v.name: v
    for v in [
        _variant("flux.1-dev", _DEV, _SCHED_DEV, "black-forest-labs/FLUX.1-dev",
                 "text-to-image, 12B, guidance-distilled", num_inference_steps=50, guidance_scale=3.5,
                 max_sequence_length=512),
        _variant("flux.1-schnell", _SCHNELL, _SCHED_SCHNELL, "black-forest-labs/FLUX.1-schnell",
                 "text-to-image, 12B, 4-step timestep-distilled", num_inference_steps=4, guidance_scale=0.0,
                 max_sequence_length=256),
        Variant(name="flux-tiny", family="flux", config=_TINY, tiny=True,
                description="2 double + 2 single blocks, dim 32; random, offline, for CPU tests and the demo",
                call_defaults=dict(height=32, width=32, num_inference_steps=2, guidance_scale=3.5,
                                   max_sequence_length=16)),
    ]
}


def _clip_tokenizer(vocab: int):
    """CLIP-style tokenizer built in-process: <|startoftext|> text <|endoftext|>, padded with
    <|endoftext|> to 77 (CLIP pads with its end token)."""
    from tokenizers import processors  # lazy: tokenizers is only needed to build one

    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tok = byte_bpe_tokenizer(vocab_size=min(vocab, 4096), specials=[bos, eos], bos=bos, eos=eos, pad=eos,
                             unk=eos, model_max_length=77)
    backend = tok.backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B {eos}",
        special_tokens=[(bos, backend.token_to_id(bos)), (eos, backend.token_to_id(eos))])
    return tok


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config, created on `device` in `dtype` directly (a
    12B transformer + 4.7B T5 built on the host would take minutes)."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel  # lazy: as above

    cfg = variant.config
    tokenizer = _clip_tokenizer(cfg["clip_vocab"])
    # CLIP pools the hidden state at the first end token. The published config keeps the
    # legacy eos_token_id=2 (pool at argmax id, which is <|endoftext|>=49407 in the real
    # vocabulary); the in-process tokenizer puts its end token at id 1, so say so.
    clip_cfg = CLIPTextConfig(**cfg["clip"], bos_token_id=0, eos_token_id=1, pad_token_id=1)
    # T5 vocabulary is trained small and padded to the model's vocab by placeholders only if
    # needed; ids stay < vocab_size, which is all the embedding needs.
    tokenizer_2 = byte_bpe_tokenizer(vocab_size=min(cfg["t5_vocab"], 4096), specials=["<pad>", "</s>", "<unk>"],
                                     eos="</s>", pad="<pad>", unk="<unk>", append_eos=True, model_max_length=512)
    with init_on(device, dtype):
        transformer = FluxTransformer2DModel(**cfg["transformer"])
        text_encoder = CLIPTextModel(clip_cfg)
        text_encoder_2 = T5EncoderModel(T5Config(**cfg["t5"]))
        # Flux's VAE runs in the pipeline dtype (bf16 on GPU), as diffusers' published usage
        # `FluxPipeline.from_pretrained(..., torch_dtype=torch.bfloat16)` does.
        vae = AutoencoderKL(**cfg["vae"])
    for m in (transformer, text_encoder, text_encoder_2, vae):
        m.eval()  # freshly built modules are in training mode (T5 dropout 0.1 on); from_pretrained evals
    scheduler = FlowMatchEulerDiscreteScheduler(**cfg["scheduler"])
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def _latent_grid(pipe, height: int, width: int) -> tuple[int, int]:
    """Packed-token grid for an image: VAE downsample, then 2x2 patches (FluxPipeline.prepare_latents)."""
    f = pipe.vae_scale_factor * 2
    if height % f or width % f:
        raise ValueError(f"Flux needs height and width divisible by {f} (VAE x{pipe.vae_scale_factor} "
                         f"times 2x2 packing); got {height}x{width}")
    return height // f, width // f


class FluxAdapter(DiffusersPipelineAdapter):
    family = "flux"
    spec_file = "flux.toml"
    variants = VARIANTS
    aliases = {"flux": "flux.1-dev", "flux.1": "flux.1-dev", "flux-dev": "flux.1-dev",
               "flux-schnell": "flux.1-schnell"}
    component_names = ("transformer", "text_encoder", "text_encoder_2", "vae")
    output_kind = "image"
    output_suffixes = (".png", ".jpg", ".jpeg", ".webp")
    cfg_option = "true_cfg_scale"  # FluxPipeline: true CFG needs true_cfg_scale > 1 and a negative prompt
    cfg_needs_negative_prompt = True

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def preparations(self, pipe) -> list[Preparation]:
        return [single_stream_preparation(pipe.transformer), fused_mlp_preparation(pipe.transformer),
                joint_norm_rope_preparation("Flux", [pipe.transformer], processor_class)]

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """FluxPipeline's own limit on the T5 prompt (512 tokens), checked before the build
        instead of at the call."""
        return {**super().count_caps(variant), "max_sequence_length": (512, "FluxPipeline's T5 limit")}

    def call_limits(self, variant: Variant) -> CallLimits:
        """From the config: pixels divide by the VAE's downsampling (2 per level after the
        first: 8 published) times the 2x2 packing; RoPE is computed per call, so no longest side."""
        down = 2 ** (len(variant.config["vae"]["block_out_channels"]) - 1)
        return CallLimits(pixel_multiple=down * 2, why_multiple=f"VAE {down}x down x 2x2 packing")

    def activation_estimate(self, variant: Variant, call: dict[str, Any],
                            bytes_per_element: int) -> dict[str, float]:
        """The transformer's and the VAE decoder's peaks for this shape (`activations.activation_gib`)."""
        return activation_gib(variant.config, call, bytes_per_element)

    def check_shape(self, pipe, call: dict[str, Any]) -> None:
        _latent_grid(pipe, call["height"], call["width"])

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0) -> dict[str, Any]:
        """One FluxTransformer2DModel forward as FluxPipeline makes it: packed latents
        (B, (H/16)(W/16), 64), T5 states (B, max_sequence_length, 4096), CLIP pooled (B, 768),
        timestep in [0, 1], 2-D position ids, and guidance for guidance-distilled models."""
        if frames not in (None, 1):
            raise ValueError(f"{variant.name} makes images; frames={frames} has no meaning")
        d = variant.call_defaults
        height, width = height or d["height"], width or d["width"]
        t = pipe.transformer
        cfg = t.config
        p = next(t.parameters())
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=p.device, dtype=p.dtype)
        gh, gw = _latent_grid(pipe, height, width)
        text_len = d.get("max_sequence_length", 512)
        img_ids = flux_latent_image_ids(pipe, batch, gh, gw, p.device, p.dtype)  # (gh*gw, 3): [0, row, col]
        kw = dict(hidden_states=rnd(batch, gh * gw, cfg.in_channels),
                  encoder_hidden_states=rnd(batch, text_len, cfg.joint_attention_dim),
                  pooled_projections=rnd(batch, cfg.pooled_projection_dim),
                  # the pipeline passes scheduler timesteps / 1000, so a mid-schedule step is 0.5
                  timestep=torch.full((batch,), 0.5, device=p.device, dtype=p.dtype),
                  img_ids=img_ids, txt_ids=torch.zeros(text_len, 3, device=p.device, dtype=p.dtype),
                  # FluxPipeline always passes a dict here; None would be a different guard
                  # (and a second compiled variant) for every block.
                  joint_attention_kwargs={}, return_dict=False)
        if cfg.guidance_embeds:
            kw["guidance"] = torch.full((batch,), d.get("guidance_scale", 3.5), device=p.device,
                                        dtype=torch.float32)
        return kw
