"""RMSNorm over the heads, then the interleaved rotary embedding, in one pass: the
`magi_zoo::rms_norm_rope` custom op (Wan's query and key).

Why: Wan normalises q and k over all heads (an RMSNorm over 1,536 channels at 1.3B, 5,120 at
14B) and then rotates channel pairs (2j, 2j+1) by per-token angles. Under inductor that is a
looped reduction plus strided pair reads and writes, ~0.9 TB/s on an H100: 13.4 ms of a 457 ms
Wan-1.3B forward (benchmarks/results/profile_wan2.1-t2v-1.3b_bf16_h100.md). This kernel reads
each token's row once, keeps it in registers as (pairs, 2), and writes the rotated row once,
already in the (batch, tokens, heads, head_dim) layout attention takes. Measured (H100,
Wan2.1-I2V-14B forward, benchmarks/results/profile_wan2.1-i2v-14b-480p_bf16_{unfused,fused}_h100.md):
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
    import triton
    import triton.language as tl

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
