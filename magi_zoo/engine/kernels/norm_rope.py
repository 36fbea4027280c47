"""RMSNorm, then the interleaved rotary embedding, in one pass: `magi_zoo::rms_norm_rope`
(Wan's query and key: the norm over all heads) and `magi_zoo::rms_norm_rope_heads` (Flux's and
Qwen-Image's: the norm over each head, a text prefix joined in front; see `rms_norm_rope_heads`
below, and `joint_attention.py` for the joint attention around it).

Why: Wan normalises q and k over all heads (an RMSNorm over 1,536 channels at 1.3B, 5,120 at
14B) and then rotates channel pairs (2j, 2j+1) by per-token angles. Under inductor that is a
looped reduction plus strided pair reads and writes, ~0.9 TB/s on an H100: 13.4 ms of a 457 ms
Wan-1.3B forward (benchmarks/results/profiles/profile_wan2.1-t2v-1.3b_bf16_h100.md). This kernel reads
each token's row once, keeps it in registers, and writes the rotated row once, already in the
(batch, tokens, heads, head_dim) layout attention takes. Its first layout held the row as
(pairs, 2): inductor's 56.1 ms per Wan2.1-I2V-14B forward became 39.9 on an H100
(benchmarks/results/profiles/profile_wan2.1-i2v-14b-480p_bf16_{unfused,fused}_h100.md), ~1.3 TB/s,
because a pair is one 4-byte load per thread. The row is now loaded flat as a (heads, head_dim)
tile -- 16-byte loads -- and split into pairs in registers: on an H200 at 480x832x81, 1.3B's
call 95 -> 60 us and 14B's 406 -> 216 (benchmarks/norm_rope_layouts.py). A version reading each
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

MAX_TILE = 16384  # most (padded) channels of one row the all-heads kernel holds in registers


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


def _kernel_ok(x, weight, cos, sin, heads) -> bool:
    b, s, n = x.shape
    hp, dp = _tile(heads, n // heads)
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and hp * dp <= MAX_TILE and b * s > 0
            and cos.dim() == 4 and cos.shape[0] == 1 and cos.shape[1] == s and cos.shape[2] == 1
            and (weight is None or weight.is_cuda) and triton_available())


@register_custom_op("rms_norm_rope", fake=_fake)
def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  heads: int) -> torch.Tensor:
    """(batch, tokens, heads, head_dim) = rope(rms_norm(x) * weight) (module docstring); one Triton
    pass on CUDA for cos/sin of shape (1, tokens, 1, head_dim), `reference` elsewhere."""
    _check(x, weight, cos, sin, heads)
    if not _kernel_ok(x, weight, cos, sin, heads):
        return reference(x, weight, eps, cos, sin, heads)
    return _launch(x, weight, eps, cos, sin, heads)


@functools.cache
def _kernel():
    """The Triton kernel, built on first use (importing this module needs no triton). A program
    takes one token's row as a (heads, head_dim) tile (both padded to powers of two, masked),
    loaded flat -- 16-byte loads per thread -- and split into (2j, 2j + 1) pairs in registers."""
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton
    import triton.language as tl  # lazy: with triton, above

    @track  # its compiled files travel in the compile cache (triton_bundle)
    @triton.jit
    def norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, tokens, heads, d, sx, scs, sss, eps,
                         HAS_W: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tok = row % tokens
        hh = tl.arange(0, HP)
        col = tl.arange(0, DP)
        cm = col < d
        m = (hh < heads)[:, None] & cm[None, :]
        offs = hh[:, None] * d + col[None, :]
        x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (heads * d) + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        # Wan's convention: channel pair j turns by cos[2j] and sin[2j + 1]
        c, _ = tl.split(tl.reshape(tl.load(cos_ptr + tok * scs + col, mask=cm, other=0.0).to(tl.float32),
                                   (DP // 2, 2)))
        _, s = tl.split(tl.reshape(tl.load(sin_ptr + tok * sss + col, mask=cm, other=0.0).to(tl.float32),
                                   (DP // 2, 2)))
        ye, yo = tl.split(tl.reshape(y, (HP, DP // 2, 2)))
        out = tl.join(ye * c[None, :] - yo * s[None, :], ye * s[None, :] + yo * c[None, :])
        tl.store(out_ptr + row * (heads * d) + offs, tl.reshape(out, (HP, DP)).to(out_ptr.dtype.element_ty),
                 mask=m)

    return norm_rope_kernel


def _tile(heads: int, d: int) -> tuple[int, int]:
    """(heads, head_dim) padded to powers of two: the all-heads kernel's tile."""
    return 1 << (heads - 1).bit_length(), 1 << (d - 1).bit_length()


def _launch(x, weight, eps, cos, sin, heads, warps: int | None = None):
    b, s, n = x.shape
    x2 = x.reshape(b * s, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cos2, sin2 = cos.reshape(s, -1), sin.reshape(s, -1)
    cos2 = cos2 if cos2.stride(-1) == 1 else cos2.contiguous()
    sin2 = sin2 if sin2.stride(-1) == 1 else sin2.contiguous()
    d = n // heads
    out = torch.empty((b, s, heads, d), dtype=x.dtype, device=x.device)
    hp, dp = _tile(heads, d)
    w = weight.contiguous() if weight is not None else x2
    # 32 fp32 values per thread (a warp per 1,024 tile elements): at Wan's 480x832x81 shapes on an
    # H200 that is the fastest warp count at both widths -- 1.3B's 16 x 128 tile on 2 warps 3.4 TB/s,
    # 14B's 64 x 128 on 8 warps 3.1 TB/s, against 2.1 and 1.7 for the (pairs, 2) tile this replaced
    # (benchmarks/norm_rope_layouts.py, results/kernels/norm_rope_layouts_h200.md)
    _kernel()[(b * s,)](x2, w, cos2, sin2, out, s, heads, d, x2.stride(0), cos2.stride(0), sin2.stride(0),
                        float(eps), HAS_W=weight is not None, HP=hp, DP=dp, num_warps=warps or max(1, hp * dp // 1024))
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
# call at 1024^2 on an H100 against inductor's 43-68 (GPU time, benchmarks/norm_rope_heads.py),
# as a (rows, pairs, 2) tile; loaded flat and split in registers as now, 19-25 us on an H200
# against 23-27 for that tile and inductor's 42-60 (benchmarks/norm_rope_layouts.py).
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
    channels as a (UNITS, DP) tile (DP: D padded to a power of two), loaded flat and split into
    (2j, 2j + 1) pairs in registers; a row's token t < T is read from the prefix, else from x."""
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton
    import triton.language as tl  # lazy: with triton, above

    @track  # its compiled files travel in the compile cache (triton_bundle)
    @triton.jit
    def head_norm_rope_kernel(x_ptr, w_ptr, p_ptr, pw_ptr, cos_ptr, sin_ptr, out_ptr, n_units, heads, joint, text,
                              sxb, sxs, sxh, spb, sps, sph, scs, sss, eps, D: tl.constexpr, DP: tl.constexpr,
                              HAS_W: tl.constexpr, HAS_P: tl.constexpr, UNITS: tl.constexpr):
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        live = u < n_units
        h = u % heads
        tok = (u // heads) % joint
        b = u // (heads * joint)
        col = tl.arange(0, DP)
        cm = (col < D)[None, :]
        img = tok >= text
        x_off = b * sxb + (tok - text) * sxs + h * sxh
        x = tl.load(x_ptr + x_off[:, None] + col[None, :], mask=(live & img)[:, None] & cm, other=0.0).to(tl.float32)
        if HAS_P:
            p_off = b * spb + tok * sps + h * sph
            x += tl.load(p_ptr + p_off[:, None] + col[None, :], mask=(live & (tok < text))[:, None] & cm,
                         other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(w_ptr + col, mask=col < D, other=0.0).to(tl.float32)[None, :]
            if HAS_P:
                w = tl.where(img[:, None], w, tl.load(pw_ptr + col, mask=col < D, other=0.0).to(tl.float32)[None, :])
            y = y * w
        rope = live[:, None] & cm
        c = tl.load(cos_ptr + tok[:, None] * scs + col[None, :], mask=rope, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + tok[:, None] * sss + col[None, :], mask=rope, other=0.0).to(tl.float32)
        ye, yo = tl.split(tl.reshape(y, (UNITS, DP // 2, 2)))
        ce, co = tl.split(tl.reshape(c, (UNITS, DP // 2, 2)))
        se, so = tl.split(tl.reshape(s, (UNITS, DP // 2, 2)))
        out = tl.reshape(tl.join(ye * ce - yo * se, yo * co + ye * so), (UNITS, DP))
        tl.store(out_ptr + u[:, None] * D + col[None, :], out.to(out_ptr.dtype.element_ty), mask=rope)

    return head_norm_rope_kernel


def _launch_heads(x, weight, prefix, prefix_weight, eps, cos, sin, units: int | None = None, warps: int = 2):
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton

    b, s, h, d = x.shape
    t = 0 if prefix is None else prefix.shape[1]
    out = torch.empty((b, t + s, h, d), dtype=x.dtype, device=x.device)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    dp = triton.next_power_of_2(d)
    # ~1,024 channels per program on 2 warps (8 rows of 128): at Flux.1's and FLUX.2's shapes on an
    # H200 the fastest setting over a whole forward's calls, 2.3-3.4 TB/s against 2.1-2.6 for the
    # (rows, pairs, 2) tile this replaced, whose loads were 4 bytes wide
    # (benchmarks/norm_rope_layouts.py, results/kernels/norm_rope_layouts_h200.md)
    units = units or max(1, 1024 // dp)
    n = b * (t + s) * h
    p = prefix if prefix is not None else x
    w = weight if weight is not None else x
    pw = prefix_weight if prefix_weight is not None else w
    _heads_kernel()[(triton.cdiv(n, units),)](
        x, w, p, pw, cos, sin, out, n, h, t + s, t, x.stride(0), x.stride(1), x.stride(2), p.stride(0), p.stride(1),
        p.stride(2), cos.stride(0), sin.stride(0), float(eps), D=d, DP=dp, HAS_W=weight is not None,
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
