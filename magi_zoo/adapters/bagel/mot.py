"""The Mixture-of-Transformers LLM of BAGEL (Qwen2.5 layout, two expert weight sets).

Every decoder layer holds two copies of its weights: the "understanding" set (text and
ViT tokens) and the `*_moe_gen` set (VAE latent tokens). Both share ONE self-attention
over the packed sequence. Module and parameter names equal the official checkpoint's,
so `language_model.model.layers.{i}.self_attn.q_proj_moe_gen.weight` loads as is.

Compile design: a layer never indexes a KV cache by a per-layer Python int. The caller
passes each layer its own cache tensors (`k_cache`, `v_cache`) and receives the updated
ones back, so all N layers have the same guards (type, tensor metadata) and one compiled
frame serves them all (see tests/test_bagel.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm, apply_rotary_pos_emb, repeat_kv

from ...engine import fa3_attention


def route(x: torch.Tensor, und_fn, gen_fn, und_idx: torch.Tensor | None, gen_idx: torch.Tensor | None):
    """Apply `und_fn` to understanding rows and `gen_fn` to generation rows of a packed
    [tokens, ...] tensor. `gen_idx=None` means every row is an understanding token.

    Index tensors (not boolean masks) keep every shape known from the index lengths, so
    this traces without data-dependent shapes."""
    if gen_idx is None:
        return und_fn(x)
    y_und = und_fn(x.index_select(0, und_idx))
    y_gen = gen_fn(x.index_select(0, gen_idx))
    out = y_gen.new_empty((x.shape[0], *y_gen.shape[1:]))
    return out.index_copy(0, und_idx, y_und.to(y_gen.dtype)).index_copy(0, gen_idx, y_gen)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Plain RoPE tables for 1-D positions (rotate-half convention, as Qwen2).

    Computed on the fly from the positions tensor: no `inv_freq` buffer to keep in sync with
    checkpoint loading, and positions stay tensors (never Python ints that would be guarded)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MoTAttention(nn.Module):
    """Shared self-attention with per-expert q/k/v/o projections and q/k RMSNorms.

    Attention backends (the plan's `attention` section sets `attention_backend`): "native" =
    torch SDPA (key/value heads repeated for GQA); "fa3" = FlashAttention-3's forward (the
    `hopper` extra) for the calls without a mask -- the denoising step (a bidirectional query
    block over the context) and the one-token decode step -- with GQA native to the kernel;
    calls with a mask (the causal text prefill) stay on SDPA, FA3 taking no mask."""

    ATTENTION_BACKENDS = ("native", "fa3")

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.attention_backend = "native"
        h, nq, nkv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        d = h // nq
        self.num_heads, self.num_kv_heads, self.head_dim = nq, nkv, d
        eps = config.rms_norm_eps
        for sfx in ("", "_moe_gen"):
            setattr(self, f"q_proj{sfx}", nn.Linear(h, nq * d, bias=True))
            setattr(self, f"k_proj{sfx}", nn.Linear(h, nkv * d, bias=True))
            setattr(self, f"v_proj{sfx}", nn.Linear(h, nkv * d, bias=True))
            setattr(self, f"o_proj{sfx}", nn.Linear(nq * d, h, bias=False))
            setattr(self, f"q_norm{sfx}", Qwen2RMSNorm(d, eps=eps))
            setattr(self, f"k_norm{sfx}", Qwen2RMSNorm(d, eps=eps))

    def forward(self, h, k_cache, v_cache, cos, sin, und_idx=None, gen_idx=None, attn_mask=None):
        """h: [n, hidden] (already normed). k_cache/v_cache: [kv, kv_heads, head_dim] (may be
        empty). Returns (output [n, hidden], keys [kv+n, ...], values [kv+n, ...])."""
        n, d = h.shape[0], self.head_dim
        gen = gen_idx is not None
        # Generation mode normalises and rotates q/k in fp32 (as the official gen path);
        # understanding mode stays in the activation dtype.
        qk_dtype = torch.float32 if gen else h.dtype

        def qkv(proj_q, proj_k, proj_v, norm_q, norm_k):
            def f(x):
                q = proj_q(x).view(-1, self.num_heads, d).to(qk_dtype)
                k = proj_k(x).view(-1, self.num_kv_heads, d).to(qk_dtype)
                v = proj_v(x).view(-1, self.num_kv_heads, d)
                return torch.cat([norm_q(q).flatten(1), norm_k(k).flatten(1), v.to(qk_dtype).flatten(1)], dim=-1)
            return f

        packed = route(h, qkv(self.q_proj, self.k_proj, self.v_proj, self.q_norm, self.k_norm),
                       qkv(self.q_proj_moe_gen, self.k_proj_moe_gen, self.v_proj_moe_gen,
                           self.q_norm_moe_gen, self.k_norm_moe_gen), und_idx, gen_idx)
        nq, nkv = self.num_heads * d, self.num_kv_heads * d
        q = packed[:, :nq].view(n, self.num_heads, d)
        k = packed[:, nq:nq + nkv].view(n, self.num_kv_heads, d)
        v = packed[:, nq + nkv:].view(n, self.num_kv_heads, d).to(h.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos.to(qk_dtype), sin.to(qk_dtype), unsqueeze_dim=1)
        q, k = q.to(h.dtype), k.to(h.dtype)
        keys = torch.cat([k_cache, k], dim=0)
        values = torch.cat([v_cache, v], dim=0)
        if self.attention_backend == "fa3" and attn_mask is None:
            # (tokens, heads, dim) is FA3's (seq, heads, dim) layout already: no transposes
            o = fa3_attention(q[None], keys[None], values[None], enable_gqa=True)[0].reshape(n, nq)
        else:
            groups = self.num_heads // self.num_kv_heads
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], repeat_kv(keys.transpose(0, 1)[None], groups),
                repeat_kv(values.transpose(0, 1)[None], groups), attn_mask=attn_mask)
            o = o[0].transpose(0, 1).reshape(n, nq)
        out = route(o, self.o_proj, self.o_proj_moe_gen, und_idx, gen_idx)
        return out, keys, values


class BagelMoTLayer(nn.Module):
    """One MoT decoder layer (pre-norm; attention then SwiGLU MLP, per-expert weights).

    forward(x, k_cache, v_cache, cos, sin, und_idx, gen_idx, attn_mask) -> (x, keys, values).
    It reads no per-layer Python attribute, so a class-name spec key compiles it once for
    all layers."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.self_attn = MoTAttention(config)
        self.mlp = Qwen2MLP(config)
        self.mlp_moe_gen = Qwen2MLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.input_layernorm_moe_gen = Qwen2RMSNorm(h, eps=eps)
        self.post_attention_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.post_attention_layernorm_moe_gen = Qwen2RMSNorm(h, eps=eps)

    def forward(self, x, k_cache, v_cache, cos, sin, und_idx=None, gen_idx=None, attn_mask=None):
        h = route(x, self.input_layernorm, self.input_layernorm_moe_gen, und_idx, gen_idx)
        attn, keys, values = self.self_attn(h, k_cache, v_cache, cos, sin, und_idx, gen_idx, attn_mask)
        x = x + attn
        mlp = route(x, lambda t: self.mlp(self.post_attention_layernorm(t)),
                    lambda t: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(t)), und_idx, gen_idx)
        return x + mlp, keys, values


class BagelQwen2Model(nn.Module):
    """Embeddings, the MoT layers and the two final norms (`norm` for understanding
    tokens, `norm_moe_gen` for latent tokens)."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([BagelMoTLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_moe_gen = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BagelLanguageModel(nn.Module):
    """`language_model` of the checkpoint: `.model` plus an untied `.lm_head`."""

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.config = config
        self.model = BagelQwen2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def rope_theta(self) -> float:
        params = getattr(self.config, "rope_parameters", None) or {}
        return float(params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0)))
