"""HunyuanVideo-1.5 (text- and image-to-video, 8.3B) over diffusers' HunyuanVideo15Pipeline and
HunyuanVideo15ImageToVideoPipeline.

The configs, the variants table and their sources are in `config.py`. What the family brings
to the contract: its guidance lives in a pipeline component (diffusers' `ClassifierFreeGuidance` guider), not
in a call argument, so the variants' guidance is part of the built pipeline; and its text is
two encoders (Qwen2.5-VL's language model through a chat template, ByT5 for quoted glyph text).
"""

from __future__ import annotations

from typing import Any

import torch

from .._tokenizers import byte_bpe_tokenizer
from ..base import CallLimits, Variant, init_on, keep_fp32_modules
from ..diffusers_pipeline import DiffusersPipelineAdapter, same_layout_preparation
from .config import VARIANTS

# Qwen2.5's chat markup (the pipeline formats every prompt as a system + user conversation).
_CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config, created on `device` in `dtype` directly."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import (AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
                           HunyuanVideo15Transformer3DModel)
    from diffusers.guiders import ClassifierFreeGuidance  # lazy: as above
    # lazy: as above
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    cfg = variant.config
    tokenizer = byte_bpe_tokenizer(vocab_size=cfg["tokenizer_vocab"], specials=["<|endoftext|>", "<|im_start|>",
                                   "<|im_end|>"], eos="<|im_end|>", pad="<|endoftext|>", model_max_length=131072)
    tokenizer.chat_template, tokenizer.padding_side = _CHAT, "right"  # as the published Qwen2Tokenizer pads
    with init_on(device, dtype):
        transformer = keep_fp32_modules(HunyuanVideo15Transformer3DModel(**cfg["transformer"]))
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**cfg["text_encoder"]))
        text_encoder_2 = T5EncoderModel(T5Config(**cfg["text_encoder_2"]))
        vae = AutoencoderKLHunyuanVideo15(**cfg["vae"])
    parts = dict(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                 text_encoder_2=text_encoder_2, tokenizer_2=ByT5Tokenizer(),  # bytes: no vocabulary file
                 scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]),
                 guider=ClassifierFreeGuidance(guidance_scale=cfg["guidance_scale"]))
    if "image_encoder" not in cfg:
        return HunyuanVideo15Pipeline(**parts)
    from diffusers import HunyuanVideo15ImageToVideoPipeline  # lazy: as above
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel  # lazy: as above

    with init_on(device, dtype):
        image_encoder = SiglipVisionModel(SiglipVisionConfig(**cfg["image_encoder"]))
    side = cfg["image_encoder"]["image_size"]
    processor = SiglipImageProcessor(size={"height": side, "width": side}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return HunyuanVideo15ImageToVideoPipeline(image_encoder=image_encoder, feature_extractor=processor, **parts)


class HunyuanVideo15Adapter(DiffusersPipelineAdapter):
    family = "hunyuanvideo15"
    spec_file = "hunyuan_video15.toml"
    variants = VARIANTS
    aliases = {"hunyuanvideo-1.5": "hunyuanvideo-1.5-480p-t2v", "hunyuanvideo15": "hunyuanvideo-1.5-480p-t2v"}
    component_names = ("transformer", "text_encoder", "text_encoder_2", "vae", "image_encoder")
    output_kind, fps = "video", 24
    run_options = ("num_inference_steps", "height", "width", "num_frames", "seed")  # + --image: image-to-video
    output_suffixes = (".mp4", ".gif")
    cfg_config_key = "guidance_scale"  # the guider component's scale: CFG (and CFG parallel) where > 1
    image_sets_size = True  # image-to-video: HunyuanVideo15ImageToVideoPipeline sizes the video by the frame

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def image_to_video(self, variant: Variant) -> bool:
        return "image_encoder" in variant.config  # HunyuanVideo15ImageToVideoPipeline: SigLIP encodes the frame

    def preparations(self, pipe) -> list:
        """Block 0's video stream is the patch embedding's transposed view; blocks 1..53 get fresh
        tensors: same layout for all (hidden_states is the block's first positional input)."""
        return [same_layout_preparation(pipe.transformer.transformer_blocks, (0, "hidden_states"), "video")]

    def call_limits(self, variant: Variant) -> CallLimits:
        """From the config: pixels divide by the VAE's spatial factor (16) times the patch (1);
        frames are 1 + 4 k (its temporal factor). RoPE is computed per call: no longest side."""
        vae, t = variant.config["vae"], variant.config["transformer"]
        s = vae["spatial_compression_ratio"] * t["patch_size"]
        return CallLimits(pixel_multiple=s, why_multiple=f"VAE {vae['spatial_compression_ratio']}x down x "
                          f"{t['patch_size']}x{t['patch_size']} patches", frame_step=vae["temporal_compression_ratio"])

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0) -> dict[str, Any]:
        """One HunyuanVideo15Transformer3DModel forward as the pipeline makes it: noisy latents,
        condition latents and mask concatenated (B, 65, F', H/16, W/16); Qwen states over the
        pipeline's 1000 text tokens, ByT5 states over its 256, 729 zero SigLIP tokens (text-to-video)."""
        d = variant.call_defaults  # image-to-video: the 16:9 size its pipeline makes at the target size
        h, w = (d["height"], d["width"]) if "height" in d else \
            pipe.video_processor.calculate_default_height_width(9, 16, pipe.target_size)
        height, width, frames = height or h, width or w, frames or d["num_frames"]
        t = pipe.transformer
        cfg, p = t.config, next(t.parameters())
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=p.device, dtype=p.dtype)  # noqa: E731
        st, ss = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        n_text, n_glyph = pipe.tokenizer_max_length, pipe.tokenizer_2_max_length
        # A prompt fills the first tokens of its padded text: 100 valid of 1000 here, an assumed
        # length that does not change the cost (every block attends over all 1000 under the mask);
        # a prompt without quoted text has an all-zero ByT5 mask, as here.
        mask = torch.zeros(batch, n_text, device=p.device, dtype=p.dtype)
        mask[:, :min(100, n_text)] = 1
        return dict(hidden_states=rnd(batch, cfg.in_channels, (frames - 1) // st + 1, height // ss, width // ss),
                    timestep=torch.full((batch,), 500.0, device=p.device, dtype=p.dtype),
                    encoder_hidden_states=rnd(batch, n_text, cfg.text_embed_dim), encoder_attention_mask=mask,
                    encoder_hidden_states_2=rnd(batch, n_glyph, cfg.text_embed_2_dim),
                    encoder_attention_mask_2=torch.zeros(batch, n_glyph, device=p.device, dtype=p.dtype),
                    # text-to-video: all-zero SigLIP tokens (the forward masks them out); image-to-video: the image's
                    image_embeds=rnd(batch, pipe.vision_num_semantic_tokens, cfg.image_embed_dim)
                    if self.image_to_video(variant) else
                    torch.zeros(batch, pipe.vision_num_semantic_tokens, cfg.image_embed_dim, device=p.device,
                                dtype=p.dtype), return_dict=False)
