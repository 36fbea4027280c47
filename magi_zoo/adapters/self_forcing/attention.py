"""Attention of one block's queries over the static KV cache, without data-dependent shapes.

The cache holds the whole video's keys/values (N tokens per layer); a block attends to the
first `kv_len` of them (the earlier blocks plus itself), and `kv_len` grows block by block.
Slicing the cache at `kv_len` would give every block its own shape (a recompile, or
symbolic shapes) and, read with `.item()`, a graph break. Here the shape is always the
whole cache and the valid length is a tensor:

- "sdpa": `scaled_dot_product_attention` with a boolean length mask (keys >= kv_len are
  masked). Any device, any dtype; it computes scores for the whole cache (on average
  twice the keys a block needs over a 7-block video) and, with a mask, CUDA uses the
  memory-efficient kernel rather than flash/cuDNN.
- "flex": FlexAttention (torch.nn.attention.flex_attention) with a block mask built from
  the same tensor: key tiles past `kv_len` are skipped, so the work is proportional to
  the valid length; the mask's tile counts are tensors, so shapes stay fixed. Compiled,
  it is one generated kernel (inductor); eager it runs torch's reference implementation.
- "fa3": FlashAttention-3's forward kernel (the `fa3-fwd` wheel, the `hopper` extra; bf16,
  CUDA) with `seqused_k` = the valid length as a device tensor -- FA3's own KV-cache
  interface (`flash_attn_with_kvcache(cache_seqlens=...)` passes its cache lengths the same
  way): only the valid keys are read, at flash speed. The kernel is a torch.library custom
  op with a fake implementation, so it stays inside one graph.
"""

from __future__ import annotations

import difflib

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ...engine import fa3_missing_reason, fa3_wheel_forward

IMPLS = ("sdpa", "flex", "fa3")


def check_impl(impl: str) -> None:
    """A clear error for an unknown name, with the closest choice."""
    if impl not in IMPLS:
        near = difflib.get_close_matches(str(impl), (*IMPLS, "auto"), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(f"cache attention {impl!r}{hint}; choices: {', '.join(IMPLS)}, auto")


def auto_impl(device: torch.device, dtype: torch.dtype) -> str:
    """The measured order on an H100 (benchmarks/results/self_forcing/self_forcing_h100.md): FA3 reading
    only the valid keys, then FlexAttention skipping the tiles past them; both beat a masked
    SDPA over the whole cache. Off CUDA, sdpa."""
    if device.type != "cuda":
        return "sdpa"
    if dtype == torch.bfloat16 and fa3_missing_reason() is None:
        return "fa3"
    return "flex"


def length_mask(n: int, kv_len: torch.Tensor) -> torch.Tensor:
    """(1, 1, 1, n) bool: key j is attended iff j < kv_len (a 0-dim tensor)."""
    return (torch.arange(n, device=kv_len.device) < kv_len).view(1, 1, 1, n)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor,
                    keep: torch.Tensor, impl: str = "sdpa") -> torch.Tensor:
    """q (B, H, S, D) over the first `kv_len` keys of k / v (B, H, N, D) -> (B, H, S, D).
    `keep` is `length_mask(N, kv_len)`, computed once per step for every layer."""
    if impl == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    if impl == "flex":
        return flex_cache_attention(q, k, v, kv_len)
    if impl == "fa3":
        return fa3_cache_attention(q, k, v, kv_len)
    check_impl(impl)
    raise AssertionError(impl)


def flex_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """FlexAttention over the cache prefix [0, kv_len): a block mask whose per-query-tile
    count of key tiles is ceil(kv_len / tile) -- a tensor, so the kernel skips the tiles
    past the valid length while every shape stays fixed."""
    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < kv_len

    mask = create_block_mask(prefix, B=None, H=None, Q_LEN=q.shape[2], KV_LEN=k.shape[2], device=q.device)
    return flex_attention(q, k, v, block_mask=mask)


_fa3_forward = None


def fa3_forward():
    """FA3's forward op (the fa3-fwd wheel's, through the engine's fa3 kernel module), or a
    clear error saying what to install."""
    global _fa3_forward
    if _fa3_forward is None:
        why = fa3_missing_reason()
        if why is not None:
            raise RuntimeError(f"cache_attention='fa3': {why}; or use cache_attention='sdpa'")
        _fa3_forward = fa3_wheel_forward()
    return _fa3_forward


def fa3_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """FA3 over the cache prefix: q (B, H, S, D), k / v (B, H, N, D) views read as FA3's
    (B, N, H, D) layout (strided, last dim contiguous), `seqused_k` = kv_len per batch
    element (int32)."""
    if q.dtype != torch.bfloat16 or q.device.type != "cuda":
        raise TypeError(f"cache_attention='fa3' runs bf16 on CUDA (got {q.dtype} on {q.device.type}); "
                        "use cache_attention='sdpa'")
    if _fa3_forward is None:  # set eagerly by the model's `cache_attention` setter
        raise RuntimeError("cache_attention='fa3' was reached before its kernel was resolved; set "
                           "transformer.cache_attention = 'fa3' (which loads it) before the first step")
    seqused = kv_len.to(torch.int32).reshape(1).expand(q.shape[0]).contiguous()
    out, *_ = _fa3_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), seqused_k=seqused,
                            softmax_scale=q.shape[-1] ** -0.5, causal=False)
    return out.transpose(1, 2)
