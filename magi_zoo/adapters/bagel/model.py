"""The BAGEL top module: LLM (MoT), ViT + connector, latent embedders, and the compiled
entry points `denoise_step` (one velocity against one KV context) and `decode_step` (one
greedy text token).

KV caches are `KVContext`s: one (keys, values) tensor pair per layer plus the context's
rope counter. Entry points take the per-layer tensors as plain lists and positions as
tensors, so no Python int that changes between calls or layers reaches compiled code.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from transformers import Qwen2Config, SiglipVisionConfig

from ...engine import offload_hold, offload_streams
from .flow import TimestepEmbedder, cfg_active, cfg_combine
from .mot import BagelLanguageModel, rope_cos_sin
from .packing import causal_mask, sincos_2d
from .vit import BagelVisionTransformer, MLPConnector


@dataclasses.dataclass
class KVContext:
    """One attention context: per-layer keys/values [kv_len, kv_heads, head_dim] and the
    next rope position. Appending builds new tensors, so `copy()` is a cheap snapshot."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rope: int = 0

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    def copy(self) -> "KVContext":
        return KVContext(list(self.keys), list(self.values), self.rope)


class PositionEmbedding(nn.Module):
    """Frozen 2-D sin-cos table (`pos_embed`, saved in the checkpoint) indexed by flat id."""

    def __init__(self, grid: int, hidden: int):
        super().__init__()
        self.grid, self.hidden = grid, hidden
        self.pos_embed = nn.Parameter(torch.zeros(grid * grid, hidden), requires_grad=False)
        self.reset_table()

    @torch.no_grad()
    def reset_table(self) -> None:
        self.pos_embed.copy_(sincos_2d(self.hidden, self.grid).to(self.pos_embed))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[ids]


class Bagel(nn.Module):
    """BAGEL's transformer side (everything in `ema.safetensors`), names as the checkpoint."""

    def __init__(self, llm_config: Qwen2Config, vit_config: SiglipVisionConfig, *, latent_patch_size: int,
                 max_latent_size: int, vit_max_num_patch_per_side: int, latent_channels: int):
        super().__init__()
        h = llm_config.hidden_size
        self.latent_patch_size = latent_patch_size
        self.max_latent_size = max_latent_size
        self.latent_channels = latent_channels
        self.vit_max_num_patch_per_side = vit_max_num_patch_per_side
        token_dim = latent_patch_size ** 2 * latent_channels
        self.language_model = BagelLanguageModel(llm_config)
        self.vit_model = BagelVisionTransformer(vit_config, vit_max_num_patch_per_side)
        self.connector = MLPConnector(vit_config.hidden_size, h, vit_config.hidden_act)
        self.vit_pos_embed = PositionEmbedding(vit_max_num_patch_per_side, h)
        self.time_embedder = TimestepEmbedder(h)
        self.vae2llm = nn.Linear(token_dim, h)
        self.llm2vae = nn.Linear(h, token_dim)
        self.latent_pos_embed = PositionEmbedding(max_latent_size, h)
        llm = self.language_model
        self.head_dim = h // llm_config.num_attention_heads
        self.rope_theta = llm.rope_theta

    # -- helpers --------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.model.layers

    def _dtype(self) -> torch.dtype:
        return self.vae2llm.weight.dtype

    def empty_context(self) -> KVContext:
        """A context with no tokens (rope 0)."""
        cfg = self.language_model.config
        w = self.vae2llm.weight
        empty = lambda: w.new_zeros((0, cfg.num_key_value_heads, self.head_dim))
        return KVContext([empty() for _ in self.layers], [empty() for _ in self.layers], 0)

    def _run_layers(self, x, keys, values, positions, und_idx=None, gen_idx=None, attn_mask=None):
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        new_k, new_v = [], []
        # Each layer gets ITS cache tensors; no layer index reaches the layer's forward.
        for layer, kc, vc in zip(self.layers, keys, values):
            x, k, v = layer(x, kc, vc, cos, sin, und_idx, gen_idx, attn_mask)
            new_k.append(k)
            new_v.append(v)
        return x, new_k, new_v

    # -- prefill (runs once per input; the layers are compiled regionally) ----------------
    @torch.no_grad()
    def prefill_text(self, ctx: KVContext, ids: torch.Tensor) -> KVContext:
        """Append a text block (causal) at positions rope.. and advance rope by its length."""
        n = ids.shape[0]
        x = self.language_model.model.embed_tokens(ids)
        pos = torch.arange(ctx.rope, ctx.rope + n, device=ids.device)
        mask = causal_mask(n, ctx.length + n, device=ids.device)
        _, k, v = self._run_layers(x, ctx.keys, ctx.values, pos, attn_mask=mask)
        return KVContext(k, v, ctx.rope + n)

    def embed_vit(self, patches: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """ViT tokens -> LLM embeddings: ViT, connector, + the frozen ViT position table."""
        feats = self.vit_model(patches.to(self._dtype()), position_ids, cu_seqlens)
        return self.connector(feats) + self.vit_pos_embed(position_ids)

    @torch.no_grad()
    def prefill_image_block(self, ctx: KVContext, tokens: torch.Tensor, start_id: int, end_id: int) -> KVContext:
        """Append [<|vision_start|>, tokens, <|vision_end|>] (bidirectional, understanding
        experts), all at position rope; rope advances by one."""
        emb = self.language_model.model.embed_tokens(torch.tensor([start_id, end_id], device=tokens.device))
        x = torch.cat([emb[:1], tokens.to(emb.dtype), emb[1:]], dim=0)
        pos = torch.full((x.shape[0],), ctx.rope, device=x.device, dtype=torch.long)
        _, k, v = self._run_layers(x, ctx.keys, ctx.values, pos)
        return KVContext(k, v, ctx.rope + 1)

    def _latent_block(self, x_t: torch.Tensor, t: torch.Tensor, latent_pos_ids: torch.Tensor,
                      marker_ids: torch.Tensor):
        """[<|vision_start|>, latents, <|vision_end|>] embeddings and the expert routing:
        latents = vae2llm(x_t) + time embedding + latent position; markers are text tokens."""
        n = x_t.shape[0]
        latents = self.vae2llm(x_t.to(self._dtype())) + self.time_embedder(t) + self.latent_pos_embed(latent_pos_ids)
        marks = self.language_model.model.embed_tokens(marker_ids)
        x = torch.cat([marks[:1], latents.to(marks.dtype), marks[1:]], dim=0)
        gen_idx = torch.arange(1, n + 1, device=x_t.device)
        und_idx = torch.stack([gen_idx.new_zeros(()), gen_idx.new_full((), n + 1)])
        return x, und_idx, gen_idx

    @torch.no_grad()
    def prefill_vae_block(self, ctx: KVContext, latents: torch.Tensor, latent_pos_ids: torch.Tensor,
                          marker_ids: torch.Tensor) -> KVContext:
        """Append a clean input image as VAE latent tokens (editing): the denoiser's query
        block at flow time t = 0 (generation experts for the latents), bidirectional, all
        at position rope; rope advances by one. latents: [n, p*p*C], already scaled."""
        t = torch.zeros(1, device=latents.device, dtype=torch.float32)
        x, und_idx, gen_idx = self._latent_block(latents, t, latent_pos_ids, marker_ids)
        pos = torch.full((x.shape[0],), ctx.rope, device=x.device, dtype=torch.long)
        _, k, v = self._run_layers(x, ctx.keys, ctx.values, pos, und_idx, gen_idx)
        return KVContext(k, v, ctx.rope + 1)

    # -- compiled entry points -----------------------------------------------------------
    def denoise_step(self, x_t: torch.Tensor, t: torch.Tensor, latent_pos_ids: torch.Tensor,
                     position: torch.Tensor, marker_ids: torch.Tensor,
                     keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Velocity of the latent tokens x_t [n, 64] at flow time t [1] against one context.

        The query block is [<|vision_start|>, n latents, <|vision_end|>], bidirectional,
        all at `position` [1] (the context's rope); markers use the understanding experts,
        latents the generation experts. The context is not extended."""
        n = x_t.shape[0]
        x, und_idx, gen_idx = self._latent_block(x_t, t, latent_pos_ids, marker_ids)
        x, _, _ = self._run_layers(x, keys, values, position.expand(n + 2), und_idx, gen_idx)
        return self._velocity_head(x, n)

    def _velocity_head(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The last layer's output of the query block -> the velocity of its n latents (the
        markers dropped)."""
        return self.llm2vae(self.language_model.model.norm_moe_gen(x[1:n + 1]))

    def decode_step(self, token: torch.Tensor, position: torch.Tensor, keys: list[torch.Tensor],
                    values: list[torch.Tensor]):
        """One text token [1] at `position` [1] -> (logits [vocab], keys, values) with the
        token appended to every layer's cache."""
        x = self.language_model.model.embed_tokens(token)
        x, k, v = self._run_layers(x, keys, values, position)
        logits = self.language_model.lm_head(self.language_model.model.norm(x))
        return logits[0], k, v

    # -- one guided step: what benchmarks time --------------------------------------------
    def forward(self, x_t: torch.Tensor, t: float, latent_pos_ids: torch.Tensor, marker_ids: torch.Tensor,
                full: KVContext, no_text: KVContext | None = None, no_image: KVContext | None = None, *,
                cfg_text_scale: float = 4.0, cfg_img_scale: float = 1.0, cfg_interval=(0.4, 1.0),
                cfg_renorm_type: str = "global", cfg_renorm_min: float = 0.0) -> torch.Tensor:
        """Guided velocity for one denoising step: the conditional context always, the
        no-text / no-image contexts only when their scale > 1 and t is inside the interval."""
        tt = torch.full((1,), float(t), device=x_t.device, dtype=torch.float32)
        active = cfg_active(float(t), cfg_interval)
        st = cfg_text_scale if active else 1.0
        si = cfg_img_scale if active else 1.0
        contexts = [full]
        if st > 1.0:
            if no_text is None:
                raise ValueError("cfg_text_scale > 1 needs the no-text context")
            contexts.append(no_text)
            if si > 1.0:
                if no_image is None:
                    raise ValueError("cfg_img_scale > 1 needs the no-image context")
                contexts.append(no_image)
        vs = self._velocities(x_t, tt, latent_pos_ids, marker_ids, contexts)
        if len(vs) == 1:
            return vs[0]
        return cfg_combine(vs[0], vs[1], vs[2] if len(vs) > 2 else None, text_scale=st, img_scale=si,
                           renorm_type=cfg_renorm_type, renorm_min=cfg_renorm_min)

    def _velocities(self, x_t: torch.Tensor, tt: torch.Tensor, latent_pos_ids: torch.Tensor,
                    marker_ids: torch.Tensor, contexts: list[KVContext]) -> list[torch.Tensor]:
        """The velocity against each context. Context by context through `denoise_step` (the
        region the shipped plan compiles whole), unless layers stream their weights (offload):
        then layer by layer, each layer run for every context while it is on the card
        (`offload_hold`), so a streamed layer is copied once per step instead of once per
        context. Same operations on the same inputs either way, only their order differs."""
        def pos(ctx: KVContext) -> torch.Tensor:
            return torch.full((1,), ctx.rope, device=x_t.device, dtype=torch.long)

        if not any(offload_streams(layer) for layer in self.layers):
            return [self.denoise_step(x_t, tt, latent_pos_ids, pos(c), marker_ids, c.keys, c.values) for c in contexts]
        n = x_t.shape[0]
        x, und_idx, gen_idx = self._latent_block(x_t, tt, latent_pos_ids, marker_ids)
        xs = [x] * len(contexts)
        rope = [rope_cos_sin(pos(c).expand(n + 2), self.head_dim, self.rope_theta, x.dtype) for c in contexts]
        for i, layer in enumerate(self.layers):
            with offload_hold(layer):
                for j, c in enumerate(contexts):
                    xs[j], _, _ = layer(xs[j], c.keys[i], c.values[i], *rope[j], und_idx, gen_idx, None)
        return [self._velocity_head(x, n) for x in xs]
