"""Packing helpers: patchify/unpatchify, position ids, 2-D sin-cos tables, masks, resizing.

Pure tensor/PIL functions with no module state, shared by the model and the pipeline.
"""

from __future__ import annotations

import math

import numpy as np
import torch


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


def resize_shape(w: int, h: int, *, max_size: int, min_size: int, stride: int,
                 max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) with the long side <= max_size, short side >= min_size where both
    fit, pixels <= max_pixels, and both sides multiples of `stride`."""
    scale = min(1.0, max_size / max(w, h))
    if min(w, h) * scale < min_size:
        scale = min_size / min(w, h)
    if max_pixels is not None and w * h * scale * scale > max_pixels:
        scale = math.sqrt(max_pixels / (w * h))
    if max(w, h) * scale > max_size:
        scale = max_size / max(w, h)
    rnd = lambda v: max(stride, int(round(v * scale / stride)) * stride)
    return rnd(w), rnd(h)


def image_to_tensor(img, *, max_size: int, min_size: int, stride: int, max_pixels: int | None = None) -> torch.Tensor:
    """PIL image -> resized [3, H, W] float tensor normalised to [-1, 1] (mean = std = 0.5)."""
    from PIL import Image

    img = img.convert("RGB")
    w, h = resize_shape(*img.size, max_size=max_size, min_size=min_size, stride=stride, max_pixels=max_pixels)
    img = img.resize((w, h), Image.BICUBIC)
    arr = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return arr * 2.0 - 1.0
