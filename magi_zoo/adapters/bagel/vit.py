"""BAGEL's NaViT SigLIP encoder (so400m/14, 26 layers) and the ViT -> LLM connector.

Images of different sizes are packed into one token sequence; `cu_seqlens` marks where
each image starts so images never attend to each other. That varlen attention is a
registered custom op (`magi_zoo::bagel_varlen_attention`): opaque to dynamo, so the whole
ViT compiles with `fullgraph=True` instead of being fenced off with torch.compiler.disable.

Names equal the official checkpoint's (`vit_model.vision_model.encoder.layers.{i}...`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import SiglipVisionConfig
from transformers.activations import ACT2FN
from transformers.models.siglip.modeling_siglip import SiglipMLP

from ...engine import register_custom_op


def _varlen_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@register_custom_op("bagel_varlen_attention", is_subgraph_boundary=True, fake=_varlen_fake)
def bagel_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention within each packed segment. q/k/v: [tokens, heads, dim];
    cu_seqlens: int [num_segments + 1] offsets. Returns [tokens, heads, dim].

    Uses flash-attn's varlen kernel when it is installed and the tensors are on CUDA;
    otherwise one SDPA call per segment (the segment bounds are read on the host, which is
    why this is an opaque op rather than traced code)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        try:
            from flash_attn import flash_attn_varlen_func  # lazy: optional dependency (a CUDA wheel)
        except ImportError:
            flash_attn_varlen_func = None
        if flash_attn_varlen_func is not None:
            cu = cu_seqlens.to(torch.int32)
            m = int((cu[1:] - cu[:-1]).max())
            return flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=False)
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for s, e in zip(bounds[:-1], bounds[1:]):
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1))
        out[s:e] = o.transpose(0, 1)
    return out


class VarlenSiglipAttention(nn.Module):
    """SigLIP attention (q/k/v/out projections with bias) over a packed sequence."""

    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        e = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(e, e), nn.Linear(e, e)
        self.v_proj, self.out_proj = nn.Linear(e, e), nn.Linear(e, e)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, -1)
        k = self.k_proj(x).view(n, self.num_heads, -1)
        v = self.v_proj(x).view(n, self.num_heads, -1)
        return self.out_proj(bagel_varlen_attention(q, k, v, cu_seqlens).reshape(n, -1))


class BagelVitLayer(nn.Module):
    """Pre-LN SigLIP encoder layer; the MLP is transformers' SiglipMLP (fc1/fc2, gelu-tanh)."""

    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        e, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(e, eps=eps)
        self.self_attn = VarlenSiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(e, eps=eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens)
        return x + self.mlp(self.layer_norm2(x))


class BagelVitEmbeddings(nn.Module):
    """Patch embedding as a Linear over flattened (row, col, channel) patches (the official
    checkpoint stores it 2-D) plus a learnt table indexed by row * max_side + col."""

    def __init__(self, config: SiglipVisionConfig, max_num_patch_per_side: int):
        super().__init__()
        p, c = config.patch_size, config.num_channels
        self.patch_embedding = nn.Linear(p * p * c, config.hidden_size)
        self.position_embedding = nn.Embedding(max_num_patch_per_side ** 2, config.hidden_size)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.patch_embedding(patches) + self.position_embedding(position_ids)


class BagelEncoder(nn.Module):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList([BagelVitLayer(config) for _ in range(config.num_hidden_layers)])


class BagelVisionModel(nn.Module):
    def __init__(self, config: SiglipVisionConfig, max_num_patch_per_side: int):
        super().__init__()
        self.embeddings = BagelVitEmbeddings(config, max_num_patch_per_side)
        self.encoder = BagelEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BagelVisionTransformer(nn.Module):
    """`vit_model` of the checkpoint. forward(patches [N, p*p*3], position_ids [N],
    cu_seqlens [images+1]) -> [N, vit_hidden]."""

    def __init__(self, config: SiglipVisionConfig, max_num_patch_per_side: int):
        super().__init__()
        self.config = config
        self.vision_model = BagelVisionModel(config, max_num_patch_per_side)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        vm = self.vision_model
        x = vm.embeddings(patches, position_ids)
        for layer in vm.encoder.layers:
            x = layer(x, cu_seqlens)
        return vm.post_layernorm(x)


class MLPConnector(nn.Module):
    """ViT features -> LLM width: fc1, gelu-tanh, fc2 (both with bias)."""

    def __init__(self, in_dim: int, out_dim: int, act: str = "gelu_pytorch_tanh"):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.act = ACT2FN[act]
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
