"""The channel RMSNorm of the Wan VAE's causal convolution stacks, its affine and the SiLU that
follows it, in one pass: `magi_zoo::channel_rms_norm_act`.

Why: diffusers' `WanRMS_norm` computes ``F.normalize(x.float(), dim=1).to(dtype) * scale * gamma
+ bias`` (scale = sqrt(C)) and the residual block then applies SiLU: in eager mode that is a
cast to fp32, a norm reduction, a division, a cast back and four elementwise passes (scale,
gamma, bias -- a float 0.0 still launches its add -- SiLU), about 39 bytes of traffic per
bf16 element against 4 for one read and one write. The VAE runs eager (its decode loop keeps
its causal cache in Python lists, which a compiled region would guard on), and these norms
touch every activation of every residual block: at 480x832x81 the decoder normalises ~34
billion elements per video (7 norms per frame at 96 x 480 x 832, 6 at 192 x 240 x 416, ...).

Semantics (`reference`, the CPU / fallback path, is the definition): over the channel dim 1
of x (N, C, *spatial), y = x / max(||x||_2, eps) * scale * gamma[c] (+ bias[c]), then SiLU if
asked. The kernel computes in fp32 and rounds once at the end; the eager composite rounds to
x's dtype after the normalisation and after each affine op (so in bf16 the kernel is the
closer of the two to an fp32 evaluation).

Layouts: any tensor whose spatial dims collapse to one stride -- the standard layout (channel
stride = prod(spatial)) and channels_last_3d / channels_last (channel stride 1), which is what
the VAE's activations are once its 3-D convolution weights are channels-last (the
`memory_format` step). The output has x's strides. Others (a sliced view) take `reference`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..custom_ops import register_custom_op
from . import triton_available
from .triton_bundle import track

TILE = 4096  # elements one program holds (C padded to a power of two times positions): 32 fp32 per thread on 4 warps
MAX_CHANNELS = 4096  # widest C one program normalises in registers


def reference(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, scale: float, eps: float,
              silu: bool) -> torch.Tensor:
    """The op's definition: diffusers' `WanRMS_norm.forward` (then `F.silu`), op for op."""
    low = x.dtype in (torch.float16, torch.bfloat16)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    y = F.normalize(x.float() if low else x, dim=1, eps=eps).to(x.dtype) * scale * gamma.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return F.silu(y) if silu else y


def _fake(x, gamma, bias, scale, eps, silu):
    return torch.empty_like(x)


def _check(x, gamma, bias):
    if x.dim() < 3:
        raise ValueError(f"channel_rms_norm_act takes x (batch, channels, *spatial); got shape {tuple(x.shape)}")
    c = x.shape[1]
    for name, p in (("gamma", gamma), ("bias", bias)):
        if p is not None and p.numel() != c:
            raise ValueError(f"channel_rms_norm_act: {name} must hold one value per channel ({c}); got "
                             f"shape {tuple(p.shape)}")


def _spatial_stride(x: torch.Tensor) -> int | None:
    """The one stride of x's spatial dims collapsed to one (None where they do not collapse).
    Dims of size 1 take no part: their strides address nothing."""
    dims = [d for d in range(2, x.dim()) if x.shape[d] != 1]
    if not dims:
        return 1
    for outer, inner in zip(dims, dims[1:]):
        if x.stride(outer) != x.stride(inner) * x.shape[inner]:
            return None
    return x.stride(dims[-1])


def _kernel_ok(x, gamma, bias) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.numel() > 0
            and x.shape[1] <= MAX_CHANNELS and _spatial_stride(x) is not None and gamma.is_cuda
            and (bias is None or bias.is_cuda) and triton_available())


@register_custom_op("channel_rms_norm_act", fake=_fake)
def channel_rms_norm_act(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None, scale: float,
                         eps: float, silu: bool) -> torch.Tensor:
    """SiLU(x / max(||x||_2 over dim 1, eps) * scale * gamma + bias) (module docstring), in x's
    layout; one Triton pass on CUDA, `reference` elsewhere."""
    _check(x, gamma, bias)
    if not _kernel_ok(x, gamma, bias):
        return reference(x, gamma, bias, scale, eps, silu)
    return _launch(x, gamma, bias, scale, eps, silu)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (importing this module needs no triton). A program
    takes POS positions of one sample with all C channels (padded to a power of two, masked) as
    one tile, reduces over the channels in fp32 and writes the tile once. CHANNELS_FAST picks
    the tile's order so the dim of stride 1 is the one a warp reads contiguously."""
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton
    import triton.language as tl  # lazy: with triton, above

    @track  # its compiled files travel in the compile cache (triton_bundle)
    @triton.jit
    def channel_norm_kernel(x_ptr, g_ptr, b_ptr, out_ptr, channels, positions, blocks, s_n, s_c, s_p,
                            o_n, o_c, o_p, scale, eps, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                            CP: tl.constexpr, POS: tl.constexpr, CHANNELS_FAST: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        n = pid // blocks
        p0 = (pid % blocks) * POS
        ch = tl.arange(0, CP).to(tl.int64)  # c * s_c passes 2**31 in the standard layout of a large video
        g = tl.load(g_ptr + ch, mask=ch < channels, other=0.0).to(tl.float32)
        if HAS_BIAS:
            b = tl.load(b_ptr + ch, mask=ch < channels, other=0.0).to(tl.float32)
        else:
            b = tl.zeros((CP,), dtype=tl.float32)
        if CHANNELS_FAST:  # tile (POS, CP): a position's channels are contiguous
            p = p0 + tl.arange(0, POS)[:, None]
            c = ch[None, :]
            m = (p < positions) & (c < channels)
            x = tl.load(x_ptr + n * s_n + c * s_c + p * s_p, mask=m, other=0.0).to(tl.float32)
            # F.normalize's x / max(||x||, eps), times sqrt(C)
            inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=1)), eps)
            y = x * inv[:, None] * g[None, :] + b[None, :]
        else:  # tile (CP, POS): a channel's positions are contiguous
            p = p0 + tl.arange(0, POS)[None, :]
            c = ch[:, None]
            m = (p < positions) & (c < channels)
            x = tl.load(x_ptr + n * s_n + c * s_c + p * s_p, mask=m, other=0.0).to(tl.float32)
            inv = scale / tl.maximum(tl.sqrt(tl.sum(x * x, axis=0)), eps)
            y = x * inv[None, :] * g[:, None] + b[:, None]
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_ptr + n * o_n + c * o_c + p * o_p, y.to(out_ptr.dtype.element_ty), mask=m)

    return channel_norm_kernel


def _launch(x, gamma, bias, scale, eps, silu):
    n, c = x.shape[:2]
    positions = math.prod(x.shape[2:])
    out = torch.empty_like(x)  # x's strides (dense tensors keep them under preserve_format)
    cp = 1 << (c - 1).bit_length()
    pos = max(1, TILE // cp)
    blocks = -(-positions // pos)
    g = gamma.reshape(-1)
    g = g if g.is_contiguous() else g.contiguous()
    b = bias.reshape(-1).contiguous() if bias is not None else g
    _kernel()[(n * blocks,)](x, g, b, out, c, positions, blocks, x.stride(0), x.stride(1), _spatial_stride(x),
                             out.stride(0), out.stride(1), _spatial_stride(out), float(scale), float(eps),
                             HAS_BIAS=bias is not None, SILU=bool(silu), CP=cp, POS=pos,
                             CHANNELS_FAST=x.stride(1) == 1, num_warps=4)
    return out


def apply(x: torch.Tensor, norm: torch.nn.Module, *, silu: bool) -> torch.Tensor:
    """`channel_rms_norm_act` for diffusers' `WanRMS_norm` module `norm` (its gamma, bias and
    scale; F.normalize's eps, 1e-12). With gradients to compute it is the definition in
    differentiable torch ops: the op has no backward of its own."""
    bias = norm.bias if isinstance(norm.bias, torch.Tensor) else None
    if torch.is_grad_enabled() and (x.requires_grad or norm.gamma.requires_grad):
        return reference(x, norm.gamma, bias, norm.scale, 1e-12, silu)
    return channel_rms_norm_act(x, norm.gamma, bias, float(norm.scale), 1e-12, silu)
