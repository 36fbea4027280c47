"""`BagelPipeline`: the native object the BAGEL adapter builds. Understanding (image +
question -> text, greedy) and text-to-image (rectified flow with 3-context CFG)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .flow import euler_sample, flow_timesteps
from .model import Bagel, KVContext
from .packing import grid_position_ids, image_to_tensor, patchify, unpatchify


class BagelPipeline:
    """Holds the Bagel module, the FLUX VAE (diffusers AutoencoderKL) and the tokenizer.

    `pipe(prompt=...)` generates an image; `pipe(prompt=..., image=PIL)` answers a question
    about the image."""

    def __init__(self, model: Bagel, vae: nn.Module, tokenizer_factory, config: dict[str, Any],
                 call_defaults: dict[str, Any]):
        self.model = model
        self.vae = vae
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer = None
        self.config = config
        self.call_defaults = dict(call_defaults)
        self.special_ids = dict(config["special_ids"])

    # The tokenizer is built on first use: benchmarks that only run the denoiser skip it.
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_factory()
            got = {t: self._tokenizer.convert_tokens_to_ids(t) for t in self.special_ids}
            if got != self.special_ids:
                raise ValueError(f"tokenizer special ids {got} differ from the expected {self.special_ids}")
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        return self.model.vae2llm.weight.device

    def _sid(self, name: str) -> int:
        return self.special_ids[f"<|{name}|>"]

    def text_ids(self, text: str) -> torch.Tensor:
        """[<|im_start|>] + encode(text) + [<|im_end|>] (no chat template, as BAGEL)."""
        ids = [self._sid("im_start")] + self.tokenizer.encode(text, add_special_tokens=False) + [self._sid("im_end")]
        return torch.tensor(ids, device=self.device)

    # -- understanding ------------------------------------------------------------------------
    def vit_tokens(self, image) -> torch.Tensor:
        """A PIL image -> LLM-width ViT tokens (resized by the VAE rule, then the ViT rule)."""
        from PIL import Image

        vae_t = image_to_tensor(image, **self.config["vae_image"])
        img = Image.fromarray(((vae_t.permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255).byte().numpy())
        x = image_to_tensor(img, **self.config["vit_image"]).to(self.device)
        p = self.model.vit_model.config.patch_size
        h, w = x.shape[1] // p, x.shape[2] // p
        patches = patchify(x, p)
        pos = grid_position_ids(h, w, self.model.vit_max_num_patch_per_side, device=self.device)
        cu = torch.tensor([0, patches.shape[0]], device=self.device, dtype=torch.int32)
        return self.model.embed_vit(patches, pos, cu)

    @torch.no_grad()
    def understand(self, image, question: str, max_new_tokens: int = 512) -> str:
        """Greedy answer: prefill [ViT block] @0 and the question, then decode from
        <|im_start|> until <|im_end|> or max_new_tokens steps (the start token counts)."""
        m = self.model
        ctx = m.empty_context()
        if image is not None:
            ctx = m.prefill_image_block(ctx, self.vit_tokens(image), self._sid("vision_start"), self._sid("vision_end"))
        ctx = m.prefill_text(ctx, self.text_ids(question))
        out = self.generate_tokens(ctx, max_new_tokens)
        return self.tokenizer.decode(out, skip_special_tokens=True)

    @torch.no_grad()
    def generate_tokens(self, ctx: KVContext, max_new_tokens: int) -> list[int]:
        """Greedy token ids after feeding <|im_start|> at the context's rope position."""
        token = torch.tensor([self._sid("im_start")], device=self.device)
        pos = torch.tensor([ctx.rope], device=self.device)
        keys, values = ctx.keys, ctx.values
        out: list[int] = []
        for _ in range(max(0, max_new_tokens - 1)):
            logits, keys, values = self.model.decode_step(token, pos, keys, values)
            nxt = int(logits.argmax())
            if nxt == self._sid("im_end"):
                break
            out.append(nxt)
            token = torch.tensor([nxt], device=self.device)
            pos = pos + 1
        return out

    # -- text-to-image ------------------------------------------------------------------------
    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        down = 8 * self.model.latent_patch_size  # VAE 8x, then 2x2 latent patches
        if height % down or width % down:
            raise ValueError(f"height and width must be multiples of {down} (got {height}x{width})")
        return height // down, width // down

    def t2i_contexts(self, prompt: str) -> tuple[KVContext, KVContext, KVContext]:
        """(full, no_text, no_image). Text-to-image: no_text is the empty context (snapshot
        before the prompt), no_image equals full (only text inputs)."""
        empty = self.model.empty_context()
        full = self.model.prefill_text(empty, self.text_ids(prompt))
        return full, empty.copy(), full.copy()

    @torch.no_grad()
    def generate_image(self, prompt: str, *, height: int, width: int, num_inference_steps: int,
                       timestep_shift: float, cfg_text_scale: float, cfg_img_scale: float, cfg_interval,
                       cfg_renorm_type: str, cfg_renorm_min: float, seed: int | None = None,
                       progress: bool = False, output_type: str = "pil"):
        """Rectified-flow sampling with 3-context CFG; returns a PIL image (or a [3, H, W]
        tensor in [0, 1] with output_type='pt')."""
        m = self.model
        h, w = self.latent_grid(height, width)
        full, no_text, no_image = self.t2i_contexts(prompt)
        g = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
        p2c = m.latent_patch_size ** 2 * m.latent_channels
        x = torch.randn(h * w, p2c, generator=g).to(self.device)  # fp32 noise drawn on the host, as upstream
        pos_ids = grid_position_ids(h, w, m.max_latent_size, device=self.device)
        markers = torch.tensor([self._sid("vision_start"), self._sid("vision_end")], device=self.device)
        cfg = dict(cfg_text_scale=cfg_text_scale, cfg_img_scale=cfg_img_scale, cfg_interval=tuple(cfg_interval),
                   cfg_renorm_type=cfg_renorm_type, cfg_renorm_min=cfg_renorm_min)

        def velocity(xt, t):
            return m(xt, t, pos_ids, markers, full, no_text, no_image, **cfg)

        x = euler_sample(x, flow_timesteps(num_inference_steps, timestep_shift), velocity, progress=progress)
        return self.decode_latents(x, h, w, output_type)

    def decode_latents(self, tokens: torch.Tensor, h: int, w: int, output_type: str = "pil"):
        """64-d latent tokens -> image through the FLUX VAE (un-scale, un-shift, decode)."""
        m, vae = self.model, self.vae
        z = unpatchify(tokens, h, w, m.latent_patch_size, m.latent_channels)[None]
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        img = vae.decode(z.to(next(vae.parameters()).dtype)).sample[0].float()
        img = ((img * 0.5 + 0.5).clamp(0, 1))
        if output_type == "pt":
            return img
        from PIL import Image

        return Image.fromarray((img * 255).round().byte().permute(1, 2, 0).cpu().numpy())

    def __call__(self, prompt: str, image=None, **kwargs):
        """Text-to-image when `image` is None, else image understanding (returns text)."""
        call = dict(self.call_defaults)
        call.update({k: v for k, v in kwargs.items() if v is not None})
        if image is not None:
            return self.understand(image, prompt, max_new_tokens=call["max_new_tokens"])
        call.pop("max_new_tokens", None)
        return self.generate_image(prompt, **call)
