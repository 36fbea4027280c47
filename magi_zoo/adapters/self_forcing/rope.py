"""Rotary position embedding, applied as diffusers' Wan attention processor does."""

from __future__ import annotations

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `x` (B, S, H, D) by the angles of `cos`/`sin` (1, S, 1, D,
    each value repeated per pair, fp32) -- the arithmetic of diffusers' WanAttnProcessor,
    in fp32, rounded once to x's dtype."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)
