"""Qwen-Image (text-to-image) over diffusers' QwenImagePipeline / QwenImageTransformer2DModel.
The numbers and their sources are in `config`."""

from __future__ import annotations

from typing import Any

import torch

from .._tokenizers import byte_bpe_tokenizer
from ...engine import Preparation, joint_norm_rope_preparation
from ..base import CallLimits, Variant, init_on
from ..diffusers_pipeline import DiffusersPipelineAdapter
from . import config as C
from .attention import processor_class


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config, created on `device` in `dtype` directly."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # lazy: as above

    cfg = variant.config
    # The in-process tokenizer does not reproduce Qwen's ids: the pipeline's fixed 34-token drop
    # of the template's system prefix then drops 34 of ours (random weights: same shapes and path).
    tokenizer = byte_bpe_tokenizer(vocab_size=min(cfg["tokenizer_vocab"], 4096), specials=C.SPECIALS,
                                   eos="<|im_end|>", pad="<|endoftext|>", model_max_length=32768)
    te_cfg = Qwen2_5_VLConfig(text_config=dict(cfg["text"], bos_token_id=None, eos_token_id=2, pad_token_id=0),
                              vision_config=cfg["vision"])
    with init_on(device, dtype):
        transformer = QwenImageTransformer2DModel(**cfg["transformer"])
        text_encoder = Qwen2_5_VLForConditionalGeneration(te_cfg)
        vae = AutoencoderKLQwenImage(**cfg["vae"])
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]), vae=vae,
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


class QwenImageAdapter(DiffusersPipelineAdapter):
    family = "qwen_image"
    spec_file = "qwen_image.toml"
    variants = C.VARIANTS
    aliases = {"qwen-image-20b": "qwen-image"}
    weights_families = ("Qwen-Image",)
    component_names = ("transformer", "text_encoder", "vae")
    output_kind = "image"
    output_suffixes = (".png", ".jpg", ".jpeg", ".webp")
    cfg_option = "true_cfg_scale"  # QwenImagePipeline: true CFG needs true_cfg_scale > 1 and a negative prompt
    cfg_needs_negative_prompt = True

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def preparations(self, pipe) -> list[Preparation]:
        return [joint_norm_rope_preparation("Qwen-Image", [pipe.transformer], processor_class)]

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """QwenImagePipeline's own limit on the prompt (1024 tokens), checked before the build
        instead of at the call."""
        return {**super().count_caps(variant), "max_sequence_length": (1024, "QwenImagePipeline's limit")}

    def call_limits(self, variant: Variant) -> CallLimits:
        """Pixels divide by the VAE's downsampling (2 per temporal-downsample entry: 8 published)
        times the 2x2 patches; RoPE is computed per call (no longest side)."""
        down = 2 ** len(variant.config["vae"]["temperal_downsample"])
        patch = variant.config["transformer"]["patch_size"]
        return CallLimits(pixel_multiple=down * patch, why_multiple=f"VAE {down}x down x {patch}x{patch} patches")

    def check_shape(self, pipe, call: dict[str, Any]) -> None:
        self.check_packed_shape(pipe, call, "Qwen-Image")

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0, text_len: int = 256) -> dict[str, Any]:
        """One QwenImageTransformer2DModel forward as QwenImagePipeline makes it: packed latents
        (B, (H/16)(W/16), 64), the text encoder's last hidden states (B, text_len, 3584) with no
        mask (the pipeline drops an all-ones mask), timestep in [0, 1], img_shapes per sample.
        text_len: the prompt's tokens after the template (QwenImagePipeline pads to the longest
        prompt, not to a fixed length); 256 is a chosen size, `--shape text_len=N` sets it."""
        gh, gw, rnd = self.packed_grid(pipe, variant, height, width, frames, seed)
        t = pipe.transformer
        p = next(t.parameters())
        return dict(hidden_states=rnd(batch, gh * gw, t.config.in_channels),
                    encoder_hidden_states=rnd(batch, text_len, t.config.joint_attention_dim),
                    encoder_hidden_states_mask=None,
                    timestep=torch.full((batch,), 0.5, device=p.device, dtype=p.dtype),
                    img_shapes=[[(1, gh, gw)]] * batch, attention_kwargs={}, return_dict=False)
