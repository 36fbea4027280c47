"""FLUX.2 over diffusers' Flux2Pipeline / Flux2Transformer2DModel: text-to-image, and
image-conditioned generation with `image=` (`--image FILE`: the pipeline encodes it with the VAE
and appends its tokens to the image sequence). The numbers and their sources are in `config`."""

from __future__ import annotations

from typing import Any

import torch

from .._tokenizers import byte_bpe_tokenizer
from ...engine import Preparation, joint_norm_rope_preparation
from ..base import CallLimits, Variant, init_on
from ..diffusers_pipeline import DiffusersPipelineAdapter
from . import config as C
from .attention import processor_classes


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config, created on `device` in `dtype` directly."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline,
                           Flux2Transformer2DModel)
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM  # lazy: as above

    cfg, klein = variant.config, "pipeline" in variant.config  # [klein]: a Qwen3 encoder
    tokenizer = byte_bpe_tokenizer(vocab_size=min(cfg["tokenizer_vocab"], 4096),
                                   **(C.QWEN3_TOKENIZER if klein else C.MISTRAL_TOKENIZER))
    tokenizer.chat_template = C.QWEN3_CHAT_TEMPLATE if klein else C.MISTRAL_CHAT_TEMPLATE
    te_cfg = (Qwen3Config(**dict(cfg["text"], **C.QWEN3_IDS)) if klein else
              Mistral3Config(text_config=dict(cfg["text"], **C.MISTRAL_IDS), vision_config=cfg["vision"], **cfg["encoder"]))
    with init_on(device, dtype):
        transformer = Flux2Transformer2DModel(**cfg["transformer"])
        text_encoder = (Qwen3ForCausalLM if klein else Mistral3ForConditionalGeneration)(te_cfg)
        vae = AutoencoderKLFlux2(**cfg["vae"])
    parts = dict(scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]), vae=vae, text_encoder=text_encoder,
                 tokenizer=tokenizer, transformer=transformer)
    return Flux2KleinPipeline(**parts, **cfg["pipeline"]) if klein else Flux2Pipeline(**parts)


class Flux2Adapter(DiffusersPipelineAdapter):
    family = "flux2"
    spec_file = "flux2.toml"
    variants = C.VARIANTS
    aliases = {"flux.2": "flux.2-dev", "flux2": "flux.2-dev", "flux2-dev": "flux.2-dev"}
    weights_families = ("FLUX.2",)
    component_names = ("transformer", "text_encoder", "vae")
    output_kind = "image"
    output_suffixes = (".png", ".jpg", ".jpeg", ".webp")
    run_options = DiffusersPipelineAdapter.run_options + ("image",)  # a conditioning image (editing)
    cfg_option = "guidance_scale"  # Flux2KleinPipeline: CFG at guidance_scale > 1 unless is_distilled
    min_image_side = 64  # Flux2Pipeline refuses smaller conditioning images
    image_kinds = ("PIL",)  # Flux2ImageProcessor.check_image_input: "Image must be a PIL.Image.Image"

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def runs_cfg(self, call: dict[str, Any], variant: Variant | None = None) -> bool:
        """Only [klein] base runs CFG (FLUX.2-dev embeds guidance, the distilled [klein] ignores it)."""
        base = variant is not None and (variant.config.get("pipeline") or {}).get("is_distilled") is False
        return base and super().runs_cfg(call, variant)

    def preparations(self, pipe) -> list[Preparation]:
        return [joint_norm_rope_preparation("FLUX.2", [pipe.transformer], processor_classes)]

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """The prompt's tokens at most the text encoder's position table (Mistral's, or Klein's Qwen3)."""
        n = variant.config["text"]["max_position_embeddings"]
        return {**super().count_caps(variant), "max_sequence_length": (n, f"its text encoder holds {n:,} positions")}

    def call_limits(self, variant: Variant) -> CallLimits:
        """Pixels divide by the VAE's downsampling (2 per level after the first: 8 published)
        times the 2x2 latent patches; RoPE is computed per call (no longest side)."""
        down = 2 ** (len(variant.config["vae"]["block_out_channels"]) - 1)
        return CallLimits(pixel_multiple=down * 2, why_multiple=f"VAE {down}x down x 2x2 patches")

    def check_shape(self, pipe, call: dict[str, Any]) -> None:
        self.check_packed_shape(pipe, call, "FLUX.2")

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0, cond_tokens: int = 0) -> dict[str, Any]:
        """One Flux2Transformer2DModel forward as Flux2Pipeline makes it: packed latents
        (B, (H/16)(W/16), 128), the three stacked Mistral hidden states (B, 512, 15360), timestep
        in [0, 1], 4-D position ids (T, H, W, L) for image and text tokens, guidance.
        cond_tokens: a conditioning image's tokens appended to the image sequence (`--shape
        cond_tokens=N`; the pipeline puts them at T = 10 in their own grid -- here one row)."""
        gh, gw, rnd = self.packed_grid(pipe, variant, height, width, frames, seed)
        t, d = pipe.transformer, variant.call_defaults
        p = next(t.parameters())
        text_len = d.get("max_sequence_length", 512)
        ar = lambda n: torch.arange(n, device=p.device)  # noqa: E731
        zero = torch.zeros(1, dtype=torch.long, device=p.device)
        img_ids = torch.cartesian_prod(zero, ar(gh), ar(gw), zero)  # what Flux2Pipeline._prepare_latent_ids makes
        if cond_tokens:
            img_ids = torch.cat([img_ids, torch.cartesian_prod(zero + 10, zero, ar(cond_tokens), zero)])
        txt_ids = torch.cartesian_prod(zero, zero, zero, ar(text_len))
        return dict(hidden_states=rnd(batch, gh * gw + cond_tokens, t.config.in_channels),
                    encoder_hidden_states=rnd(batch, text_len, t.config.joint_attention_dim),
                    timestep=torch.full((batch,), 0.5, device=p.device, dtype=p.dtype),
                    img_ids=img_ids.expand(batch, -1, -1), txt_ids=txt_ids.expand(batch, -1, -1),
                    guidance=torch.full((batch,), d.get("guidance_scale", 4.0), device=p.device, dtype=torch.float32)
                    if t.config.guidance_embeds else None,  # [klein]: no guidance embedder, the pipeline passes None
                    joint_attention_kwargs={}, return_dict=False)
