"""The "naive" port: Self-Forcing's reference control flow on the same weights.

Kept for two reasons: it is the straightforward dynamic-slicing implementation the static
path is checked against (same frames on the tiny model), and it is a benchmark strategy,
so the graph breaks and the speed-up of the static path are measured, not claimed.

What it keeps from `wan/modules/causal_model.py` (`_forward_inference`,
`CausalWanSelfAttention.forward`, `causal_rope_apply`) -- each is a graph break or a
per-block shape under `torch.compile`:
- per layer a dict cache {"k", "v", "global_end_index", "local_end_index"} whose ends
  are tensors read with `.item()` and written with `.fill_()`;
- the write and the attention slice the cache at those ends, so the attended length
  (and the shape of attention) changes every block;
- `grid_sizes` is a tensor built per call; RoPE iterates `grid_sizes.tolist()` and the
  start frame is `current_start // prod(grid_sizes[0][1:]).item()`;
- the cross-attention cache is a dict with a Python `is_init` flag, filled on first use;
- the rolling cache (local_attn_size / sink_size) shifts its contents left with a clone
  when a new block does not fit;
- the text projection runs on every call.
Cache layout is the reference's (B, N, heads, D).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .rope import apply_rope


def new_kv_cache(num_layers: int, batch: int, tokens: int, heads: int, head_dim: int, *, dtype, device) -> list[dict]:
    """The reference's `_initialize_kv_cache`: per layer zeros plus two end indices."""
    return [{"k": torch.zeros(batch, tokens, heads, head_dim, dtype=dtype, device=device),
             "v": torch.zeros(batch, tokens, heads, head_dim, dtype=dtype, device=device),
             "global_end_index": torch.tensor([0], dtype=torch.long, device=device),
             "local_end_index": torch.tensor([0], dtype=torch.long, device=device)} for _ in range(num_layers)]


def new_crossattn_cache(num_layers: int) -> list[dict]:
    """The reference's `_initialize_crossattn_cache` (filled on first use)."""
    return [{"is_init": False} for _ in range(num_layers)]


def _rope(model, x, grid_sizes, start_frame):
    """causal_rope_apply: per sample, tables sliced at the start frame of grid_sizes.tolist()."""
    out = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        cos, sin = model.rope_freqs(start_frame, f, h, w)
        out.append(apply_rope(x[i:i + 1, :f * h * w], cos.to(x.device), sin.to(x.device)))
    return torch.cat(out)


def _self_attention(model, a, n, grid_sizes, kv_cache, current_start, sink_tokens):
    b, s = n.shape[:2]
    q = a.norm_q(a.to_q(n)).unflatten(2, (a.heads, -1))
    k = a.norm_k(a.to_k(n)).unflatten(2, (a.heads, -1))
    v = a.to_v(n).unflatten(2, (a.heads, -1))
    frame_seqlen = math.prod(grid_sizes[0][1:]).item()
    current_start_frame = current_start // frame_seqlen
    q = _rope(model, q, grid_sizes, current_start_frame)
    k = _rope(model, k, grid_sizes, current_start_frame)
    current_end = current_start + q.shape[1]
    cache_size = kv_cache["k"].shape[1]
    if current_end > kv_cache["global_end_index"].item() and s + kv_cache["local_end_index"].item() > cache_size:
        # The rolling cache (local_attn_size != -1): evict the oldest tokens after the sinks by
        # shifting the rest left (a clone: the slices overlap), then append the new block.
        evicted = s + kv_cache["local_end_index"].item() - cache_size
        rolled = kv_cache["local_end_index"].item() - evicted - sink_tokens
        for name in ("k", "v"):
            kv_cache[name][:, sink_tokens:sink_tokens + rolled] = \
                kv_cache[name][:, sink_tokens + evicted:sink_tokens + evicted + rolled].clone()
        local_end = kv_cache["local_end_index"].item() + current_end - kv_cache["global_end_index"].item() - evicted
    else:
        local_end = kv_cache["local_end_index"].item() + current_end - kv_cache["global_end_index"].item()
    local_start = local_end - s
    kv_cache["k"][:, local_start:local_end] = k
    kv_cache["v"][:, local_start:local_end] = v
    max_attention_size = cache_size  # local_attn_size x frame tokens = the cache (-1: the whole video)
    lo = max(0, local_end - max_attention_size)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kv_cache["k"][:, lo:local_end].transpose(1, 2),
                                       kv_cache["v"][:, lo:local_end].transpose(1, 2)).transpose(1, 2)
    kv_cache["global_end_index"].fill_(current_end)
    kv_cache["local_end_index"].fill_(local_end)
    return a.to_out[0](o.flatten(2).type_as(q))


def _cross_attention(a, n, context, cache):
    q = a.norm_q(a.to_q(n)).unflatten(2, (a.heads, -1))
    if not cache["is_init"]:
        cache["is_init"] = True
        cache["k"] = a.norm_k(a.to_k(context)).unflatten(2, (a.heads, -1))
        cache["v"] = a.to_v(context).unflatten(2, (a.heads, -1))
    o = F.scaled_dot_product_attention(q.transpose(1, 2), cache["k"].transpose(1, 2),
                                       cache["v"].transpose(1, 2)).transpose(1, 2)
    return a.to_out[0](o.flatten(2).type_as(q))


def naive_step(model, hidden_states, timestep, encoder_hidden_states, kv_cache, crossattn_cache,
               current_start: int, sink_tokens: int = 0) -> torch.Tensor:
    """One forward over one block, the reference's way; same arithmetic as
    `CausalWanTransformer3DModel.denoise_step`, so the two agree to rounding."""
    x = model.patch_embedding(hidden_states)
    grid_sizes = torch.stack([torch.tensor(u.shape[1:], dtype=torch.long) for u in x])
    b, _, f, h, w = x.shape
    x = x.flatten(2).transpose(1, 2).contiguous()
    temb, tproj = model.time_embedding(timestep, x.dtype)
    context = model.condition_embedder.text_embedder(encoder_hidden_states)
    for i, block in enumerate(model.blocks):
        shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + tproj.float()).chunk(6, dim=1)
        n = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        o = _self_attention(model, block.attn1, n, grid_sizes, kv_cache[i], current_start, sink_tokens)
        x = (x.float() + o * gate).type_as(x)
        n = block.norm2(x.float()).type_as(x)
        x = x + _cross_attention(block.attn2, n, context, crossattn_cache[i])
        n = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        x = (x.float() + block.ffn(n).float() * c_gate).type_as(x)
    return model._head(x, temb, b, f, h, w)
