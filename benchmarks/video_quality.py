"""Quality metrics for decoded videos and latents, in torch (no extra dependency): PSNR,
SSIM (Wang et al. 2004, Gaussian window), relative L2; and the Wan VAE decode the
pipeline does after its denoising loop, so a benchmark can time the loop and the decode
apart. Used by benchmarks/step_cache.py and benchmarks/fp8_quality.py.

Videos are (frames, channels, height, width) floats in [0, 1].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

RANDOM_WEIGHTS_NOTE = ("random weights: the decoded 'video' is noise through a random VAE, so PSNR/SSIM "
                       "measure how far the outputs moved, not how a real video looks; rerun with a "
                       "checkpoint (--weights DIR) for quality that means something")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32 (b is the reference)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """PSNR in dB per frame (inf where the frames are equal)."""
    mse = (a.float() - b.float()).pow(2).flatten(1).mean(1)
    return 10 * torch.log10(data_range**2 / mse)


def _gaussian(window: int, sigma: float, device) -> torch.Tensor:
    x = torch.arange(window, device=device, dtype=torch.float32) - (window - 1) / 2
    g = torch.exp(-x.pow(2) / (2 * sigma**2))
    g = g / g.sum()
    return g[:, None] * g[None, :]


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0, window: int = 11,
         sigma: float = 1.5) -> torch.Tensor:
    """SSIM per frame: 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03, computed per
    channel over the valid region and averaged -- the reference definition."""
    a, b = a.float(), b.float()
    c = a.shape[1]
    w = _gaussian(window, sigma, a.device).expand(c, 1, window, window)
    conv = lambda x: F.conv2d(x, w, groups=c)  # noqa: E731
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mu_a, mu_b = conv(a), conv(b)
    var_a = conv(a * a) - mu_a**2
    var_b = conv(b * b) - mu_b**2
    cov = conv(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return s.flatten(1).mean(1)


def compare_videos(test: torch.Tensor, ref: torch.Tensor, chunk: int = 8) -> dict:
    """PSNR and SSIM per frame and their means (chunks of frames keep the memory small)."""
    p, s = [], []
    for i in range(0, ref.shape[0], chunk):
        p.append(psnr(test[i:i + chunk], ref[i:i + chunk]).cpu())
        s.append(ssim(test[i:i + chunk], ref[i:i + chunk]).cpu())
    p, s = torch.cat(p), torch.cat(s)
    finite = p[torch.isfinite(p)]
    return {
        # identical frames have infinite PSNR; the mean is over the others (None: all identical)
        "psnr_mean_db": round(float(finite.mean()), 3) if finite.numel() else None,
        "psnr_min_db": round(float(finite.min()), 3) if finite.numel() else None,
        "identical_frames": int((~torch.isfinite(p)).sum()),
        "ssim_mean": round(float(s.mean()), 5),
        "ssim_min": round(float(s.min()), 5),
        "psnr_per_frame_db": [None if not math.isfinite(v) else round(v, 3) for v in p.tolist()],
        "ssim_per_frame": [round(v, 5) for v in s.tolist()],
    }


@torch.no_grad()
def decode_wan(pipe, latents: torch.Tensor) -> torch.Tensor:
    """What WanPipeline does after its loop (un-normalise with the VAE's latents_mean /
    latents_std, `vae.decode`), returning the first video as (F, C, H, W) in [0, 1]."""
    vae = pipe.vae
    z = latents.to(next(vae.parameters()).device, vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z.device, z.dtype)
    video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # (B, C, F, H, W) in [-1, 1]
    return (video[0].permute(1, 0, 2, 3).float() / 2 + 0.5).clamp(0, 1)
