"""fp8 attention's operands: per-head scales for FA3's float8 e4m3 QK^T and PV, with K and V
smoothed -- the quantization `kernels/fa3.py`'s `fa3_fp8_attention` runs before the kernel --
and `fp8_reference`, the same arithmetic dequantized on torch's SDPA (for the tests and
`benchmarks/fp8_attention.py`).

FA3 runs QK^T and PV in float8 e4m3 when q, k, v are fp8 and one descale per (batch, head)
is passed. One scale per *tensor* costs 5.4e-2 relative error per call (docs/precision.md);
two exact rewrites make the per-head scales fine enough:
- K smoothing (SageAttention): softmax(q.(k_j - m)) = softmax(q.k_j) for any m shared by all
  keys, so K minus its mean over tokens attends identically while its range (what the
  scale must cover) shrinks to the spread around that mean.
- V smoothing: every row of softmax(QK^T) sums to 1, so P(V - m) + m = PV; V minus its mean
  over tokens is quantized, and the mean is added back in bf16 after the kernel.
Q gets its own per-head scale. What FA3 cannot take is a scale per token block, so this is
as fine as the kernel allows; `benchmarks/fp8_attention.py` measures each choice.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_EPS = 1e-12


def quantize_per_head(x: torch.Tensor, *, smooth: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (B, S, H, D) -> (fp8 e4m3 tensor, descale (B, H) fp32, mean over tokens or None), with
    x ~= fp8 * descale[:, None, :, None] + mean. `smooth` subtracts the per-head, per-channel
    mean over tokens first (module docstring: exact for K and V)."""
    xf = x.float()
    if smooth:
        # max over tokens and channels of |x - m| is, per channel, the larger of (max x - m) and
        # (m - min x): the mean, max and min are one pass over x (one fused reduction), where
        # amax(|x - mean|) was a second pass after the mean's. Equal bit for bit: rounding
        # x - m is monotonic in x, so the largest difference is the difference of the largest.
        mean = xf.mean(dim=1, keepdim=True)
        spread = torch.maximum(xf.amax(dim=1, keepdim=True) - mean, mean - xf.amin(dim=1, keepdim=True))
        descale = spread.amax(dim=(1, 3)).clamp(min=_FP8_EPS) / FP8_MAX  # (B, H)
        xs = xf - mean
    else:
        mean, xs = None, xf
        descale = xf.abs().amax(dim=(1, 3)).clamp(min=_FP8_EPS) / FP8_MAX  # (B, H)
    q = (xs / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, descale.contiguous(), mean


def quantize_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """Q per head; K and V per head after smoothing. Returns (q8, qs, k8, ks, v8, vs, V's mean)."""
    q8, qs, _ = quantize_per_head(query, smooth=False)
    k8, ks, _ = quantize_per_head(key, smooth=True)
    v8, vs, vm = quantize_per_head(value, smooth=True)
    return q8, qs, k8, ks, v8, vs, vm


def fp8_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """What `kernels/fa3.py`'s `fa3_fp8_attention` computes, from the dequantized operands in
    fp32 with SDPA (for tests and for separating quantization error from kernel error). Inputs
    (B, S, H, D)."""
    q8, qs, k8, ks, v8, vs, vm = quantize_qkv(query, key, value)
    deq = lambda t, s: (t.float() * s[:, None, :, None]).transpose(1, 2)  # noqa: E731
    out = torch.nn.functional.scaled_dot_product_attention(deq(q8, qs), deq(k8, ks), deq(v8, vs), scale=scale)
    return (out.transpose(1, 2) + vm).to(query.dtype)
