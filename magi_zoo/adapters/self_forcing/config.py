"""Self-Forcing's published inference settings and the block schedule derived from them.

Where the numbers come from (guandeh17/Self-Forcing, `configs/self_forcing_dmd.yaml` merged
over `configs/default_config.yaml`, read by `pipeline/causal_inference.py`):
- the generator is Wan2.1-T2V-1.3B made causal (`wan/modules/causal_model.py`,
  `CausalWanModel`): 30 layers, 12 heads x 128, FFN 8960 -- `adapters/wan/config.py`'s `T2V_1_3B`;
- `num_frame_per_block: 3`: 21 latent frames (81 video frames) in 7 blocks of 3; at
  480x832 one latent frame is (480/8/2) x (832/8/2) = 30 x 52 = 1560 tokens, a block
  3 x 1560 = 4680, the whole video 21 x 1560 = 32760 (the reference's cache size);
- `denoising_step_list: [1000, 750, 500, 250]` with `warp_denoising_step: true`: each
  step is looked up in the training scheduler's table (`FlowMatchScheduler(shift=5.0,
  sigma_min=0.0, extra_one_step=True)` at 1000 steps, `timestep_shift: 5.0`), so the
  model sees t = 1000 x shift(s) with s = 1 - (1000 - step) / 1000 and
  shift(s) = 5 s / (1 + 4 s): 1000, 937.5, 833.3, 625;
- `context_noise: 0`: after a block is denoised, one more pass over the clean block at
  t = 0 writes its keys and values into the KV cache;
- `independent_first_frame: false`, `local_attn_size: -1`, `sink_size: 0`: every block
  has 3 latent frames and attends to the whole cache (no rolling window).
"""

from __future__ import annotations

import dataclasses

import torch

# UMT5 tokens the reference pads every prompt to (`text_len` of CausalWanModel): Wan2.1's own
from ..wan.config import TEXT_LEN  # noqa: F401  (re-exported: the adapter and pipeline read it here)

# The distilled generator's schedule (see the module docstring).
DENOISING_STEP_LIST = (1000, 750, 500, 250)
TIMESTEP_SHIFT = 5.0
NUM_TRAIN_TIMESTEPS = 1000
NUM_FRAME_PER_BLOCK = 3
CONTEXT_NOISE = 0


def warped_schedule(step_list=DENOISING_STEP_LIST, shift: float = TIMESTEP_SHIFT,
                    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> tuple[list[float], list[float]]:
    """(timesteps, sigmas) the model sees: the reference's `warp_denoising_step`, i.e.
    `cat(scheduler.timesteps, [0])[1000 - step]` for its FlowMatchScheduler (sigmas
    linspace(1, 0, 1001)[:-1], shifted; timesteps = 1000 sigmas). The reference then maps
    each timestep back to its sigma by an argmin over the same table, which returns the
    table's own sigma. Computed in float32 as the reference does, so the values are
    bit-identical: timesteps [1000.0, 937.5, 833.33..., 625.0]."""
    sigmas = torch.linspace(1.0, 0.0, num_train_timesteps + 1)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    idx = [num_train_timesteps - s for s in step_list]
    return [float(sigmas[i] * num_train_timesteps) for i in idx], [float(sigmas[i]) for i in idx]


def flow_to_x0(x: torch.Tensor, flow: torch.Tensor, sigma: float) -> torch.Tensor:
    """x0 = x_t - sigma_t * flow, computed in float64 and returned in the flow's dtype, as the
    reference's `WanDiffusionWrapper._convert_flow_pred_to_x0` does
    (tests/data/self_forcing_sampler_oracle.json, from the official source)."""
    return (x.double() - sigma * flow.double()).to(flow.dtype)


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """(1 - sigma) x0 + sigma noise, the next step's input: the reference's
    `FlowMatchScheduler.add_noise`, whose sigma is a float32 tensor of the latents' rank (not
    0-d), so bf16 latents are promoted and the sum is taken in float32, then cast to the
    noise's dtype."""
    s = torch.full((1,) * x0.dim(), sigma, dtype=torch.float32, device=x0.device)
    return ((1 - s) * x0 + s * noise).type_as(noise)


def warped_timesteps(**kw) -> list[float]:
    """The timesteps of `warped_schedule`."""
    return warped_schedule(**kw)[0]


@dataclasses.dataclass(frozen=True)
class BlockSchedule:
    """The fixed schedule of one generation: every offset is a Python int known before
    the first block runs, so the host computes cache offsets from the block index and
    nothing is read back from the device.

    latent_frames: latent frames of the video; frame_tokens: tokens per latent frame
    (latent H/2 x W/2); frames_per_block: latent frames per block.

    cache_frames / sink_frames: the rolling cache for long videos (the reference's
    `local_attn_size` / `sink_size`). None = the cache holds the whole video (the published
    setting). Otherwise it holds `cache_frames` latent frames: the first `sink_frames`
    (sinks, never evicted) and a ring over the rest, so a block attends to the sinks plus
    the most recent tokens -- the set the reference keeps by shifting its cache left.
    Attention does not depend on the order of keys (they carry their RoPE position from
    the write), so a ring with host-computed slots gives the same result with a fixed
    shape and no copies."""

    latent_frames: int
    frame_tokens: int
    frames_per_block: int = NUM_FRAME_PER_BLOCK
    cache_frames: int | None = None
    sink_frames: int = 0

    def __post_init__(self):
        if self.latent_frames % self.frames_per_block:
            raise ValueError(f"{self.latent_frames} latent frames are not a whole number of blocks of "
                             f"{self.frames_per_block}")
        if self.cache_frames is None:
            if self.sink_frames:
                raise ValueError("sink_frames needs a rolling cache: set cache_frames too")
        elif self.sink_frames < 0 or self.cache_frames - self.sink_frames < self.frames_per_block:
            raise ValueError(f"cache_frames={self.cache_frames}, sink_frames={self.sink_frames}: the cache must "
                             f"hold the sinks plus at least one block ({self.frames_per_block} latent frames)")

    @property
    def num_blocks(self) -> int:
        return self.latent_frames // self.frames_per_block

    @property
    def block_tokens(self) -> int:
        """Query tokens per step (4680 at 480x832)."""
        return self.frames_per_block * self.frame_tokens

    @property
    def rolling(self) -> bool:
        return self.cache_frames is not None and self.cache_frames < self.latent_frames

    @property
    def cache_tokens(self) -> int:
        """Keys/values the cache holds per layer (32760 at 480x832, 81 frames)."""
        frames = self.latent_frames if self.cache_frames is None else min(self.cache_frames, self.latent_frames)
        return frames * self.frame_tokens

    def block_start(self, block: int) -> int:
        """First token of `block` in the video (its position; its cache slot without rolling)."""
        return block * self.block_tokens

    def block_end(self, block: int) -> int:
        """One past the block's last token in the video."""
        return (block + 1) * self.block_tokens

    def start_frame(self, block: int) -> int:
        """Latent frame index of the block's first frame (its RoPE time offset)."""
        return block * self.frames_per_block

    def slot(self, token: int) -> int:
        """Cache slot of video token `token`: itself while it fits, then a ring after the sinks."""
        cap, sink = self.cache_tokens, self.sink_frames * self.frame_tokens
        return token if token < cap else sink + (token - sink) % (cap - sink)

    def write_slots(self, block: int) -> list[int]:
        """The slots `block` writes its keys/values to."""
        return [self.slot(t) for t in range(self.block_start(block), self.block_end(block))]

    def attend_len(self, block: int) -> int:
        """Slots [0, attend_len) hold what `block` attends to (earlier blocks and itself);
        the ring fills from the front, so this is a prefix."""
        return min(self.block_end(block), self.cache_tokens)


def latent_frames_for(num_frames: int, temporal: int = 4) -> int:
    """Latent frames of `num_frames` video frames: the Wan VAE is causal, 4x in time:
    1 + (num_frames - 1) / 4 (81 -> 21)."""
    return (num_frames - 1) // temporal + 1


def valid_frame_counts(limit: int = 200, temporal: int = 4, per_block: int = NUM_FRAME_PER_BLOCK) -> list[int]:
    """Video frame counts that are whole blocks: 1 + 4 (3m - 1) = 12 m - 3 (9, 21, ..., 81)."""
    return [n for n in range(1, limit + 1)
            if (n - 1) % temporal == 0 and latent_frames_for(n, temporal) % per_block == 0]
