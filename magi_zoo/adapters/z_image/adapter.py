"""Z-Image over diffusers' ZImagePipeline / ZImageTransformer2DModel. The numbers and their
sources are in `config`.

The transformer runs one block class at three sites: 2 noise-refiner blocks on the image tokens,
2 context-refiner blocks (no modulation) on the caption tokens, then 30 blocks on both joined.
The spec keys each site by path, so each is a region of its own that compiles once for its own
inputs (the engine gives each region its own code object: `engine/compile/step.py`). Its
attention processor (`attention.py`) runs the q/k norms and the rotary embedding in one kernel."""

from __future__ import annotations

from typing import Any

import torch

from .._tokenizers import byte_bpe_tokenizer
from ...engine import Preparation
from ..base import CallLimits, Variant, init_on
from ..diffusers_pipeline import DiffusersPipelineAdapter
from ..flux2 import config as qwen3  # Qwen3's in-process tokenizer pieces (FLUX.2 [klein]'s encoder)
from . import config as C
from .attention import norm_rope_preparation


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config, created on `device` in `dtype` directly."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model  # lazy: as above

    cfg = variant.config
    tokenizer = byte_bpe_tokenizer(vocab_size=min(cfg["tokenizer_vocab"], 4096), **qwen3.QWEN3_TOKENIZER)
    tokenizer.chat_template = qwen3.QWEN3_CHAT_TEMPLATE
    with init_on(device, dtype):
        transformer = ZImageTransformer2DModel(**cfg["transformer"])
        text_encoder = Qwen3Model(Qwen3Config(**dict(cfg["text"], **qwen3.QWEN3_IDS)))
        vae = AutoencoderKL(**cfg["vae"])
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]), vae=vae,
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


class ZImageAdapter(DiffusersPipelineAdapter):
    family = "z_image"
    spec_file = "z_image.toml"
    variants = C.VARIANTS
    aliases = {"z-image": "z-image-turbo", "zimage": "z-image-turbo"}
    weights_families = ("Z-Image",)
    component_names = ("transformer", "text_encoder", "vae")
    output_kind = "image"
    output_suffixes = (".png", ".jpg", ".jpeg", ".webp")
    cfg_option = "guidance_scale"  # ZImagePipeline: do_classifier_free_guidance = guidance_scale > 0
    cfg_threshold = 0.0

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def preparations(self, pipe) -> list[Preparation]:
        return [norm_rope_preparation(pipe.transformer)]

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """The caption's tokens fit RoPE's first axis: diffusers pads the caption to a multiple of
        32 from position 1 and puts the image at the next position, which must be inside the
        table of `axes_lens[0]`: (1024 - 2) // 32 * 32 = 992 as published (a 1,024-token caption
        failed with an IndexError after the text encoder ran)."""
        n = variant.config["transformer"]["axes_lens"][0]
        cap = (n - 2) // 32 * 32
        return {**super().count_caps(variant),
                "max_sequence_length": (cap, f"its RoPE table has {n} caption positions, filled 32 at a time")}

    def call_limits(self, variant: Variant) -> CallLimits:
        """Pixels divide by the VAE's downsampling (2 per level after the first: 8 published)
        times the 2x2 patches; RoPE's image axes hold 512 positions each, so a side of the
        latent token grid may not pass 512 (8,192 pixels as published)."""
        down = 2 ** (len(variant.config["vae"]["block_out_channels"]) - 1)
        t = variant.config["transformer"]
        patch = t["all_patch_size"][0]
        side = min(t["axes_lens"][1:])
        return CallLimits(pixel_multiple=down * patch, why_multiple=f"VAE {down}x down x {patch}x{patch} patches",
                          max_grid=side, why_grid=f"its RoPE table has {side} positions per image axis")

    def check_shape(self, pipe, call: dict[str, Any]) -> None:
        self.check_packed_shape(pipe, call, "Z-Image")

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0, text_len: int = 256) -> dict[str, Any]:
        """One ZImageTransformer2DModel forward as ZImagePipeline makes it: a list of latents
        (16, 1, H/8, W/8), one per image, the timestep (1 - t) in [0, 1], and a list of caption
        features (the prompt's tokens x 2560: the pipeline drops each prompt's padding).
        text_len: the prompt's tokens after the chat template; 256 is a chosen size, `--shape
        text_len=N` sets it (the model pads image and caption to multiples of 32 itself)."""
        gh, gw, rnd = self.packed_grid(pipe, variant, height, width, frames, seed)
        t = pipe.transformer
        p = next(t.parameters())
        patch = t.config.all_patch_size[0]
        return dict(x=[rnd(t.config.in_channels, 1, gh * patch, gw * patch) for _ in range(batch)],
                    t=torch.full((batch,), 0.5, device=p.device, dtype=p.dtype),
                    cap_feats=[rnd(text_len, t.config.cap_feat_dim) for _ in range(batch)], return_dict=False)
