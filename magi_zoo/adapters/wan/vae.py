"""The Wan VAE's passes over memory that change no value: a preparation on diffusers'
`AutoencoderKLWan` (Wan2.1's and Wan2.2's VAE, and Self-Forcing's).

The VAE runs eager, frame by frame (its causal cache lives in Python lists, which a compiled
region would guard on: wan.toml), so every pass over an activation is a kernel of its own.
Three rewrites, each the same function:

- **norm + SiLU pairing declared.** `WanResidualBlock` applies its `nonlinearity` (SiLU) right
  after `norm1` and `norm2` and nowhere else; `WanEncoder3d` / `WanDecoder3d` after `norm_out`.
  Declared here (NORM_ACT_PAIRS); the precision step's `fuse_norm_act` then runs each pair as
  one kernel (`magi_zoo::channel_rms_norm_act`).
- **Padding inside the convolution.** `WanCausalConv3d` concatenates its cached frames in front
  of its input and then copies the result once more with `F.pad` -- zero frames in front (only
  while the cache is short, at a video's start) and one pixel around each frame. Here the
  convolution pads height and width itself (cuDNN reads zeros past the edge, no copy) and
  `F.pad` runs only for the causal time padding, when there is any; a 1x1x1 convolution (the
  residual shortcut), whose zero padding `F.pad` still copies, is called directly.
- **Nearest upsampling in the input's dtype.** `WanUpsample` upsamples in fp32 and casts back
  (three passes over a 4x larger tensor in a bf16 VAE); nearest-exact copies values, so it is
  run in the input's dtype: the same bits, one pass.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...engine import NORM_ACT_PAIRS, Preparation, chain_undo, instance_forwards
from ...engine.compat.diffusers import wan_causal_conv_padding

PREPARATION_NAME = "Wan VAE passes"  # the report's name of the preparation (benchmarks leave it out by it)

# diffusers 0.42.1's autoencoder_kl_wan: the activation each class applies only after these norms
_NORM_ACT_PAIRS = {
    "WanResidualBlock": {"nonlinearity": ("norm1", "norm2")},
    "WanEncoder3d": {"nonlinearity": ("norm_out",)},
    "WanDecoder3d": {"nonlinearity": ("norm_out",)},
}


def is_wan_vae(vae) -> bool:
    """diffusers' AutoencoderKLWan (its module already imported: the pipeline built it)."""
    return type(vae).__name__ == "AutoencoderKLWan" and type(vae).__module__.startswith("diffusers.")


def vae_preparation(vae: nn.Module) -> Preparation:
    """The preparation described in the module docstring, for one AutoencoderKLWan."""

    def install(root: nn.Module):
        # lazy: diffusers' Wan VAE module; imported already by the pipeline that holds `vae`
        from diffusers.models.autoencoders import autoencoder_kl_wan as wan_vae
        undos = [_declare_pairs(vae, wan_vae)]
        try:
            convs = [m for m in vae.modules() if type(m) is wan_vae.WanCausalConv3d]
            undos.append(instance_forwards(convs, _conv_forward))
            ups = [m for m in vae.modules() if type(m) is wan_vae.WanUpsample]
            undos.append(instance_forwards(ups, _upsample_forward))
        except BaseException:
            chain_undo(undos)()
            raise
        return chain_undo(undos)

    return Preparation(PREPARATION_NAME, "norm + SiLU pairs declared for fuse_norm_act; causal convolutions pad "
                       "height / width inside the convolution; nearest upsampling in the input's dtype", install)


def _declare_pairs(vae: nn.Module, wan_vae) -> Callable[[], None]:
    declared = []
    for m in vae.modules():
        pairs = _NORM_ACT_PAIRS.get(type(m).__name__)
        if pairs is not None and type(m) is getattr(wan_vae, type(m).__name__):
            m.__dict__[NORM_ACT_PAIRS] = pairs
            declared.append(m)

    def undo() -> None:
        for m in declared:
            m.__dict__.pop(NORM_ACT_PAIRS, None)

    return undo


def _conv_forward(conv: nn.Conv3d):
    t_pad, h_pad, w_pad = wan_causal_conv_padding(conv)
    inner = (0, h_pad, w_pad)

    def forward(x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
        front = t_pad
        if cache_x is not None and t_pad > 0:
            x = torch.cat([cache_x.to(x.device), x], dim=2)
            front -= cache_x.shape[2]
        if front > 0:
            x = F.pad(x, (0, 0, 0, 0, front, 0))
        return F.conv3d(x, conv.weight, conv.bias, conv.stride, inner, conv.dilation, conv.groups)

    return forward


def _upsample_forward(up: nn.Upsample):
    def forward(x: torch.Tensor) -> torch.Tensor:
        if up.mode != "nearest-exact":  # only a copy of values is exact in any dtype
            return nn.Upsample.forward(up, x.float()).type_as(x)
        return nn.Upsample.forward(up, x)

    return forward
