"""The causal Wan2.1 transformer of Self-Forcing, on diffusers' Wan modules.

`CausalWanTransformer3DModel` *is* diffusers' `WanTransformer3DModel` (same modules, same
parameter names, same `save_pretrained` / `from_pretrained`); it adds the causal,
KV-cached inference the reference implements in `wan/modules/causal_model.py`:

- `cross_kv(text)`: the text embedding and every layer's cross-attention keys/values,
  computed once per prompt (the reference fills its `crossattn_cache` on the first call);
- `rope_tables(schedule, h, w)`: each block's RoPE cos/sin, precomputed once per video
  from diffusers' own frequency tables, with the block's time offset (the reference's
  `causal_rope_apply(start_frame=...)`, which iterates `grid_sizes.tolist()` per call);
- `denoise_step(...)`: one forward over one block of latent frames against the static
  KV cache -- the function compiled with `fullgraph=True`. Its keys/values are written
  into the preallocated cache at positions the host computed from the block index, and
  attention runs over the whole cache with the valid length as a tensor (a length mask),
  so every block and every step has the same shapes: one graph, 0 recompiles;
- `naive_step(...)`: the reference's control flow kept as a benchmark strategy (see
  `naive.py`).

Diffusers' own `forward` (bidirectional, the whole video at once) is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel

from . import attention, naive
from .rope import apply_rope
from .config import BlockSchedule


class CausalWanTransformer3DModel(WanTransformer3DModel):
    """Wan2.1's transformer with Self-Forcing's block-causal, KV-cached inference.

    `cache_attention` picks the attention over the static cache ("sdpa": a length mask
    over the whole cache, any device; "flex": FlexAttention, which skips the key tiles
    past the valid length; "fa3": FlashAttention-3 reading only the valid keys, bf16 on
    Hopper -- see attention.py)."""

    @property
    def cache_attention(self) -> str:
        """The attention over the static cache: "sdpa" | "flex" | "fa3", or "auto" (the
        default), which `resolve_cache_attention` turns into the fastest one the device has."""
        return self.__dict__.get("_cache_attention", "auto")

    @cache_attention.setter
    def cache_attention(self, impl: str) -> None:
        if impl != "auto":
            attention.check_impl(impl)
        if impl == "fa3":
            attention.fa3_forward()  # resolve the kernel here, eagerly: imports cannot be traced
        self.__dict__["_cache_attention"] = impl

    def resolve_cache_attention(self) -> str:
        """The concrete attention in effect: the set one, or for "auto" the fastest the
        model's current device and dtype have (fa3 where the kernel loads, bf16 CUDA; flex on
        other CUDA setups; sdpa elsewhere). Resolved eagerly -- the pipeline calls this before
        the compiled step -- and again if the model moves to another device or dtype."""
        impl = self.cache_attention
        if impl != "auto":
            return impl
        p = next(self.parameters())
        key = (p.device, p.dtype)
        cached = self.__dict__.get("_cache_attention_auto")
        if cached is None or cached[0] != key:
            choice = attention.auto_impl(*key)
            if choice == "fa3":
                attention.fa3_forward()
            self.__dict__["_cache_attention_auto"] = cached = (key, choice)
        return cached[1]

    # -- per prompt -------------------------------------------------------------------------
    def cross_kv(self, encoder_hidden_states: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the cross-attention keys and values of the prompt, (B, H, T, D) each:
        they depend on the prompt only, so every step of every block reuses them."""
        ctx = self.condition_embedder.text_embedder(encoder_hidden_states)
        ks, vs = [], []
        for block in self.blocks:
            a = block.attn2
            ks.append(a.norm_k(a.to_k(ctx)).unflatten(2, (a.heads, -1)).transpose(1, 2).contiguous())
            vs.append(a.to_v(ctx).unflatten(2, (a.heads, -1)).transpose(1, 2).contiguous())
        return ks, vs

    # -- per video --------------------------------------------------------------------------
    def rope_freqs(self, start_frame: int, frames: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin (1, frames*h*w, 1, D), fp32, for latent frames start_frame.. of an
        h x w token grid: diffusers' WanRotaryPosEmbed tables, time axis offset by
        `start_frame` (the reference's causal_rope_apply)."""
        rope = self.rope
        split = [rope.t_dim, rope.h_dim, rope.w_dim]
        out = []
        for table in (rope.freqs_cos, rope.freqs_sin):
            ft, fh, fw = table.float().split(split, dim=1)
            grid = torch.cat([
                ft[start_frame:start_frame + frames].view(frames, 1, 1, -1).expand(frames, h, w, -1),
                fh[:h].view(1, h, 1, -1).expand(frames, h, w, -1),
                fw[:w].view(1, 1, w, -1).expand(frames, h, w, -1),
            ], dim=-1)
            out.append(grid.reshape(1, frames * h * w, 1, -1).contiguous())
        return out[0], out[1]

    def rope_tables(self, schedule: BlockSchedule, h: int, w: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each block's RoPE tables, one contiguous tensor pair per block (a graph input of
        the same shape for every block; a view into one long table would differ in storage
        offset from block to block)."""
        need = schedule.latent_frames
        if need > self.rope.max_seq_len:
            raise ValueError(f"{need} latent frames exceed the RoPE table ({self.rope.max_seq_len} positions)")
        return [self.rope_freqs(schedule.start_frame(b), schedule.frames_per_block, h, w)
                for b in range(schedule.num_blocks)]

    # -- per step -------------------------------------------------------------------------------
    def time_embedding(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb (B, C), timestep_proj (B, 6, C)) as diffusers' WanTimeTextImageEmbedding
        computes them, without the text projection (done once per prompt in `cross_kv`)."""
        ce = self.condition_embedder
        t = ce.timesteps_proj(timestep).to(ce.time_embedder.linear_1.weight.dtype)
        temb = ce.time_embedder(t).to(dtype)
        return temb, ce.time_proj(ce.act_fn(temb)).unflatten(1, (6, -1))

    def denoise_step(self, hidden_states: torch.Tensor, timestep: torch.Tensor, cache_k: list[torch.Tensor],
                     cache_v: list[torch.Tensor], cross_k: list[torch.Tensor], cross_v: list[torch.Tensor],
                     rope_cos: torch.Tensor, rope_sin: torch.Tensor, write_index: torch.Tensor,
                     kv_len: torch.Tensor) -> torch.Tensor:
        """One forward over one block: the flow prediction for `hidden_states`.

        hidden_states: the block's latents (B, C, F_block, H, W); timestep: (B,) float;
        cache_k / cache_v: per layer, the static cache (B, heads, N, D), N = the video's
        tokens -- this call writes the block's keys/values at `write_index` (S positions,
        computed on the host from the block index) and attends to the first `kv_len`
        (a 0-dim int64 tensor: the cache prefix of earlier blocks plus the block itself);
        cross_k / cross_v: `cross_kv(prompt)`; rope_cos / rope_sin: the block's entry of
        `rope_tables`. Every argument has the same shape for every block and step, and no
        value is read back to the host: one graph serves the whole video.
        """
        b, _, f, h, w = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        f, h, w = f // p_t, h // p_h, w // p_w
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        temb, tproj = self.time_embedding(timestep, x.dtype)
        keep = attention.length_mask(cache_k[0].shape[2], kv_len)  # computed once, shared by the layers
        impl = self.resolve_cache_attention()  # a plain read once the pipeline resolved it eagerly
        for i, block in enumerate(self.blocks):
            x = self._causal_block(block, x, tproj, rope_cos, rope_sin, cache_k[i], cache_v[i], cross_k[i],
                                   cross_v[i], write_index, kv_len, keep, impl)
        return self._head(x, temb, b, f, h, w)

    def _causal_block(self, block, x, tproj, cos, sin, ck, cv, xk, xv, write_index, kv_len, keep, impl):
        """diffusers' WanTransformerBlock.forward with its self-attention made causal over the
        static cache and its cross-attention reading the per-prompt keys/values."""
        shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + tproj.float()).chunk(6, dim=1)
        # 1. self-attention over the cache
        a = block.attn1
        n = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        q = apply_rope(a.norm_q(a.to_q(n)).unflatten(2, (a.heads, -1)), cos, sin)
        k = apply_rope(a.norm_k(a.to_k(n)).unflatten(2, (a.heads, -1)), cos, sin)
        v = a.to_v(n).unflatten(2, (a.heads, -1))
        # In place, at host-computed positions (index_put_ on a graph input: inductor writes
        # the S rows where they belong, no copy of the cache).
        ck[:, :, write_index] = k.transpose(1, 2)
        cv[:, :, write_index] = v.transpose(1, 2)
        o = attention.cache_attention(q.transpose(1, 2), ck, cv, kv_len, keep, impl)
        o = a.to_out[0](o.transpose(1, 2).flatten(2).type_as(q))
        x = (x.float() + o * gate).type_as(x)
        # 2. cross-attention (keys/values of the prompt, computed once)
        a = block.attn2
        n = block.norm2(x.float()).type_as(x)
        q = a.norm_q(a.to_q(n)).unflatten(2, (a.heads, -1)).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, xk, xv)
        x = x + a.to_out[0](o.transpose(1, 2).flatten(2).type_as(q))
        # 3. feed-forward
        n = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + block.ffn(n).float() * c_gate).type_as(x)

    def _head(self, x, temb, b, f, h, w):
        """diffusers' output norm, projection and unpatchify."""
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        x = self.proj_out(x)
        p_t, p_h, p_w = self.config.patch_size
        x = x.reshape(b, f, h, w, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    # -- the reference's control flow (benchmark strategy and equality oracle) -------------------
    def naive_step(self, hidden_states, timestep, encoder_hidden_states, kv_cache, crossattn_cache,
                   current_start: int, sink_tokens: int = 0) -> torch.Tensor:
        """One forward the way the reference runs it (dict caches, `.item()` reads, cache
        slicing by tensor-derived ends, `grid_sizes.tolist()` RoPE); see naive.py."""
        return naive.naive_step(self, hidden_states, timestep, encoder_hidden_states, kv_cache, crossattn_cache,
                                current_start, sink_tokens)
