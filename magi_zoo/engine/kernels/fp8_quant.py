"""Row-wise fp8 quantization of a GELU output -- and of a row-wise concatenation with one --
in a single pass: the `magi_zoo::rowwise_fp8_gelu_cat` custom op.

Why a kernel of our own: an fp8 linear quantizes each input row with its own scale (amax /
448). When the input is a GELU output, inductor fuses GELU, amax and cast into one looped
reduction that reads the pre-activation twice (once for the amax, once for the cast) and
recomputes GELU; on Flux.1-dev's single blocks (GELU of the 12,288-wide MLP concatenated with
the 3,072-wide attention output, `proj_out`'s input) that kernel took ~220 us per call at
~1.7 TB/s (benchmarks/results/profiles/profile_flux.1-dev_fp8_graphs_h100.json). This kernel holds one
whole row in registers: one read of each part, GELU once, the row's amax, one fp8 write.

Semantics (the CPU / fallback path, `reference`, is the definition): x = concat(parts along
the last dim, GELU (tanh approximation) applied to the parts flagged), computed in fp32;
scale = max(amax(|x|) per row, eps) / 448; q = clamp(x / scale) as float8_e4m3fn. Unlike the
unfused path, the GELU output is quantized from fp32, without rounding it to bf16 first.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..custom_ops import register_custom_op
from .triton_bundle import track
from . import triton_available

E4M3_MAX = 448.0
EPS = 1e-12
MAX_ROW = 32768  # widest row the kernel holds in registers; wider rows take the reference path


def reference(a: torch.Tensor, b: torch.Tensor | None, bias_a: torch.Tensor | None, bias_b: torch.Tensor | None,
              gelu_a: bool, gelu_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's definition in plain torch (module docstring)."""
    def part(p, bias, g):
        p = p.float() if bias is None else p.float() + bias.float()
        return F.gelu(p, approximate="tanh") if g else p

    x = torch.cat([part(a, bias_a, gelu_a)] + ([part(b, bias_b, gelu_b)] if b is not None else []), dim=-1)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _fake(a, b, bias_a, bias_b, gelu_a, gelu_b):
    k = a.shape[-1] + (b.shape[-1] if b is not None else 0)
    return a.new_empty((a.shape[0], k), dtype=torch.float8_e4m3fn), a.new_empty((a.shape[0], 1), dtype=torch.float32)


def _check(a: torch.Tensor, b: torch.Tensor | None, bias_a=None, bias_b=None) -> None:
    if a.dim() != 2 or (b is not None and (b.dim() != 2 or b.shape[0] != a.shape[0])):
        raise ValueError(f"rowwise_fp8_gelu_cat takes 2-D parts with the same rows; got {tuple(a.shape)} and "
                         f"{None if b is None else tuple(b.shape)}")
    for bias, part in ((bias_a, a), (bias_b, b)):
        if bias is not None and (part is None or bias.shape != (part.shape[1],)):
            raise ValueError(f"rowwise_fp8_gelu_cat: a bias must be 1-D with one value per column of its part; "
                             f"got {tuple(bias.shape)} for {None if part is None else tuple(part.shape)}")


@register_custom_op("rowwise_fp8_gelu_cat", fake=_fake)
def rowwise_fp8_gelu_cat(a: torch.Tensor, b: torch.Tensor | None, bias_a: torch.Tensor | None,
                         bias_b: torch.Tensor | None, gelu_a: bool, gelu_b: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 (M, Ka + Kb), fp32 scale (M, 1)) of concat(gelu?(a + bias_a), gelu?(b + bias_b)) per
    row; `b` and the biases may be None (a bias: the producing linear's, so its raw GEMM output
    is read once). One Triton pass on CUDA (rows up to MAX_ROW wide), `reference` elsewhere."""
    _check(a, b, bias_a, bias_b)
    width = a.shape[1] + (b.shape[1] if b is not None else 0)
    if a.device.type != "cuda" or width > MAX_ROW or a.shape[0] == 0 or not triton_available():
        return reference(a, b, bias_a, bias_b, gelu_a, gelu_b)
    return _launch(a, b, bias_a, bias_b, gelu_a, gelu_b)


# The kernel is built inside a function so that importing this module needs no triton (CPU
# builds of torch lack it). Triton's compiler resolves `_gelu` from the closure; its CPU
# interpreter (TRITON_INTERPRET=1) does not, and its fp8 casts are not exact either, so the
# kernel is checked on a GPU (tests/test_fp8_fused.py).
@functools.cache
def _kernel():
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton
    import triton.language as tl  # lazy: with triton, above

    @triton.jit
    def _gelu(x):
        y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # 0.5 x (1 + tanh(y)) = x sigmoid(2y): no cancellation for negative x, and an exp that
        # overflows to inf gives -0, the right limit
        return x / (1.0 + tl.exp(-2.0 * y))

    @track  # its compiled files travel in the compile cache (triton_bundle)
    @triton.jit
    def kernel(a_ptr, b_ptr, ba_ptr, bb_ptr, q_ptr, s_ptr, ka, kb, sa, sb, sq,
               GELU_A: tl.constexpr, GELU_B: tl.constexpr, HAS_B: tl.constexpr,
               BIAS_A: tl.constexpr, BIAS_B: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        oa = tl.arange(0, BLOCK_A)
        ma = oa < ka
        xa = tl.load(a_ptr + row * sa + oa, mask=ma, other=0.0).to(tl.float32)
        if BIAS_A:
            xa += tl.load(ba_ptr + oa, mask=ma, other=0.0).to(tl.float32)
        if GELU_A:
            xa = _gelu(xa)
        amax = tl.max(tl.where(ma, tl.abs(xa), 0.0), axis=0)
        if HAS_B:
            ob = tl.arange(0, BLOCK_B)
            mb = ob < kb
            xb = tl.load(b_ptr + row * sb + ob, mask=mb, other=0.0).to(tl.float32)
            if BIAS_B:
                xb += tl.load(bb_ptr + ob, mask=mb, other=0.0).to(tl.float32)
            if GELU_B:
                xb = _gelu(xb)
            amax = tl.maximum(amax, tl.max(tl.where(mb, tl.abs(xb), 0.0), axis=0))
        scale = tl.maximum(amax, 1e-12) / 448.0
        qa = tl.minimum(tl.maximum(xa / scale, -448.0), 448.0)
        tl.store(q_ptr + row * sq + oa, qa.to(tl.float8e4nv), mask=ma)
        if HAS_B:
            qb = tl.minimum(tl.maximum(xb / scale, -448.0), 448.0)
            tl.store(q_ptr + row * sq + ka + ob, qb.to(tl.float8e4nv), mask=mb)
        tl.store(s_ptr + row, scale)

    return kernel


def _split_row(a: torch.Tensor, bias: torch.Tensor | None, gelu: bool):
    """One part whose width is not a power of two, as two column views the kernel reads as its
    parts a and b (same rows, same result): each part's block is padded to a power of two, so
    8,960 columns (Wan-1.3B's FFN) take 8,192 + 1,024 registers per row instead of 16,384 --
    fewer wasted registers, more rows in flight per SM. Kept whole where splitting saves nothing
    (13,824 = 8,192 + 5,632 pads to 16,384 either way)."""
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton

    k = a.shape[1]
    head = 1 << (k.bit_length() - 1)  # the largest power of two <= k
    if head == k or head + triton.next_power_of_2(k - head) >= triton.next_power_of_2(k):
        return a, None, bias, None, False
    return (a[:, :head], a[:, head:], None if bias is None else bias[:head],
            None if bias is None else bias[head:], gelu)


def _launch(a: torch.Tensor, b: torch.Tensor | None, bias_a, bias_b, gelu_a: bool, gelu_b: bool):
    # lazy: triton is optional (CPU builds of torch lack it) and costly; built on first CUDA call
    import triton

    a = a if a.stride(-1) == 1 else a.contiguous()
    bias_a = bias_a.contiguous() if bias_a is not None else None
    bias_b = bias_b.contiguous() if bias_b is not None else None
    if b is not None and b.stride(-1) != 1:
        b = b.contiguous()
    if b is None:
        a, b, bias_a, bias_b, gelu_b = _split_row(a, bias_a, gelu_a)
    m, ka = a.shape
    kb = b.shape[1] if b is not None else 0
    q = torch.empty((m, ka + kb), dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=a.device)
    block_a = triton.next_power_of_2(ka)
    block_b = triton.next_power_of_2(kb) if kb else 1
    warps = 16 if block_a + block_b >= 8192 else 8 if block_a + block_b >= 2048 else 4
    _kernel()[(m,)](a, b if b is not None else a, bias_a if bias_a is not None else a,
                    bias_b if bias_b is not None else a, q, s, ka, kb, a.stride(0),
                    b.stride(0) if b is not None else 0, q.stride(0), GELU_A=gelu_a, GELU_B=gelu_b,
                    HAS_B=b is not None, BIAS_A=bias_a is not None, BIAS_B=bias_b is not None and b is not None,
                    BLOCK_A=block_a, BLOCK_B=block_b, num_warps=warps)
    return q, s
