"""Rectified-flow sampling for BAGEL: time schedule with shift, 3-way CFG, Euler loop.

Convention: x_t = (1 - t) x0 + t eps, the model predicts v = eps - x0, t = 1 is noise.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn as nn
from tqdm.auto import tqdm


def flow_timesteps(num_timesteps: int, shift: float) -> torch.Tensor:
    """linspace(1, 0, num_timesteps) warped by t' = s t / (1 + (s - 1) t); the sampler
    makes num_timesteps - 1 model evaluations. Float32 torch ops in the official order
    (Bagel.generate_image), so every timestep is the official one bit for bit
    (tests/data/bagel_guidance_oracle.json; a float64 schedule rounds differently)."""
    if num_timesteps < 2:
        raise ValueError(f"num_inference_steps must be >= 2 (got {num_timesteps}): BAGEL evaluates the model "
                         "between consecutive times of linspace(1, 0, steps)")
    t = torch.linspace(1, 0, num_timesteps, dtype=torch.float32)
    return shift * t / (1 + (shift - 1) * t)


def cfg_active(t: float | torch.Tensor, interval: Sequence[float]) -> bool:
    """Guidance applies iff interval[0] < t <= interval[1] (t = shifted time), compared in
    float32 as the official code compares its float32 timestep tensor with the interval's
    Python floats: a timestep equal to float32(0.4) is not above an interval start of 0.4
    (in float64 it is, and would be guided one step more than the official code)."""
    t32 = torch.as_tensor(t, dtype=torch.float32)
    return bool(t32 > interval[0]) and bool(t32 <= interval[1])


def _norm(v: torch.Tensor, per_token: bool) -> torch.Tensor:
    # float32 whatever v's dtype: the official code's torch.norm runs under CUDA autocast,
    # which computes linalg_vector_norm of a bf16 input in float32 and returns float32.
    return torch.linalg.vector_norm(v, dim=-1 if per_token else None, keepdim=per_token, dtype=torch.float32)


def cfg_combine(v_c: torch.Tensor, v_t: torch.Tensor | None, v_i: torch.Tensor | None, *,
                text_scale: float, img_scale: float, renorm_type: str = "global",
                renorm_min: float = 0.0) -> torch.Tensor:
    """Combine the conditional (v_c), no-text (v_t) and no-image (v_i) velocities.

    Text guidance first, then image guidance (only if img_scale > 1), then rescale so the
    norm never exceeds the conditional one: 'global' (one norm over all tokens),
    'channel' (per token), or 'text_channel' (per-token renorm of the text-guided velocity
    before image guidance). text_scale <= 1 means no guidance at all.

    Dtypes as the official `Bagel._forward_flow` under its bf16 autocast: the guidance
    arithmetic in the velocities' own dtype (bf16 on the shipped path, each operation
    rounded to bf16), the norms and the scale in float32, and the rescale by torch's type
    promotion: the global scale is a 0-d tensor, so the result keeps the velocities' dtype;
    a per-token scale is an (N, 1) float32 tensor, so 'channel' and 'text_channel' return
    float32 (tests/data/bagel_cfg_combine_oracle.json, from the official statements)."""
    if renorm_type not in ("global", "channel", "text_channel"):
        raise ValueError(f"cfg_renorm_type {renorm_type!r}: choose 'global', 'channel' or 'text_channel'")
    if text_scale <= 1.0:
        return v_c
    v1 = v_t + text_scale * (v_c - v_t)
    if renorm_type == "text_channel":
        v1 = v1 * (_norm(v_c, True) / (_norm(v1, True) + 1e-8)).clamp(min=renorm_min, max=1.0)
        return v_i + img_scale * (v1 - v_i) if img_scale > 1.0 else v1
    v2 = v_i + img_scale * (v1 - v_i) if img_scale > 1.0 else v1
    per_token = renorm_type == "channel"
    return v2 * (_norm(v_c, per_token) / (_norm(v2, per_token) + 1e-8)).clamp(min=renorm_min, max=1.0)


def euler_sample(x: torch.Tensor, timesteps: torch.Tensor, velocity: Callable[[torch.Tensor, float], torch.Tensor],
                 progress: bool = False) -> torch.Tensor:
    """x <- x - v(x, t) * (t_i - t_{i+1}) from t = 1 down to 0; the step sizes are the
    schedule's float32 differences, as the official loop's `dts`. The product v * dt is
    taken in v's dtype (a 0-d float32 step size does not promote a bf16 velocity), then
    subtracted from the float32 x, as the official `x_t - v_t * dts[i]`."""
    ts = timesteps.tolist()
    dts = timesteps[:-1] - timesteps[1:]
    it = range(len(ts) - 1)
    if progress:
        it = tqdm(it, desc="denoise")
    for i in it:
        v = velocity(x, ts[i])
        x = x - v.to(x.device) * dts[i].to(x.device)
    return x


class TimestepEmbedder(nn.Module):
    """Raw flow time t in [0, 1] -> [cos, sin] of 256 frequencies -> MLP (Linear, SiLU, Linear).
    Key names `mlp.0` / `mlp.2` match the checkpoint."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(emb.to(self.mlp[0].weight.dtype))
