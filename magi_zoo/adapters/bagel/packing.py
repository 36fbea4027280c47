"""Packing helpers: patchify/unpatchify, position ids, 2-D sin-cos tables, masks, resizing.

Pure tensor/PIL functions with no module state, shared by the model and the pipeline.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """[C, H, W] -> [(H/p)*(W/p), p*p*C], tokens row-major, features ordered (pr, pc, c)."""
    c, h, w = image.shape
    x = image.reshape(c, h // p, p, w // p, p)
    return x.permute(1, 3, 2, 4, 0).reshape((h // p) * (w // p), p * p * c)


def unpatchify(tokens: torch.Tensor, h: int, w: int, p: int, c: int) -> torch.Tensor:
    """Inverse of `patchify`: [h*w, p*p*c] -> [c, h*p, w*p]."""
    x = tokens.reshape(h, w, p, p, c)
    return x.permute(4, 0, 2, 1, 3).reshape(c, h * p, w * p)


def grid_position_ids(h: int, w: int, max_side: int, device=None) -> torch.Tensor:
    """Flattened ids row * max_side + col of an h x w grid (BAGEL's 'extrapolate' scheme)."""
    if h > max_side or w > max_side:
        raise ValueError(f"a {h}x{w} token grid exceeds the position table ({max_side} per side); "
                         "use a smaller image")
    rows = torch.arange(h, device=device)[:, None]
    cols = torch.arange(w, device=device)[None, :]
    return (rows * max_side + cols).reshape(-1)


def _sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.einsum("m,d->md", pos.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(dim: int, grid: int) -> torch.Tensor:
    """Frozen 2-D sin-cos table [grid*grid, dim] (float64 math): first half encodes the
    column, second half the row; each half is all sines then all cosines."""
    rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    emb = np.concatenate([_sincos_1d(dim // 2, cols), _sincos_1d(dim // 2, rows)], axis=1)
    return torch.from_numpy(emb).float()


def causal_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask [q_len, kv_len] (True = attend): query i sees the
    whole cache and new tokens 0..i -- flash-attn's convention for q_len < kv_len."""
    offset = kv_len - q_len
    q = torch.arange(q_len, device=device)[:, None]
    k = torch.arange(kv_len, device=device)[None, :]
    return k <= q + offset


# ImageTransform's default pixel cap (14 * 14 * 9 * 1024 = 1,806,336); the official VAE-side
# transform, ImageTransform(1024, 512, 16), inherits it.
DEFAULT_MAX_PIXELS = 14 * 14 * 9 * 1024


def _to_stride(value: int, stride: int) -> int:
    """The nearest multiple of `stride` (Python round: half to even), at least `stride`."""
    return max(stride, int(round(value / stride) * stride))


def _scaled(w: int, h: int, scale: float, stride: int) -> tuple[int, int]:
    """Scale, round to whole pixels first, then to the stride: two roundings, as upstream
    (rounding once, straight to the stride, differs by one stride on a few % of sizes)."""
    return _to_stride(round(w * scale), stride), _to_stride(round(h * scale), stride)


def resize_shape(w: int, h: int, *, max_size: int, min_size: int, stride: int,
                 max_pixels: int | None = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) by BAGEL's resize rule (MaxLongEdgeMinShortEdgeResize):

    1. scale = min(max_size / long side, 1), raised to min_size / short side if larger;
       round to pixels, then to the stride;
    2. if that has more than `max_pixels` pixels, scale the *rounded* size by the area
       ratio max_pixels / (w' h') (not its square root: upstream shrinks hard) and round again;
    3. if the long side of the result exceeds max_size, scale the rounded size down to it.

    `max_pixels=None` disables step 2."""
    scale = max(min(max_size / max(w, h), 1.0), min_size / min(w, h))
    nw, nh = _scaled(w, h, scale, stride)
    if max_pixels is not None and nw * nh > max_pixels:
        nw, nh = _scaled(nw, nh, max_pixels / (nw * nh), stride)
    if max(nw, nh) > max_size:
        nw, nh = _scaled(nw, nh, max_size / max(nw, nh), stride)
    return nw, nh


def to_rgb(img):
    """RGB as BAGEL reads images: RGBA, and any image whose palette or mode declares a
    transparent colour (`info["transparency"]`, e.g. P or L with a tRNS chunk), is pasted
    onto white through its alpha; everything else is `convert("RGB")` (so an LA image loses
    its alpha without a white paste, exactly as upstream's pil_img2rgb)."""
    if img.mode == "RGBA" or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        white = Image.new("RGB", img.size, (255, 255, 255))
        white.paste(img, mask=img.split()[3])
        return white
    return img.convert("RGB")


def resize_image(img, *, max_size: int, min_size: int, stride: int, max_pixels: int | None = DEFAULT_MAX_PIXELS):
    """A PIL image resized by `resize_shape` with bicubic filtering (PIL's resize, which is
    what torchvision's resize does for PIL inputs)."""
    w, h = resize_shape(*img.size, max_size=max_size, min_size=min_size, stride=stride, max_pixels=max_pixels)
    return img.resize((w, h), Image.BICUBIC)


def image_to_tensor(img, *, max_size: int, min_size: int, stride: int,
                    max_pixels: int | None = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """PIL image -> RGB (`to_rgb`), resized, [3, H, W] float tensor in [-1, 1] (mean = std = 0.5)."""
    img = resize_image(to_rgb(img), max_size=max_size, min_size=min_size, stride=stride, max_pixels=max_pixels)
    arr = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return arr * 2.0 - 1.0


def to_uint8_image(img: torch.Tensor):
    """[3, H, W] in [0, 1] -> PIL image, truncating `x * 255` toward zero (upstream's
    `.to(torch.uint8)`), not rounding: rounding moves ~43% of pixels by one level."""
    return Image.fromarray((img.clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy())
