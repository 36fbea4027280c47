"""RMSNorm, then the interleaved rotary embedding, in one pass: `magi_zoo::rms_norm_rope`
(Wan's query and key: the norm over all heads) and `magi_zoo::rms_norm_rope_heads` (Flux's and
Qwen-Image's: the norm over each head, a text prefix joined in front; see `rms_norm_rope_heads`
below, and `joint_attention.py` for the joint attention around it).

Why: Wan normalises q and k over all heads (an RMSNorm over 1,536 channels at 1.3B, 5,120 at
14B) and then rotates channel pairs (2j, 2j+1) by per-token angles. Under inductor that is a
looped reduction plus strided pair reads and writes, ~0.9 TB/s on an H100: 13.4 ms of a 457 ms
Wan-1.3B forward (benchmarks/results/profiles/profile_wan2.1-t2v-1.3b_bf16_h100.md). This kernel reads
each token's row once, keeps it in registers as (pairs, 2), and writes the rotated row once,
already in the (batch, tokens, heads, head_dim) layout attention takes. Measured (H100,
Wan2.1-I2V-14B forward, benchmarks/results/profiles/profile_wan2.1-i2v-14b-480p_bf16_{unfused,fused}_h100.md):
inductor's kernel 56.1 ms per forward, this one 39.9 (~1.3 TB/s: one row per program leaves
few rows in flight; the next thing to tune). A version reading rows contiguously with each
pair partner as a second load was slower (87.7 ms, ..._bf16_fused2_h100.md) and was dropped.
Training (gradients wanted) takes the definition in torch ops: the op has no backward.

Semantics (`reference`, the CPU / fallback path, is the definition): y = rms_norm(x) * weight
over the last dim; split into heads; for each pair j of a head's channels, with c = cos[..., 2j]
and s = sin[..., 2j + 1] (diffusers' Wan convention, cos/sin of shape (1, S, 1, D)):
out[2j] = y[2j] c - y[2j+1] s, out[2j+1] = y[2j] s + y[2j+1] c. The kernel computes in fp32
without rounding y to the input dtype in between (the unfused path rounds once more).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..custom_ops import register_custom_op
from .triton_bundle import track
from . import triton_available

MAX_ROW = 16384  # widest row (heads x head_dim) the kernel holds in registers


def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
              heads: int) -> torch.Tensor:
    """The op's definition: diffusers' RMSNorm + Wan's `apply_rotary_emb`, op for op."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps).unflatten(-1, (heads, -1))
    x1, x2 = y.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(y)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(y)


def _fake(x, weight, eps, cos, sin, heads):
    return x.new_empty((*x.shape[:-1], heads, x.shape[-1] // heads))


def _check(x, weight, cos, sin, heads):
    n = x.shape[-1]
    if x.dim() != 3 or n % heads or (n // heads) % 2:
        raise ValueError(f"rms_norm_rope takes x (batch, tokens, heads * head_dim) with an even head_dim; got "
                         f"{tuple(x.shape)} with heads={heads}")
    if weight is not None and weight.shape != (n,):
        raise ValueError(f"rms_norm_rope: the norm weight must have {n} values (one per channel); got "
                         f"{tuple(weight.shape)}")
    d = n // heads
    if cos.shape[-1] != d or sin.shape != cos.shape:
        raise ValueError(f"rms_norm_rope: cos and sin must end in head_dim={d} and match; got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")


def _kernel_ok(x, weight, cos, sin) -> bool:
    b, s, n = x.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and n <= MAX_ROW and b * s > 0
            and cos.dim() == 4 and cos.shape[0] == 1 and cos.shape[1] == s and cos.shape[2] == 1
            and (weight is None or weight.is_cuda) and triton_available())


@register_custom_op("rms_norm_rope", fake=_fake)
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  heads: int) -> torch.Tensor:
    """(batch, tokens, heads, head_dim) = rope(rms_norm(x) * weight) (module docstring); one Triton
    pass on CUDA for cos/sin of shape (1, tokens, 1, head_dim), `reference` elsewhere."""
    _check(x, weight, cos, sin, heads)
    if not _kernel_ok(x, weight, cos, sin):
        return reference(x, weight, eps, cos, sin, heads)
    return _launch(x, weight, eps, cos, sin, heads)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (importing this module needs no triton)."""
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton
    import triton.language as tl  # lazy: with triton, above

    @track  # its compiled files travel in the compile cache (triton_bundle)
    @triton.jit
    def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, tokens, n, half_d, sx, scs, sss, so, eps,
                         HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tok = row % tokens
        p = tl.arange(0, BLOCK)  # pair index within the row
        two = tl.arange(0, 2)
        cols = 2 * p[:, None] + two[None, :]  # (BLOCK, 2): channels 2p, 2p + 1
        mask = cols < n
        x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / n + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        ye, yo = tl.split(y)
        j = p % half_d  # pair index within the head
        pm = 2 * p < n
        c = tl.load(cos_ptr + tok * scs + 2 * j, mask=pm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok * sss + 2 * j + 1, mask=pm, other=0.0).to(tl.float32)
        out = tl.join(ye * c - yo * s, ye * s + yo * c)
        tl.store(out_ptr + row * so + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    return norm_rope_kernel


def _launch(x, weight, eps, cos, sin, heads):
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton

    b, s, n = x.shape
    x2 = x.reshape(b * s, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cos2, sin2 = cos.reshape(s, -1), sin.reshape(s, -1)
    cos2 = cos2 if cos2.stride(-1) == 1 else cos2.contiguous()
    sin2 = sin2 if sin2.stride(-1) == 1 else sin2.contiguous()
    out = torch.empty((b, s, heads, n // heads), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n // 2)
    w = weight.contiguous() if weight is not None else x2
    _kernel()[(b * s,)](x2, w, cos2, sin2, out, s, n, n // heads // 2, x2.stride(0), cos2.stride(0),
                        sin2.stride(0), n, float(eps), HAS_W=weight is not None, BLOCK=block,
                        num_warps=4 if block <= 1024 else 8)
    return out


def apply(x: torch.Tensor, norm: torch.nn.Module, rotary_emb, heads: int) -> torch.Tensor:
    """`rms_norm_rope` for an `nn.RMSNorm` over x's last dim and diffusers' (cos, sin) pair. With
    gradients to compute (training) it is the definition in differentiable torch ops: the op has
    no backward of its own."""
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    if torch.is_grad_enabled() and (x.requires_grad or (norm.weight is not None and norm.weight.requires_grad)):
        return reference(x, norm.weight, eps, rotary_emb[0], rotary_emb[1], heads)
    return rms_norm_rope(x, norm.weight, eps, rotary_emb[0], rotary_emb[1], heads)


# -- per-head RMSNorm + rope, with an optional prefix (Flux, Qwen-Image) ---------------------
# Flux normalises q and k per head (RMSNorm over head_dim), in its double blocks joins the text
# stream's q/k (normalised by their own norms) in front of the image stream's, and rotates the
# joint sequence with diffusers' `apply_rotary_emb(..., sequence_dim=1)`. Under inductor that is
# a reduction kernel writing a permuted layout (~0.12 ms per single block at 1024^2 on an H100,
# ~0.5 TB/s: benchmarks/results/profiles/profile_flux.1-dev_bf16_h100.md) plus the concatenation's copy.
# This kernel reads each (token, head) row of D channels once, from whichever stream holds the
# token, and writes the joint (batch, prefix + tokens, heads, head_dim) result once: 26-28 us per
# call at 1024^2 on an H100 against inductor's 43-68 (GPU time, benchmarks/norm_rope_heads.py).
# The joint attention around it, shared by Flux's and Qwen-Image's processors: joint_attention.py.


def reference_heads(x: torch.Tensor, weight: torch.Tensor | None, prefix: torch.Tensor | None,
                    prefix_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
    """`rms_norm_rope_heads`' definition: diffusers' Flux attention, op for op -- RMSNorm over the
    last dim of x (B, S, H, D) and of prefix (B, T, H, D), concatenated (prefix first) along the
    tokens, then `apply_rotary_emb` with cos/sin (T + S, D), pairs (2j, 2j + 1):
    out[2j] = y[2j] cos[2j] - y[2j+1] sin[2j], out[2j+1] = y[2j+1] cos[2j+1] + y[2j] sin[2j+1]."""
    d = x.shape[-1]
    y = F.rms_norm(x, (d,), weight, eps)
    if prefix is not None:
        y = torch.cat([F.rms_norm(prefix, (d,), prefix_weight, eps), y], dim=1)
    real, imag = y.reshape(*y.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (y.float() * cos[None, :, None, :] + rotated.float() * sin[None, :, None, :]).to(y.dtype)


def _fake_heads(x, weight, prefix, prefix_weight, eps, cos, sin):
    t = 0 if prefix is None else prefix.shape[1]
    return x.new_empty((x.shape[0], t + x.shape[1], *x.shape[2:]))


def _check_heads(x, weight, prefix, prefix_weight, cos, sin):
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rms_norm_rope_heads takes x (batch, tokens, heads, head_dim) with an even head_dim; "
                         f"got {tuple(x.shape)}")
    b, s, h, d = x.shape
    if prefix is not None and (prefix.dim() != 4 or prefix.shape[0] != b or prefix.shape[2:] != x.shape[2:]
                               or prefix.dtype != x.dtype):
        raise ValueError(f"rms_norm_rope_heads: the prefix must be (batch={b}, text tokens, heads={h}, "
                         f"head_dim={d}) in {x.dtype}; got {tuple(prefix.shape)} {prefix.dtype}")
    if prefix is not None and (weight is None) != (prefix_weight is None):
        raise ValueError("rms_norm_rope_heads: give both norm weights or neither (the prefix's and x's)")
    for name, w in (("weight", weight), ("prefix_weight", prefix_weight)):
        if w is not None and w.shape != (d,):
            raise ValueError(f"rms_norm_rope_heads: {name} must have head_dim={d} values; got {tuple(w.shape)}")
    n = s + (0 if prefix is None else prefix.shape[1])
    if cos.shape != (n, d) or sin.shape != cos.shape:
        raise ValueError(f"rms_norm_rope_heads: cos and sin must be (prefix + tokens={n}, head_dim={d}); got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")


def _heads_kernel_ok(x, weight, prefix, cos) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.numel() > 0 and x.stride(-1) == 1
            and (prefix is None or prefix.stride(-1) == 1) and cos.is_cuda and x.shape[-1] <= 1024
            and (weight is None or weight.is_cuda) and triton_available())


@register_custom_op("rms_norm_rope_heads", fake=_fake_heads)
def rms_norm_rope_heads(x: torch.Tensor, weight: torch.Tensor | None, prefix: torch.Tensor | None,
                        prefix_weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    """(batch, prefix + tokens, heads, head_dim) = rope(cat(rms_norm(prefix), rms_norm(x))) per head
    (`reference_heads`); one Triton pass on CUDA, the definition elsewhere."""
    _check_heads(x, weight, prefix, prefix_weight, cos, sin)
    if not _heads_kernel_ok(x, weight, prefix, cos):
        return reference_heads(x, weight, prefix, prefix_weight, eps, cos, sin)
    return _launch_heads(x, weight, prefix, prefix_weight, eps, cos, sin)


@functools.cache
def _heads_kernel():
    """The per-head kernel, built on first use. A program takes UNITS (token, head) rows of D
    channels, as (UNITS, D / 2, 2) pairs; a row's token t < T is read from the prefix, else from x."""
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton
    import triton.language as tl  # lazy: with triton, above

    @track  # its compiled files travel in the compile cache (triton_bundle)
    @triton.jit
    def head_norm_rope_kernel(x_ptr, w_ptr, p_ptr, pw_ptr, cos_ptr, sin_ptr, out_ptr, n_units, heads, joint, text,
                              sxb, sxs, sxh, spb, sps, sph, scs, sss, eps, D: tl.constexpr, HALF: tl.constexpr,
                              HAS_W: tl.constexpr, HAS_P: tl.constexpr, UNITS: tl.constexpr):
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        live = u < n_units
        h = u % heads
        tok = (u // heads) % joint
        b = u // (heads * joint)
        p = tl.arange(0, HALF)
        two = tl.arange(0, 2)
        cols = 2 * p[:, None] + two[None, :]  # (HALF, 2): channels 2j, 2j + 1
        cmask = (cols < D)[None, :, :]
        img = tok >= text
        m_img = (live & img)[:, None, None] & cmask
        x_off = b * sxb + (tok - text) * sxs + h * sxh
        x = tl.load(x_ptr + x_off[:, None, None] + cols[None, :, :], mask=m_img, other=0.0).to(tl.float32)
        if HAS_P:
            m_txt = (live & (tok < text))[:, None, None] & cmask
            p_off = b * spb + tok * sps + h * sph
            x += tl.load(p_ptr + p_off[:, None, None] + cols[None, :, :], mask=m_txt, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / D + eps)
        y = x * rstd[:, None, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :, :]
            if HAS_P:
                pw = tl.load(pw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :, :]
                w = tl.where(img[:, None, None], w, pw)
            y = y * w
        rope = (live[:, None, None] & cmask)
        c = tl.load(cos_ptr + tok[:, None, None] * scs + cols[None, :, :], mask=rope, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok[:, None, None] * sss + cols[None, :, :], mask=rope, other=0.0).to(tl.float32)
        ye, yo = tl.split(y)
        ce, co = tl.split(c)
        se, so = tl.split(s)
        out = tl.join(ye * ce - yo * se, yo * co + ye * so)
        tl.store(out_ptr + u[:, None, None] * D + cols[None, :, :], out.to(out_ptr.dtype.element_ty), mask=rope)

    return head_norm_rope_kernel


def _launch_heads(x, weight, prefix, prefix_weight, eps, cos, sin, units: int | None = None, warps: int = 2):
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton

    b, s, h, d = x.shape
    t = 0 if prefix is None else prefix.shape[1]
    out = torch.empty((b, t + s, h, d), dtype=x.dtype, device=x.device)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    half = triton.next_power_of_2(d // 2)
    # ~512 channels per program on 2 warps: at Flux's shapes 2.1-2.2 TB/s, where 4,096 channels on
    # 8 warps ran at 0.4 TB/s and inductor's kernel at 0.8-1.3 (benchmarks/norm_rope_heads.py,
    # results/kernels/norm_rope_heads_h100.md: the speed swings 5x with these two numbers)
    units = units or max(1, 512 // (2 * half))
    n = b * (t + s) * h
    p = prefix if prefix is not None else x
    w = weight if weight is not None else x
    pw = prefix_weight if prefix_weight is not None else w
    _heads_kernel()[(triton.cdiv(n, units),)](
        x, w, p, pw, cos, sin, out, n, h, t + s, t, x.stride(0), x.stride(1), x.stride(2), p.stride(0), p.stride(1),
        p.stride(2), cos.stride(0), sin.stride(0), float(eps), D=d, HALF=half, HAS_W=weight is not None,
        HAS_P=prefix is not None, UNITS=units, num_warps=warps)
    return out


def apply_heads(x: torch.Tensor, norm: torch.nn.Module, rotary_emb, prefix: torch.Tensor | None = None,
                prefix_norm: torch.nn.Module | None = None) -> torch.Tensor:
    """`rms_norm_rope_heads` for `nn.RMSNorm`s over head_dim (x's and the prefix's) and diffusers'
    (cos, sin) pair of (tokens, head_dim). With gradients to compute (training) it is the
    definition in differentiable torch ops: the op has no backward of its own."""
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    pw = prefix_norm.weight if prefix_norm is not None else None
    cos, sin = rotary_emb
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, prefix, norm.weight, pw)):
        return reference_heads(x, norm.weight, prefix, pw, eps, cos, sin)
    return rms_norm_rope_heads(x, norm.weight, prefix, pw, eps, cos, sin)
