"""LTX-2 (joint audio + video, 19B) over diffusers' LTX2Pipeline.

The configs and their sources are in `config.py`. What the family brings to the contract: one
denoiser forward makes two outputs (video and audio velocities), and a generation is a video
with its sound track: `generate` returns a video `Output` whose `audio` is the vocoder's stereo
waveform, which `magi-zoo run` muxes into the .mp4 (and writes to `--audio-out` as a .wav).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...engine import cfg_parallel_active
from .._tokenizers import byte_bpe_tokenizer
from ..base import CallLimits, Output, Variant, init_on, keep_fp32_modules
from ..diffusers_pipeline import DiffusersPipelineAdapter, same_layout_preparation
from . import config as C

VARIANTS = {
    v.name: v
    for v in [
        Variant(name="ltx-2", family="ltx2", hub_id="Lightricks/LTX-2", description="text-to-video with audio, 19B",
                config=dict(transformer=C.TRANSFORMER, connectors=C.CONNECTORS, vae=C.VAE, audio_vae=C.AUDIO_VAE,
                            vocoder=C.VOCODER, scheduler=C.SCHEDULER, text_encoder=C.GEMMA3_TEXT, vision=C.SIGLIP,
                            gemma=C.GEMMA3, tokenizer_vocab=4096),
                call_defaults=C.CALL),
        Variant(name="ltx-2-tiny", family="ltx2", config=C.TINY, tiny=True, call_defaults=C.TINY_CALL,
                description="2 audio-video blocks, dim 32 / 16, with its VAEs, vocoder and Gemma; random, offline"),
    ]
}


def _random_pipeline(variant: Variant, dtype: torch.dtype, device: torch.device):
    """Random init at the variant's config, created on `device` in `dtype` directly."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                           LTX2Pipeline, LTX2VideoTransformer3DModel)
    from diffusers.pipelines.ltx2 import LTX2TextConnectors  # lazy: as above
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder  # lazy: as above
    from tokenizers import processors  # lazy: as above
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration  # lazy: as above

    cfg = variant.config
    # Gemma's special ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3; every prompt starts with <bos>.
    tokenizer = byte_bpe_tokenizer(vocab_size=cfg["tokenizer_vocab"], specials=["<pad>", "<eos>", "<bos>", "<unk>"],
                                   eos="<eos>", pad="<pad>", unk="<unk>", bos="<bos>", model_max_length=131072)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    gemma = Gemma3Config(text_config=cfg["text_encoder"], vision_config=cfg["vision"], **cfg["gemma"])
    with init_on(device, dtype):
        transformer = keep_fp32_modules(LTX2VideoTransformer3DModel(**cfg["transformer"]))
        parts = dict(transformer=transformer, connectors=LTX2TextConnectors(**cfg["connectors"]),
                     vae=AutoencoderKLLTX2Video(**cfg["vae"]), audio_vae=AutoencoderKLLTX2Audio(**cfg["audio_vae"]),
                     vocoder=LTX2Vocoder(**cfg["vocoder"]), text_encoder=Gemma3ForConditionalGeneration(gemma))
    return LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**cfg["scheduler"]), tokenizer=tokenizer, **parts)


class LTX2Adapter(DiffusersPipelineAdapter):
    family = "ltx2"
    spec_file = "ltx2.toml"
    variants = VARIANTS
    aliases = {"ltx2": "ltx-2", "ltx-2-19b": "ltx-2"}
    component_names = ("transformer", "connectors", "text_encoder", "vae", "audio_vae", "vocoder")
    output_kind, fps = "video", 24
    # No cfg_option: the pipeline runs guidance as one batched forward (cond and uncond in a batch
    # of 2, cache context "cond_uncond"); CFG parallel splits separate cond / uncond calls, so it
    # does not apply (`--nproc` takes Ulysses, from the transformer's `_cp_plan`).
    cfg_option = None
    prompt_caps = (("tokenizer", "max_sequence_length"),)  # its pipeline truncates the prompt silently
    run_options = ("num_inference_steps", "height", "width", "num_frames", "seed", "audio_out")
    output_suffixes = (".mp4", ".gif")
    sound_track = True  # an .mp4 carries the vocoder's stereo track; a .gif only the frames

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return _random_pipeline(variant, dtype, device)

    def preparations(self, pipe) -> list:
        """Block 0's two streams come out of the input projections as views; blocks 1..47 get
        fresh tensors: same layout for all."""
        blocks = pipe.transformer.transformer_blocks
        return [same_layout_preparation(blocks, ("hidden_states", "audio_hidden_states"), "audio-video")]

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """The prompt's tokens at most the Gemma text encoder's position table."""
        n = variant.config["text_encoder"]["max_position_embeddings"]
        return {**super().count_caps(variant), "max_sequence_length": (n, f"its text encoder holds {n:,} positions")}

    def call_limits(self, variant: Variant) -> CallLimits:
        """From the config: pixels divide by the video VAE's 32x (its 4x4 patchify and 3 levels)
        times the transformer's patch (1); frames are 1 + 8 k (its temporal factor)."""
        vae, t = variant.config["vae"], variant.config["transformer"]
        s = vae["spatial_compression_ratio"] * t["patch_size"]
        return CallLimits(pixel_multiple=s, why_multiple=f"VAE {vae['spatial_compression_ratio']}x down x "
                          f"{t['patch_size']}x{t['patch_size']} patches", frame_step=vae["temporal_compression_ratio"])

    def generate(self, handle, *, prompt: str, progress: bool = True, **options) -> Output:
        """A video and its sound track: the frames, and the vocoder's waveform (channels, samples)
        at its output rate, which the writers mux into the .mp4."""
        options.pop("audio_out", None)
        if cfg_parallel_active(handle.plan):
            raise ValueError("LTX-2 runs guidance as one batched forward: cfg parallel does not apply; "
                             "drop it (--no-cfg-parallel) and split the sequence (Ulysses) instead")
        seed = options.pop("seed", None)
        if seed is not None:
            options["generator"] = torch.Generator(device="cpu").manual_seed(int(seed))
        handle.pipe.set_progress_bar_config(disable=not progress)
        out = handle(prompt=prompt, output_type="np", **options)
        fps = options.get("frame_rate", handle.call_defaults().get("frame_rate", self.fps))
        return Output("video", np.asarray(out.frames[0]), fps=round(fps), audio=np.asarray(out.audio[0].float().cpu()),
                      sample_rate=handle.pipe.vocoder.config.output_sampling_rate)

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0) -> dict[str, Any]:
        """One LTX2VideoTransformer3DModel forward as the pipeline makes it: packed video latents
        (B, F' H' W', 128) and audio latents (B, 25 per second, 128: 16 kHz / hop 160 / 4x),
        the connectors' video and audio text states over max_sequence_length tokens, both
        position grids, one timestep (also the cross-modal one)."""
        d = variant.call_defaults
        height, width, frames = height or d["height"], width or d["width"], frames or d["num_frames"]
        t = pipe.transformer
        cfg, p = t.config, next(t.parameters())
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=p.device, dtype=p.dtype)  # noqa: E731
        lf = (frames - 1) // pipe.vae_temporal_compression_ratio + 1
        lh, lw = height // pipe.vae_spatial_compression_ratio, width // pipe.vae_spatial_compression_ratio
        per_s = pipe.audio_sampling_rate / pipe.audio_hop_length / pipe.audio_vae_temporal_compression_ratio
        af, fps, n_text = round(frames / d["frame_rate"] * per_s), d["frame_rate"], d["max_sequence_length"]
        mask = torch.ones(batch, n_text, device=p.device, dtype=torch.long)
        ts = torch.full((batch,), 500.0, device=p.device, dtype=p.dtype)
        return dict(hidden_states=rnd(batch, lf * lh * lw, cfg.in_channels),
                    audio_hidden_states=rnd(batch, af, cfg.audio_in_channels),
                    encoder_hidden_states=rnd(batch, n_text, cfg.caption_channels),
                    audio_encoder_hidden_states=rnd(batch, n_text, cfg.caption_channels),
                    timestep=ts, sigma=ts, encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                    num_frames=lf, height=lh, width=lw, fps=fps, audio_num_frames=af,
                    video_coords=t.rope.prepare_video_coords(batch, lf, lh, lw, p.device, fps=fps),
                    audio_coords=t.audio_rope.prepare_audio_coords(batch, af, p.device),
                    use_cross_timestep=True, return_dict=False)
