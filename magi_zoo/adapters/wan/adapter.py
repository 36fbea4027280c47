"""Wan2.1 (text/image-to-video) over diffusers' WanPipeline / WanImageToVideoPipeline.

Variants are the published configs, one line each (gpt-fast's flavour table); the
numbers are those of the Wan-AI/*-Diffusers repositories' config.json files.
"""

from __future__ import annotations

from typing import Any

import torch

from .._tokenizers import byte_bpe_tokenizer
from ..base import CallLimits, Variant, init_on, keep_fp32_modules
from ..diffusers_pipeline import DiffusersPipelineAdapter, weights_error
from . import distill, original
from .attention import norm_rope_preparation
from .vae import is_wan_vae, vae_preparation
from .activations import activation_gib
from .config import CLIP_H, I2V_14B, SCHEDULER, T2V_1_3B, T2V_14B, TEXT_LEN, TINY, UMT5_XXL, VAE


def _variant(name, transformer, hub_id, desc, *, flow_shift=3.0, call=None, **extra):
    cfg = dict(transformer=transformer, text_encoder=UMT5_XXL, vae=VAE,
               scheduler=dict(SCHEDULER, flow_shift=flow_shift), tokenizer_vocab=4096, **extra)
    if "distill" in extra:  # LightX2V's step- and CFG-distilled sampler (distill.py): 4 steps, no CFG
        call = {**(call or {}), **distill.CALL}
    return Variant(name=name, family="wan", config=cfg, hub_id=hub_id, description=desc,
                   call_defaults={**dict(height=480, width=832, num_frames=81, num_inference_steps=50,
                                         guidance_scale=5.0), **(call or {})})


VARIANTS = {
    v.name: v
    for v in [
        _variant("wan2.1-t2v-1.3b", T2V_1_3B, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "text-to-video, 1.3B"),
        _variant("wan2.1-t2v-14b", T2V_14B, "Wan-AI/Wan2.1-T2V-14B-Diffusers", "text-to-video, 14B"),
        # I2V: Wan's generate.py samples image-to-video with 40 steps (text-to-video: 50), guide
        # scale 5.0, 81 frames, and shift 3.0 at the 480p sizes, 5.0 otherwise.
        _variant("wan2.1-i2v-14b-480p", I2V_14B, "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                 "image-to-video, 14B, 480p", image_encoder=CLIP_H, call=dict(num_inference_steps=40)),
        # The 720p I2V model: the 480p model's architecture (diffusers' convert_wan_to_diffusers.py
        # gives both one transformer config), trained for 720x1280: generate.py's 1280*720 size
        # with shift 5.0; diffusers' Wan docs also give flow_shift 5.0 for 720P. Loading the hub id
        # uses the repository's own scheduler_config.json; these numbers serve weights="random"
        # and the call defaults.
        _variant("wan2.1-i2v-14b-720p", I2V_14B, "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
                 "image-to-video, 14B, 720p", image_encoder=CLIP_H, flow_shift=5.0,
                 call=dict(height=720, width=1280, num_inference_steps=40)),
        # LightX2V's step- and CFG-distilled 14B models (distill.py lists the sources): the full
        # distilled DiT, read from distill_models/ of an original-layout directory (weights=DIR);
        # or the base model with the distill LoRA merged at load (load(lora=[local file]) replaces
        # the hub path). Sampler: 4 Euler steps at shift 5, guidance 1 (no CFG forward).
        _variant("wan2.1-i2v-14b-480p-distill", I2V_14B, None,
                 "image-to-video, 14B, 480p, LightX2V 4-step distilled DiT (distill_models/)",
                 image_encoder=CLIP_H, distill=distill.CONFIG),
        _variant("wan2.1-t2v-14b-distill", T2V_14B, None,
                 "text-to-video, 14B, LightX2V 4-step distilled DiT (distill_models/)", distill=distill.CONFIG),
        _variant("wan2.1-i2v-14b-480p-distill-lora", I2V_14B, "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
                 "image-to-video, 14B, 480p + LightX2V's 4-step distill LoRA", image_encoder=CLIP_H,
                 distill=distill.CONFIG, lora=[distill.LORA_I2V]),
        _variant("wan2.1-t2v-14b-distill-lora", T2V_14B, "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                 "text-to-video, 14B + LightX2V's 4-step distill LoRA", distill=distill.CONFIG,
                 lora=[distill.LORA_T2V]),
        Variant(name="wan2.1-tiny", family="wan", config=TINY, tiny=True,
                description="4 blocks, dim 32; random, offline, for CPU tests and the demo",
                call_defaults=dict(height=32, width=32, num_frames=9, num_inference_steps=2,
                                   guidance_scale=5.0, max_sequence_length=16)),
    ]
}


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config. Weights are created on `device` directly
    (a 14B model initialised on the host would take minutes)."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel  # lazy: as above

    cfg = variant.config
    te_cfg = UMT5Config(**cfg["text_encoder"])
    with init_on(device, dtype):
        transformer = keep_fp32_modules(WanTransformer3DModel(**cfg["transformer"]))
        # Wan2.2 A14B: a second (low-noise) expert; the pipeline switches to it at boundary_ratio.
        transformer_2 = (keep_fp32_modules(WanTransformer3DModel(**cfg["transformer_2"]))
                         if "transformer_2" in cfg else None)
        text_encoder = UMT5EncoderModel(te_cfg)
    with init_on(device, torch.float32):
        vae = AutoencoderKLWan(**cfg["vae"])  # the Wan VAE runs in fp32, as published
    tokenizer = byte_bpe_tokenizer(vocab_size=cfg["tokenizer_vocab"], specials=["<pad>", "</s>", "<unk>"],
                                   eos="</s>", pad="<pad>", unk="<unk>", append_eos=True)
    scheduler = UniPCMultistepScheduler(**cfg["scheduler"])
    for m in (transformer, transformer_2, text_encoder, vae):
        if m is not None:
            m.eval()  # freshly built modules are in training mode (dropout on); from_pretrained evals
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                 transformer=transformer)
    if transformer_2 is not None:
        parts["transformer_2"] = transformer_2
    # model_index.json's pipeline arguments (Wan2.2: boundary_ratio, expand_timesteps).
    parts.update(cfg.get("pipeline", {}))
    if "image_encoder" in cfg:
        from diffusers import WanImageToVideoPipeline  # lazy: diffusers costs seconds
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel  # lazy: as diffusers

        with init_on(device, dtype):
            image_encoder = CLIPVisionModel(CLIPVisionConfig(**cfg["image_encoder"])).eval()
        proc = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
        return WanImageToVideoPipeline(image_encoder=image_encoder, image_processor=proc, **parts)
    return WanPipeline(**parts)


class WanAdapter(DiffusersPipelineAdapter):
    family = "wan"
    spec_file = "wan.toml"
    variants = VARIANTS
    aliases = {"wan2.1": "wan2.1-t2v-1.3b", "wan": "wan2.1-t2v-1.3b"}
    component_names = ("transformer", "text_encoder", "vae", "image_encoder")
    fp32_components = ("vae",)  # the Wan VAE runs in fp32, as published
    output_kind, fps = "video", 16
    cfg_option = "guidance_scale"  # WanPipeline: do_classifier_free_guidance = guidance_scale > 1
    prompt_caps = (("tokenizer", "max_sequence_length"),)  # its pipeline truncates the prompt silently
    # Image-to-video variants take `--image` too (check_run).
    run_options = ("num_inference_steps", "height", "width", "num_frames", "seed")
    output_suffixes = (".mp4", ".gif")

    def activation_estimate(self, variant: Variant, call: dict[str, Any],
                            bytes_per_element: int) -> dict[str, float]:
        """The transformer's and the VAE's peaks for this shape (`activations.activation_gib`)."""
        return activation_gib(variant.config, call, bytes_per_element)

    def call_limits(self, variant: Variant) -> CallLimits:
        """From the config: pixels divide by the VAE's spatial factor (8; Wan2.2's VAE 16) times
        the 2x2 patch; frames are 1 + 4 k (the VAE's temporal factor); no axis has more patches
        than `rope_max_seq_len` (diffusers' WanRotaryPosEmbed table: a longer axis fails in a reshape)."""
        t, vae = variant.config["transformer"], variant.config["vae"]
        pt, ph, _ = t["patch_size"]
        ss, st, rope = vae.get("scale_factor_spatial", 8), vae.get("scale_factor_temporal", 4), t["rope_max_seq_len"]
        return CallLimits(pixel_multiple=ss * ph, why_multiple=f"VAE {ss}x down x {ph}x{ph} patches",
                          max_grid=rope, why_grid=f"its RoPE table has {rope} positions per axis",
                          frame_step=st, max_latent_frames=rope * pt)

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """Steps (the base rule) and the prompt's tokens at most the official `text_len`
        (config.TEXT_LEN): a longer one the DiT never saw, and the text encoder's attention
        grows with its square (10**6 tokens asked the host for 1 TB)."""
        return {**super().count_caps(variant),
                "max_sequence_length": (TEXT_LEN, f"Wan's official code pads every prompt to {TEXT_LEN} tokens")}

    def check_call(self, variant: Variant, call: dict[str, Any], **kw) -> None:
        """The base checks; an image-to-video call's text is exactly TEXT_LEN tokens: diffusers'
        Wan attention takes the last 512 context tokens as text and the rest as the image's, so
        any other length would split them wrongly without an error."""
        super().check_call(variant, call, **kw)
        n = call.get("max_sequence_length")
        if self.image_to_video(variant) and n is not None and n != TEXT_LEN:
            name = kw.get("name", lambda k: k)
            raise ValueError(f"{name('max_sequence_length')}={n!r}: {variant.name} takes exactly {TEXT_LEN} text "
                             f"tokens (diffusers' Wan attention reads the last {TEXT_LEN} context tokens as text "
                             f"and the ones before them as the image's); leave it at {TEXT_LEN}")

    @staticmethod
    def image_to_video(variant: Variant) -> bool:
        """An I2V variant (WanImageToVideoPipeline, a CLIP image encoder): it needs a first frame."""
        return "image_encoder" in variant.config

    def preparations(self, pipe) -> list:
        """Wan's self-attention q/k norm + rope in one kernel where the precision step allows it
        (`attention.py`), on each denoiser (Wan2.2-A14B has two); the VAE's passes (`vae.py`)."""
        denoisers = [t for t in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None))
                     if t is not None]
        vae = getattr(pipe, "vae", None)
        return (([norm_rope_preparation(*denoisers)] if denoisers else [])
                + ([vae_preparation(vae)] if vae is not None and is_wan_vae(vae) else []))

    def build(self, variant: Variant, *, weights, dtype: torch.dtype, device: torch.device):
        """The base build; a distilled variant's pipeline gets LightX2V's sampler (distill.py)
        whichever way it was built."""
        pipe = super().build(variant, weights=weights, dtype=dtype, device=device)
        if "distill" in variant.config:
            distill.install(pipe, variant.config["distill"])
        return pipe

    def save_pretrained(self, native, path):
        """As diffusers writes it; the distilled sampler is saved as the library scheduler it
        extends (its config), and put back at load."""
        sched = native.scheduler
        if isinstance(sched, distill.scheduler_class()):
            native.scheduler = distill.plain(native)
        try:
            return super().save_pretrained(native, path)
        finally:
            native.scheduler = sched

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def load_pretrained(self, variant: Variant, source: str, local: bool, dtype: torch.dtype,
                        device: torch.device):
        """A hub id or a diffusers-format directory: diffusers' `from_pretrained`. A directory in
        the original Wan release layout (Wan-AI/Wan2.1-T2V-*, as the Wan repository, LightX2V
        and Self-Forcing read it): converted on load (`original.py`). The layout is detected;
        an unknown one is an error naming both."""
        if local:
            # Errors read like every family's weights errors (what is wrong, then what to pass);
            # an original-layout directory's advice is about that layout.
            layout = None
            try:
                layout = original.detect_layout(source)
                if layout == "original":
                    return original.load_pipeline(source, variant.config, dtype=dtype, device=device,
                                                  variant_name=variant.name, distill="distill" in variant.config)
            except (ValueError, OSError) as e:
                if layout == "original":
                    raise original.load_error(variant.name, source, e) from e
                raise weights_error(variant, source, local, e) from e
        return super().load_pretrained(variant, source, local, dtype, device)

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0) -> dict[str, Any]:
        d = variant.call_defaults
        height, width, frames = height or d["height"], width or d["width"], frames or d["num_frames"]
        t = pipe.transformer
        cfg = t.config
        p = next(t.parameters())
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=p.device, dtype=p.dtype)
        # Latent grid: VAE 4x temporal (causal: 1 + (F-1)/4 latent frames), 8x spatial
        # (Wan2.2's VAE: 16x spatial); the pipeline reads both factors from the VAE config.
        st, ss = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
        lat_f, lat_h, lat_w = (frames - 1) // st + 1, height // ss, width // ss
        text_len = d.get("max_sequence_length", 512)
        timestep = torch.full((batch,), 500, device=p.device, dtype=torch.long)
        if getattr(pipe.config, "expand_timesteps", False):
            # Wan2.2 TI2V: one timestep per patch token, (batch, F' * H'/2 * W'/2) float32, as
            # WanPipeline builds it from its latent mask (`mask[0][0][:, ::2, ::2] * t`).
            seq = lat_f * -(-lat_h // 2) * -(-lat_w // 2)
            timestep = torch.full((batch, seq), 500.0, device=p.device, dtype=torch.float32)
        kw = dict(hidden_states=rnd(batch, cfg.in_channels, lat_f, lat_h, lat_w), timestep=timestep,
                  encoder_hidden_states=rnd(batch, text_len, cfg.text_dim), return_dict=False)
        if cfg.image_dim is not None:  # I2V: 257 CLIP tokens (256 patches + class token)
            kw["encoder_hidden_states_image"] = rnd(batch, 257, cfg.image_dim)
        return kw
