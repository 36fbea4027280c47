"""The self-forcing adapter: variants, build (random / local directory + official
checkpoint), components, the `denoise_step` entry point and `magi-zoo run`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from packaging.version import Version

from .._tokenizers import byte_bpe_tokenizer
from ..base import Adapter, CallLimits, Output, Variant, init_on, keep_fp32_modules
from ..diffusers_pipeline import LOAD_ERRORS, weights_error
from ..wan.config import T2V_1_3B, TINY, UMT5_XXL, VAE
from ..wan.vae import vae_preparation
from .checkpoint import find_checkpoint, load_generator
from .config import TEXT_LEN, valid_frame_counts
from .kv_cache import StaticKVCache
from .pipeline import SelfForcingPipeline

# The published generator is Wan2.1-T2V-1.3B (configs: `real_name`/`model_name`
# Wan2.1-T2V-1.3B, CausalWanModel at the 1.3B shape), so its configs are Wan2.1's (wan/config.py).
_CALL = dict(height=480, width=832, num_frames=81, max_sequence_length=TEXT_LEN)
# Tiny: wan2.1-tiny's modules; 81 frames at 32x32 -> 21 latent frames of 4 x 4 -> 2 x 2 =
# 4 tokens each: 7 blocks of 12 query tokens against an 84-token cache, so the tests run
# the published block structure (7 blocks x (4 steps + 1 cache pass)) in a second.
_TINY_CALL = dict(height=32, width=32, num_frames=81, max_sequence_length=16)

VARIANTS = {
    v.name: v
    for v in [
        Variant(name="self-forcing-wan2.1-1.3b", family="self-forcing",
                config=dict(transformer=T2V_1_3B, text_encoder=UMT5_XXL, vae=VAE, tokenizer_vocab=4096),
                description="Self-Forcing (DMD) causal Wan2.1-T2V-1.3B: 7 blocks x 3 latent frames, 4 steps, "
                            "static KV cache; weights: a local Wan2.1 diffusers dir + self_forcing_dmd.pt",
                call_defaults=_CALL),
        Variant(name="self-forcing-tiny", family="self-forcing",
                config=dict(transformer=TINY["transformer"], text_encoder=TINY["text_encoder"],
                            vae=TINY["vae"], tokenizer_vocab=TINY["tokenizer_vocab"]),
                tiny=True, description="causal wan2.1-tiny, 7 blocks of 3 latent frames at 32x32; random, offline",
                call_defaults=_TINY_CALL),
    ]
}


def _modules(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device):
    """Transformer, text encoder and VAE at `cfg`, random init, created on device."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel  # lazy: as above

    from .model import CausalWanTransformer3DModel  # lazy: it is diffusers' Wan DiT (seconds to import)

    with init_on(device, dtype):
        transformer = keep_fp32_modules(CausalWanTransformer3DModel(**cfg["transformer"]))
        text_encoder = UMT5EncoderModel(UMT5Config(**cfg["text_encoder"]))
    with init_on(device, torch.float32):
        vae = AutoencoderKLWan(**cfg["vae"])  # the Wan VAE runs in fp32, as published
    return transformer, text_encoder, vae


def _random_tokenizer(cfg: dict[str, Any]):
    return byte_bpe_tokenizer(vocab_size=cfg["tokenizer_vocab"], specials=["<pad>", "</s>", "<unk>"],
                              eos="</s>", pad="<pad>", unk="<unk>", append_eos=True)


class SelfForcingAdapter(Adapter):
    family = "self-forcing"
    spec_file = "self_forcing.toml"
    variants = VARIANTS
    aliases = {"self-forcing": "self-forcing-wan2.1-1.3b"}
    entry_points = ("denoise_step",)
    run_options = ("height", "width", "num_frames", "seed")
    output_suffixes = (".mp4", ".gif")
    fps = 16  # Wan2.1's frame rate (the reference writes its videos at 16 fps)

    # -- build --------------------------------------------------------------------------------
    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        transformer, text_encoder, vae = _modules(variant.config, dtype, device)
        return SelfForcingPipeline(transformer, text_encoder, _random_tokenizer(variant.config), vae,
                                   config=variant.config)

    def load_pretrained(self, variant: Variant, source: str, local: bool, dtype: torch.dtype,
                        device: torch.device):
        """A local directory: the diffusers Wan2.1 layout, plus optionally one official
        Self-Forcing checkpoint (*.pt) whose EMA generator becomes the transformer (see
        checkpoint.py). Nothing is downloaded."""
        if not local:
            raise ValueError(f"{variant.name}: weights={source!r} is not a local directory. Pass a directory "
                             "holding Wan2.1-T2V-1.3B in the diffusers layout (tokenizer/, text_encoder/, vae/, "
                             "transformer/config.json) with the Self-Forcing checkpoint (e.g. self_forcing_dmd.pt) "
                             "in it or in its checkpoints/ folder, or weights='random'")
        # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel  # lazy: as above

        from .model import CausalWanTransformer3DModel  # lazy: it is diffusers' Wan DiT (seconds to import)

        path = Path(source)
        missing = [d for d in ("tokenizer", "text_encoder", "vae", "transformer") if not (path / d).is_dir()]
        if missing:
            raise ValueError(f"{variant.name}: {path} lacks {', '.join(d + '/' for d in missing)}; it must hold "
                             "Wan2.1-T2V-1.3B in the diffusers layout (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) "
                             "or a directory written by save_pretrained")
        ckpt = find_checkpoint(path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"), local_files_only=True)
            text_encoder = UMT5EncoderModel.from_pretrained(str(path / "text_encoder"), dtype=dtype,
                                                            local_files_only=True).to(device)
            vae = AutoencoderKLWan.from_pretrained(str(path / "vae"), local_files_only=True).to(device, torch.float32)
            if ckpt is None:
                transformer = CausalWanTransformer3DModel.from_pretrained(
                    str(path / "transformer"), local_files_only=True, **_dtype_kw(dtype)).to(device)
            else:  # the checkpoint replaces every weight: build from the config alone
                config = CausalWanTransformer3DModel.load_config(str(path / "transformer"))
                with init_on(device, dtype):
                    transformer = keep_fp32_modules(CausalWanTransformer3DModel.from_config(config))
        except LOAD_ERRORS() as e:
            raise weights_error(variant, source, True, e) from e
        pipe = SelfForcingPipeline(transformer, text_encoder, tokenizer, vae, config=variant.config)
        if ckpt is not None:
            pipe.loaded_entry = load_generator(transformer, ckpt)
        return pipe

    def save_pretrained(self, pipe, path: str | Path) -> Path:
        """The diffusers layout `load_pretrained` reads (transformer/ holds the causal model's
        weights; no .pt is written)."""
        path = Path(path)
        pipe.transformer.save_pretrained(path / "transformer")
        pipe.text_encoder.save_pretrained(path / "text_encoder")
        pipe.vae.save_pretrained(path / "vae")
        pipe.tokenizer.save_pretrained(str(path / "tokenizer"))
        return path

    def preparations(self, pipe) -> list:
        """The Wan VAE's passes (adapters/wan/vae.py): the streaming decode runs its modules."""
        return [vae_preparation(pipe.vae)]

    def components(self, pipe) -> dict[str, nn.Module]:
        return {"transformer": pipe.transformer, "text_encoder": pipe.text_encoder, "vae": pipe.vae}

    # -- entry point: one step of one block ------------------------------------------------------
    def entry(self, pipe, name: str) -> tuple[nn.Module, str]:
        self.check_entry(name)
        return pipe.transformer, "denoise_step"

    def example_inputs(self, pipe, variant: Variant, entry: str, *, height=None, width=None, frames=None,
                       batch: int = 1, seed: int = 0, block: int | None = None) -> dict[str, Any]:
        """One `denoise_step` call at the variant's size: the last block (the longest
        attended prefix, default) against a random cache, random prompt keys/values."""
        self.check_entry(entry)
        d = variant.call_defaults
        sched = pipe.schedule(height or d["height"], width or d["width"], frames or d["num_frames"])
        t = pipe.transformer
        p = t.patch_embedding.weight
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *s: torch.randn(*s, generator=g).to(device=p.device, dtype=p.dtype)  # noqa: E731
        ss = pipe.vae_scale_factor_spatial
        lat_h, lat_w = (height or d["height"]) // ss, (width or d["width"]) // ss
        a = t.blocks[0].attn1
        heads, hd = a.heads, a.inner_dim // a.heads
        cache = StaticKVCache(len(t.blocks), batch, heads, hd, sched, dtype=p.dtype, device=p.device)
        if p.device.type != "meta":  # filled on the device (a published-size cache is 6 GB)
            gd = torch.Generator(device=p.device).manual_seed(seed)
            for x in cache.k + cache.v:
                x.normal_(generator=gd)
        b = sched.num_blocks - 1 if block is None else block
        _, p_h, p_w = t.config.patch_size
        cos, sin = t.rope_freqs(sched.start_frame(b), sched.frames_per_block, lat_h // p_h, lat_w // p_w)
        text_len = d["max_sequence_length"]
        return dict(hidden_states=rnd(batch, t.config.in_channels, sched.frames_per_block, lat_h, lat_w),
                    timestep=torch.full((batch,), 937.5, device=p.device),
                    cross_k=[rnd(batch, heads, text_len, hd) for _ in t.blocks],
                    cross_v=[rnd(batch, heads, text_len, hd) for _ in t.blocks],
                    rope_cos=cos, rope_sin=sin, **cache.step_args(b))

    # -- `magi-zoo run` -------------------------------------------------------------------------
    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """The prompt's tokens at most the reference's `text_len` (a fixed denoising list: no steps to cap)."""
        return {"max_sequence_length": (TEXT_LEN, f"the reference pads every prompt to {TEXT_LEN} tokens")}

    def call_limits(self, variant: Variant) -> CallLimits:
        """Wan2.1's: pixels divide by the VAE's 8x times the 2x2 patch; at most `rope_max_seq_len`
        patches per side (frames: `check_run`'s 12 m - 3; the model checks its RoPE table's length)."""
        t = variant.config["transformer"]
        rope, p = t["rope_max_seq_len"], t["patch_size"][1]
        return CallLimits(pixel_multiple=8 * p, why_multiple=f"VAE 8x down x {p}x{p} patches", max_grid=rope,
                          why_grid=f"its RoPE table has {rope} positions per axis")

    def check_call(self, variant: Variant, call: dict[str, Any], *, name=lambda k: k,
                   device_gib: float | None = None, given: dict[str, Any] | None = None) -> None:
        """The general checks, then Self-Forcing's frame rule: whole blocks of 3 latent frames,
        12 m - 3 video frames. Here, not only in `check_run`, so the handle (`pipe(...)`) refuses
        81 + 1 frames before any work as the CLI does."""
        super().check_call(variant, call, name=name, device_gib=device_gib, given=given)
        n = call.get("num_frames")
        if isinstance(n, int) and n > 0 and n not in valid_frame_counts(max(n, 81) + 24):
            raise ValueError(f"{name('num_frames')} {n}: Self-Forcing makes whole blocks of 3 latent frames, i.e. "
                             f"12 m - 3 video frames: {', '.join(map(str, valid_frame_counts(120)))}, ...")

    def generate(self, handle, *, prompt: str, progress: bool = True, **options) -> Output:
        """Stream the video block by block; with progress, one line per block as its frames
        are decoded."""
        seed = options.pop("seed", None)
        if seed is not None:
            options["generator"] = torch.Generator(device="cpu").manual_seed(int(seed))

        def report(r) -> None:
            n = r.frames.shape[1]
            print(f"  block {r.index + 1}/{r.num_blocks}: {n} frames decoded at {r.seconds:.2f} s", flush=True)

        t0 = time.perf_counter()
        out = handle(prompt=prompt, on_block=report if progress else None, **options)
        total = time.perf_counter() - t0
        frames = list(out.frames[0])
        note = f"{len(frames)} frames in {total:.2f} s ({len(frames) / total:.1f} frames/s end to end)"
        return Output("video", frames, fps=self.fps, note=note)


def _dtype_kw(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """diffusers >= 0.42 takes `dtype=` and warns on `torch_dtype=`."""
    import diffusers  # lazy: diffusers costs seconds; listing models imports this module

    return {"dtype" if Version(diffusers.__version__).release >= (0, 42) else "torch_dtype": dtype}
