"""Causal, block-by-block decoding with diffusers' AutoencoderKLWan.

`AutoencoderKLWan._decode` (diffusers 0.42.1) decodes latent frame by frame: it clears the
decoder's feature cache (`clear_cache()`: `_feat_map`, one slot per causal conv, and the
slot counter `_conv_idx`), applies `post_quant_conv` (kernel 1: no temporal context),
then for each latent frame resets `_conv_idx = [0]` and calls
`decoder(frame, feat_cache=_feat_map, feat_idx=_conv_idx, first_chunk=(i == 0))`; each
causal conv reads the last frames it saw from its slot and stores its own. The first
latent frame decodes to 1 video frame, each later one to 4.

`StreamingDecoder` runs that same loop split across blocks: the cache is cleared once per
video, kept between blocks, and `first_chunk` is true only for the video's first latent
frame -- so the frames of all blocks together equal one `vae.decode` of the whole video
(tests check it). Tiled decoding (`enable_tiling`) keeps its own per-tile caches and is
not streamed: refused with a clear error.
"""

from __future__ import annotations

import torch

from ...engine.compat.diffusers import wan_vae_decode_latent_frame


class StreamingDecoder:
    """Decode a video's latents block by block, keeping the VAE's causal cache in between."""

    def __init__(self, vae):
        if getattr(vae, "use_tiling", False):
            raise ValueError("streaming decode needs the VAE untiled (vae.disable_tiling()): tiled decoding "
                             "keeps a separate causal cache per tile")
        if getattr(vae.config, "patch_size", None) is not None:
            raise ValueError("streaming decode supports the Wan2.1 VAE (no patchified latents)")
        self.vae = vae
        cfg = vae.config
        self.mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        self.std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        self.frames_done = 0
        vae.clear_cache()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents (B, C, F, h, w) of the next block -> pixels (B, 3, T, H, W) in
        [-1, 1]; T = 1 + 4 (F - 1) for the first block, 4 F after it."""
        vae = self.vae
        p = vae.post_quant_conv.weight
        z = latents.to(p.dtype) * self.std.to(p) + self.mean.to(p)  # WanPipeline's de-normalisation
        x = vae.post_quant_conv(z)
        out = []
        for i in range(x.shape[2]):
            out.append(wan_vae_decode_latent_frame(vae, x[:, :, i:i + 1], first_chunk=self.frames_done == 0))
            self.frames_done += 1
        return torch.cat(out, dim=2).clamp(-1.0, 1.0)

    def close(self) -> None:
        """Free the feature cache (as `_decode` does at its end)."""
        self.vae.clear_cache()


def frames_tensor(pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, T, H, W) in [-1, 1] -> float32 (B, T, H, W, 3) in [0, 1], where `pixels` are."""
    return (pixels.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1)


def to_frames(pixels: torch.Tensor):
    """`frames_tensor` as numpy on the host, as diffusers'
    VideoProcessor.postprocess_video(output_type="np") returns."""
    return frames_tensor(pixels).cpu().numpy()
