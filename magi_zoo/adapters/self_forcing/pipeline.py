"""SelfForcingPipeline: text -> video, block by block, streaming decoded frames.

The loop is the reference's `CausalInferencePipeline.inference` (pipeline/causal_inference.py):
for each block of 3 latent frames, 4 denoising steps at the warped timesteps
(x0 = x_t - sigma_t * flow; the next input re-noises x0 to the next sigma), then one pass
over the clean block at t = 0 writes its keys/values into the cache. Two changes that
leave the frames unchanged:
- the decoded frames of a block are yielded *before* its cache pass (which only later
  blocks read), so the first frames arrive one forward earlier;
- the last block's cache pass is skipped: no block reads it.

Strategies (`pipe.strategy`): "static" (default) -- `transformer.denoise_step` on the
static KV cache, the function the spec compiles with fullgraph=True; "naive" -- the
reference's control flow (`transformer.naive_step`, dict caches, `.item()` reads), kept
to measure what the static path gains.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from . import naive
from .config import (CONTEXT_NOISE, BlockSchedule, flow_to_x0, latent_frames_for, renoise, valid_frame_counts,
                     warped_schedule)
from .kv_cache import StaticKVCache
from .vae_stream import StreamingDecoder, frames_tensor, to_frames

STRATEGIES = ("static", "naive")


@dataclasses.dataclass
class SelfForcingOutput:
    """`frames`: (B, T, H, W, 3) float in [0, 1] (diffusers' output_type="np" layout);
    `latents`: (B, C, F, h, w) denoised latents; `block_seconds`: wall time of each block
    (denoise + decode, measured when the block's frames were ready on the host)."""

    frames: Any
    latents: torch.Tensor
    block_seconds: list[float]


@dataclasses.dataclass
class BlockResult:
    """What `stream` yields per block."""

    index: int
    num_blocks: int
    frames: np.ndarray  # (B, T_block, H, W, 3) float32 in [0, 1]
    latents: torch.Tensor  # (B, C, 3, h, w) the block's denoised latents
    seconds: float  # since the call started (text encoding included)


class SelfForcingPipeline:
    """The native object of the self-forcing family (components: transformer,
    text_encoder, vae; plus tokenizer)."""

    def __init__(self, transformer, text_encoder, tokenizer, vae, *, config: dict[str, Any]):
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.vae = vae
        self.config = config
        self.timesteps, self.sigmas = warped_schedule()
        self.strategy = "static"
        # CUDA only: decode block b on a side stream while block b+1 denoises (same frames;
        # measured on an H100 in benchmarks/results/self_forcing/self_forcing_*). False: one stream.
        self.overlap_decode = True
        # With overlap_decode: the host waits for the first block's frames before it queues the
        # second block, so they are not decoded beside it (later blocks overlap as above).
        # False: every block overlaps the next, the first too.
        self.first_frames_first = True
        # CUDA only: the VAE's 3D-convolution weights in channels_last_3d (cuDNN's native 3D
        # layout): decode 2.40 -> 2.18 s per 81-frame video on an H100. "contiguous": as loaded.
        self.vae_memory_format = "channels_last_3d"
        self.loaded_entry: str | None = None  # which checkpoint entry was loaded (generator_ema / generator)
        self.static_cache: StaticKVCache | None = None  # the last video's cache, reused while its shape holds
        self.vae_scale_factor_temporal = 2 ** sum(vae.config.temperal_downsample)
        self.vae_scale_factor_spatial = 2 ** len(vae.config.temperal_downsample)

    # -- pieces ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.transformer.patch_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.patch_embedding.weight.dtype

    @torch.no_grad()
    def encode_prompt(self, prompt: str | list[str], max_sequence_length: int = 512) -> torch.Tensor:
        """UMT5 embeddings (B, max_sequence_length, text_dim), zero past each prompt's tokens
        (as WanPipeline and the reference pad them)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        tok = self.tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        dev = self.text_encoder.get_input_embeddings().weight.device
        mask = tok.attention_mask.to(dev)
        out = self.text_encoder(tok.input_ids.to(dev), mask).last_hidden_state
        return (out * mask.unsqueeze(-1).to(out.dtype)).to(device=self.device, dtype=self.dtype)

    def schedule(self, height: int, width: int, num_frames: int, cache_frames: int | None = None,
                 sink_frames: int = 0) -> BlockSchedule:
        """The block schedule of a video, or a clear error for a size the model cannot make."""
        st, ss = self.vae_scale_factor_temporal, self.vae_scale_factor_spatial
        p_t, p_h, p_w = self.transformer.config.patch_size
        if height % (ss * p_h) or width % (ss * p_w):
            raise ValueError(f"height and width must be multiples of {ss * p_h} (VAE {ss}x, patch {p_h}), "
                             f"got {height}x{width}")
        counts = valid_frame_counts(max(num_frames, 81) + 24)
        if num_frames not in counts:
            raise ValueError(f"--frames {num_frames}: Self-Forcing makes whole blocks of 3 latent frames, i.e. "
                             f"12 m - 3 video frames: {', '.join(map(str, counts))}, ...")
        return BlockSchedule(latent_frames=latent_frames_for(num_frames, st),
                             frame_tokens=(height // ss // p_h) * (width // ss // p_w),
                             cache_frames=cache_frames, sink_frames=sink_frames)

    def kv_cache(self, batch: int, schedule: BlockSchedule) -> StaticKVCache:
        """The static cache for this shape: allocated once and reused while the shape holds
        (same tensors every video, so compiled code and CUDA graphs see the same inputs)."""
        t = self.transformer
        a = t.blocks[0].attn1
        args = (len(t.blocks), batch, a.heads, a.inner_dim // a.heads, schedule)
        if self.static_cache is None or not self.static_cache.matches(*args, self.dtype, self.device):
            self.static_cache = None  # free the old one first
            self.static_cache = StaticKVCache(*args, dtype=self.dtype, device=self.device)
        return self.static_cache

    # -- the block loop ---------------------------------------------------------------------------
    @torch.no_grad()
    def stream(self, prompt: str | list[str], *, height: int = 480, width: int = 832, num_frames: int = 81,
               max_sequence_length: int = 512, generator: torch.Generator | None = None,
               seed: int | None = None, decode: bool = True, cache_frames: int | None = None,
               sink_frames: int = 0) -> Iterator[BlockResult]:
        """Yield each block's decoded frames as soon as they exist (decode=False: latents
        only, frames None -- what a transformer-only benchmark times).

        cache_frames / sink_frames: a rolling cache of that many latent frames, the first
        `sink_frames` kept for good (the reference's local_attn_size / sink_size), for videos
        longer than the cache; None = the cache holds the whole video (published setting)."""
        t0 = time.perf_counter()
        sched = self.schedule(height, width, num_frames, cache_frames, sink_frames)
        if generator is None:
            generator = torch.Generator(device="cpu").manual_seed(0 if seed is None else int(seed))
        text = self.encode_prompt(prompt, max_sequence_length)
        batch = text.shape[0]
        ss = self.vae_scale_factor_spatial
        lat_h, lat_w = height // ss, width // ss
        c = self.transformer.config.in_channels
        dev, dt = self.device, self.dtype
        if generator.device != dev:
            # Noise is drawn on the model's device: a host tensor copied in before every step
            # would make the host wait for the GPU each time (a pageable copy is synchronous),
            # so no launch could overlap the previous step. The device generator is seeded from
            # the caller's, so a seed still fixes the video.
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            generator = torch.Generator(device=dev).manual_seed(seed)
        noise = lambda: torch.randn((batch, c, sched.frames_per_block, lat_h, lat_w), generator=generator,  # noqa: E731
                                    device=dev).to(dt)
        t_steps = [torch.full((batch,), t, device=dev) for t in self.timesteps]
        t_clean = torch.full((batch,), float(CONTEXT_NOISE), device=dev)
        step = self._stepper(text, batch, sched, lat_h, lat_w)
        if decode and dev.type == "cuda":
            self._vae_layout()
        decoder = StreamingDecoder(self.vae) if decode else None
        side = torch.cuda.Stream(dev) if decoder is not None and dev.type == "cuda" and self.overlap_decode else None
        pending = None  # (block, latents, event, host frames): decoded on `side`, not yielded yet

        def denoise(b: int) -> torch.Tensor:
            x = noise()
            for i, t in enumerate(t_steps):
                flow = step(b, x, t)
                x0 = flow_to_x0(x, flow, self.sigmas[i])
                if i + 1 < len(t_steps):
                    x = renoise(x0, noise(), self.sigmas[i + 1])
            return x0

        def ready(p) -> BlockResult:
            b, x0, event, frames = p
            event.synchronize()
            return BlockResult(b, sched.num_blocks, frames.numpy(), x0, time.perf_counter() - t0)

        try:
            for b in range(sched.num_blocks):
                x0 = denoise(b)
                if side is not None:
                    # Decode on a side stream while the main stream runs the clean pass and
                    # the next block: the host only launches here, and waits for block b's
                    # frames after block b+1 is queued (so the two overlap on the card).
                    side.wait_stream(torch.cuda.current_stream(dev))
                    x0.record_stream(side)
                    with torch.cuda.stream(side):
                        on_card = frames_tensor(decoder.decode(x0))
                        frames = torch.empty(on_card.shape, dtype=on_card.dtype, pin_memory=True)
                        frames.copy_(on_card, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(side)
                    if b + 1 < sched.num_blocks:  # the clean pass writes the cache later blocks read
                        step(b, x0, t_clean)
                    if pending is not None:
                        yield ready(pending)
                        pending = None
                    if b == 0 and self.first_frames_first:
                        # Shared with the next block the first decode finished late (first frames
                        # 0.55 s on an H100 at b420dd9, vs ~0.38 s estimated alone: text encoding +
                        # 4 steps x 55 ms + 9 frames x 14 ms of decode): only the clean pass runs
                        # beside it
                        yield ready((b, x0, event, frames))
                    else:
                        pending = (b, x0, event, frames)
                    continue
                frames = to_frames(decoder.decode(x0)) if decoder is not None else None
                if decoder is None and dev.type == "cuda":
                    torch.cuda.synchronize()
                yield BlockResult(b, sched.num_blocks, frames, x0, time.perf_counter() - t0)
                if b + 1 < sched.num_blocks:  # the clean pass writes the cache later blocks read
                    step(b, x0, t_clean)
            if pending is not None:
                yield ready(pending)
        finally:
            if side is not None:
                side.synchronize()
            if decoder is not None:
                decoder.close()

    def _vae_layout(self) -> None:
        """Put the VAE's 5-D (3D-convolution) weights in `vae_memory_format` (idempotent).
        Only those: `Module.to(memory_format=)` would also try the 2-D convolutions' 4-D
        weights and refuse."""
        formats = {"channels_last_3d": torch.channels_last_3d, "contiguous": torch.contiguous_format}
        if self.vae_memory_format not in formats:
            raise ValueError(f"vae_memory_format {self.vae_memory_format!r}: choose one of {sorted(formats)}")
        fmt = formats[self.vae_memory_format]
        with torch.no_grad():
            for prm in self.vae.parameters():
                if prm.dim() == 5 and not prm.is_contiguous(memory_format=fmt):
                    prm.data = prm.data.contiguous(memory_format=fmt)

    def _stepper(self, text, batch, sched: BlockSchedule, lat_h: int, lat_w: int) -> Callable:
        """step(block, latents, timestep) -> flow prediction, for the current strategy."""
        t = self.transformer
        if self.strategy == "static":
            t.resolve_cache_attention()  # "auto" -> a kernel, eagerly (the step is compiled)
            p_t, p_h, p_w = t.config.patch_size
            cross_k, cross_v = t.cross_kv(text)  # once per prompt
            rope = t.rope_tables(sched, lat_h // p_h, lat_w // p_w)  # once per video
            cache = self.kv_cache(batch, sched)

            def step(block, x, timestep):
                # A new step for CUDA graphs (mode="reduce-overhead"): the previous step's output
                # has been consumed; a no-op otherwise.
                torch.compiler.cudagraph_mark_step_begin()
                cos, sin = rope[block]
                return t.denoise_step(x, timestep, cross_k=cross_k, cross_v=cross_v, rope_cos=cos, rope_sin=sin,
                                      **cache.step_args(block))
            return step
        if self.strategy == "naive":
            a = t.blocks[0].attn1
            kv = naive.new_kv_cache(len(t.blocks), batch, sched.cache_tokens, a.heads, a.inner_dim // a.heads,
                                    dtype=self.dtype, device=self.device)
            cross = naive.new_crossattn_cache(len(t.blocks))

            sink = sched.sink_frames * sched.frame_tokens

            def step(block, x, timestep):
                return t.naive_step(x, timestep, text, kv, cross, sched.block_start(block), sink)
            return step
        raise ValueError(f"strategy {self.strategy!r}; choices: {', '.join(STRATEGIES)}")

    def __call__(self, prompt: str | list[str], *, height: int = 480, width: int = 832, num_frames: int = 81,
                 max_sequence_length: int = 512, generator: torch.Generator | None = None, seed: int | None = None,
                 cache_frames: int | None = None, sink_frames: int = 0,
                 on_block: Callable[[BlockResult], None] | None = None) -> SelfForcingOutput:
        """The whole video; `on_block(result)` is called as each block's frames arrive."""
        frames, latents, secs = [], [], []
        for r in self.stream(prompt, height=height, width=width, num_frames=num_frames,
                             max_sequence_length=max_sequence_length, generator=generator, seed=seed,
                             cache_frames=cache_frames, sink_frames=sink_frames):
            frames.append(r.frames)
            latents.append(r.latents)
            secs.append(r.seconds)
            if on_block is not None:
                on_block(r)
        return SelfForcingOutput(np.concatenate(frames, axis=1), torch.cat(latents, dim=2), secs)
