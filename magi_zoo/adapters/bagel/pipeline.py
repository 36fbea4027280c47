"""`BagelPipeline`: the native object the BAGEL adapter builds. Three tasks, as the official
inferencer: text-to-image ("generate"), image editing ("edit": the input image through the
VAE and the ViT) and understanding ("understand": image and/or question -> text, greedy),
each optionally in think mode (the model writes its reasoning before the answer or image).

Contexts follow the official interleave flow (`InterleaveInferencer.interleave_inference`):
  full     = [system prompt] + inputs in order (+ the reasoning, when thinking before an image)
  no_text  = full as it was before the last text input      (text guidance drops the prompt)
  no_image = [system prompt] + the text inputs only          (image guidance drops the image)
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import torch
import torch.nn as nn

from ..images import open_image
from .flow import euler_sample, flow_timesteps
from .model import Bagel, KVContext
from .packing import grid_position_ids, image_to_tensor, patchify, resize_image, to_rgb, to_uint8_image, unpatchify

# The official system prompts of think mode (inferencer.py), verbatim: the model was
# trained with them, so a paraphrase would change what it writes.
VLM_THINK_SYSTEM_PROMPT = (
    "You should first think about the reasoning process in the mind and then provide the user with the answer. \n"
    "The reasoning process is enclosed within <think> </think> tags, i.e. "
    "<think> reasoning process here </think> answer here")
GEN_THINK_SYSTEM_PROMPT = (
    "You should first think about the planning process in the mind and then generate the image. \n"
    "The planning process is enclosed within <think> </think> tags, i.e. "
    "<think> planning process here </think> image here")

TASKS = ("generate", "edit", "understand")


@dataclasses.dataclass
class ThinkingOutput:
    """What generate/edit return in think mode: the reasoning the model wrote (as the
    official inferencer returns it) and the image generated after it."""

    text: str
    image: Any


@dataclasses.dataclass
class Contexts:
    """The three CFG contexts of one request and the output size (editing: the input's)."""

    full: KVContext
    no_text: KVContext
    no_image: KVContext
    image_size: tuple[int, int] | None = None  # (height, width) of the last input image


def _is_pil(image) -> bool:
    from PIL import Image  # lazy: PIL costs ~15 ms; only image inputs need it

    return isinstance(image, Image.Image)


class BagelPipeline:
    """Holds the Bagel module, the FLUX VAE (diffusers AutoencoderKL) and the tokenizer.

    `pipe(prompt)` generates an image; `pipe(prompt, image=PIL)` edits the image;
    `pipe(prompt, image=PIL, task="understand")` answers a question about it; `think=True`
    lets the model reason first (see `__call__`)."""

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

    # -- inputs -------------------------------------------------------------------------------
    def input_image(self, image):
        """A PIL image as every task first reads it: RGB over white (`to_rgb`), then resized
        by the VAE-side rule (the official inferencer does this for every input image, also
        for understanding, before the ViT-side transform)."""
        return resize_image(to_rgb(image), **self.config["vae_image"])

    def vit_tokens(self, image) -> torch.Tensor:
        """A PIL image (already `input_image`d) -> LLM-width ViT tokens (ViT-side rule)."""
        x = image_to_tensor(image, **self.config["vit_image"]).to(self.device)
        p = self.model.vit_model.config.patch_size
        h, w = x.shape[1] // p, x.shape[2] // p
        patches = patchify(x, p)
        pos = grid_position_ids(h, w, self.model.vit_max_num_patch_per_side, device=self.device)
        cu = torch.tensor([0, patches.shape[0]], device=self.device, dtype=torch.int32)
        return self.model.embed_vit(patches, pos, cu)

    @torch.no_grad()
    def vae_tokens(self, image, generator: torch.Generator) -> tuple[torch.Tensor, int, int]:
        """A PIL image (already `input_image`d) -> (latent tokens [h*w, p*p*C], h, w): the
        FLUX encoder, a sample of its Gaussian (the official autoencoder samples; the
        generator makes it reproducible), scale and shift, then 2x2 patches."""
        m, vae = self.model, self.vae
        x = image_to_tensor(image, **self.config["vae_image"]).to(self.device)
        dist = vae.encode(x[None].to(next(vae.parameters()).dtype)).latent_dist
        z = dist.sample(generator=generator)[0].float()
        z = vae.config.scaling_factor * (z - vae.config.shift_factor)
        p = m.latent_patch_size
        h, w = z.shape[1] // p, z.shape[2] // p
        return patchify(z[:, :h * p, :w * p], p), h, w

    def _prefill_image(self, ctx: KVContext, image, vae: bool, generator: torch.Generator | None) -> KVContext:
        """Append an input image: its VAE latents first (editing), then its ViT tokens."""
        m = self.model
        if vae:
            tokens, h, w = self.vae_tokens(image, generator)
            pos = grid_position_ids(h, w, m.max_latent_size, device=self.device)
            ctx = m.prefill_vae_block(ctx, tokens, pos, self._markers())
        return m.prefill_image_block(ctx, self.vit_tokens(image), self._sid("vision_start"), self._sid("vision_end"))

    def _markers(self) -> torch.Tensor:
        return torch.tensor([self._sid("vision_start"), self._sid("vision_end")], device=self.device)

    @torch.no_grad()
    def contexts(self, inputs: list, *, system_prompt: str | None = None, vae: bool = True,
                 generator: torch.Generator | None = None) -> Contexts:
        """Prefill `inputs` (str and PIL images, in order) the way the official inferencer
        does: the system prompt goes into full and no_image; a text input snapshots full into
        no_text first and also extends no_image; an image input goes into full only (VAE
        latents when `vae`, then ViT tokens) and snapshots it into no_text."""
        m = self.model
        full = m.empty_context()
        no_text, no_image = full.copy(), full.copy()
        size = None
        if system_prompt is not None:
            full = m.prefill_text(full, self.text_ids(system_prompt))
            no_image = m.prefill_text(no_image, self.text_ids(system_prompt))
        for item in inputs:
            if isinstance(item, str):
                no_text = full.copy()
                full = m.prefill_text(full, self.text_ids(item))
                no_image = m.prefill_text(no_image, self.text_ids(item))
            else:
                item = self.input_image(item)
                full = self._prefill_image(full, item, vae, generator)
                size = (item.size[1], item.size[0])
                no_text = full.copy()
        return Contexts(full, no_text, no_image, size)

    # -- text out -------------------------------------------------------------------------------
    def reply_text(self, ids: list[int]) -> str:
        """Token ids after <|im_start|> -> text, as the official `gen_text`: decode with the
        special tokens, keep what lies between the first <|im_start|> and <|im_end|>."""
        text = self.tokenizer.decode([self._sid("im_start")] + list(ids), skip_special_tokens=False)
        return text.split("<|im_end|>")[0].split("<|im_start|>")[1]

    @torch.no_grad()
    def understand(self, image, question: str, max_new_tokens: int = 512, think: bool = False) -> str:
        """Greedy answer to `question` about `image` (None: text only). Prefill
        [system prompt if think], [ViT block] and the question, then decode from
        <|im_start|> until <|im_end|> or max_new_tokens tokens (the start token counts).
        In think mode the answer holds the reasoning in <think> </think> first."""
        inputs = ([] if image is None else [image]) + [question]
        ctx = self.contexts(inputs, system_prompt=VLM_THINK_SYSTEM_PROMPT if think else None, vae=False).full
        return self.reply_text(self.generate_tokens(ctx, max_new_tokens))

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

    # -- images out -----------------------------------------------------------------------------
    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        down = 8 * self.model.latent_patch_size  # VAE 8x, then 2x2 latent patches
        if height % down or width % down:
            raise ValueError(f"height and width must be multiples of {down} (got {height}x{width})")
        return height // down, width // down

    def t2i_contexts(self, prompt: str) -> tuple[KVContext, KVContext, KVContext]:
        """(full, no_text, no_image). Text-to-image: no_text is the empty context (snapshot
        before the prompt), no_image equals full (only text inputs)."""
        c = self.contexts([prompt])
        return c.full, c.no_text, c.no_image

    @torch.no_grad()
    def generate_image(self, prompt: str, *, height: int, width: int, num_inference_steps: int,
                       timestep_shift: float, cfg_text_scale: float, cfg_img_scale: float, cfg_interval,
                       cfg_renorm_type: str, cfg_renorm_min: float, seed: int | None = None,
                       progress: bool = False, output_type: str = "pil", think: bool = False,
                       max_think_tokens: int = 1024):
        """Text-to-image: rectified-flow sampling with 3-context CFG; returns a PIL image (or
        a [3, H, W] tensor in [0, 1] with output_type='pt'); in think mode a ThinkingOutput."""
        c = self.contexts([prompt], system_prompt=GEN_THINK_SYSTEM_PROMPT if think else None)
        return self._image_from(c, height, width, seed, think, max_think_tokens, progress, output_type,
                                num_inference_steps=num_inference_steps, timestep_shift=timestep_shift,
                                cfg_text_scale=cfg_text_scale, cfg_img_scale=cfg_img_scale,
                                cfg_interval=cfg_interval, cfg_renorm_type=cfg_renorm_type,
                                cfg_renorm_min=cfg_renorm_min)

    @torch.no_grad()
    def edit_image(self, image, prompt: str, *, num_inference_steps: int, timestep_shift: float,
                   cfg_text_scale: float, cfg_img_scale: float, cfg_interval, cfg_renorm_type: str,
                   cfg_renorm_min: float, seed: int | None = None, progress: bool = False,
                   output_type: str = "pil", think: bool = False, max_think_tokens: int = 1024):
        """Image editing: the input image (VAE latents, then ViT tokens) and the instruction,
        then sampling at the input's VAE-side size. Guidance: text (no_text = the image
        alone) and image (no_image = the instruction alone)."""
        g = torch.Generator(device="cpu").manual_seed(0 if seed is None else seed)
        c = self.contexts([image, prompt], system_prompt=GEN_THINK_SYSTEM_PROMPT if think else None, generator=g)
        h, w = c.image_size
        return self._image_from(c, h, w, g, think, max_think_tokens, progress, output_type,
                                num_inference_steps=num_inference_steps, timestep_shift=timestep_shift,
                                cfg_text_scale=cfg_text_scale, cfg_img_scale=cfg_img_scale,
                                cfg_interval=cfg_interval, cfg_renorm_type=cfg_renorm_type,
                                cfg_renorm_min=cfg_renorm_min)

    def _image_from(self, c: Contexts, height: int, width: int, seed_or_gen, think: bool, max_think_tokens: int,
                    progress: bool, output_type: str, **sampling):
        thought = None
        if think:  # the plan goes into full only: guidance contrasts against the plan too
            thought = self.reply_text(self.generate_tokens(c.full, max_think_tokens))
            c.full = self.model.prefill_text(c.full, self.text_ids(thought))
        img = self.sample(c, height, width, seed_or_gen, progress=progress, output_type=output_type, **sampling)
        return ThinkingOutput(thought, img) if think else img

    @torch.no_grad()
    def sample(self, c: Contexts, height: int, width: int, seed_or_gen, *, num_inference_steps: int,
               timestep_shift: float, cfg_text_scale: float, cfg_img_scale: float, cfg_interval,
               cfg_renorm_type: str, cfg_renorm_min: float, progress: bool = False, output_type: str = "pil"):
        """Euler sampling of a height x width image against the three contexts."""
        m = self.model
        h, w = self.latent_grid(height, width)
        g = seed_or_gen if isinstance(seed_or_gen, torch.Generator) else \
            torch.Generator(device="cpu").manual_seed(0 if seed_or_gen is None else seed_or_gen)
        p2c = m.latent_patch_size ** 2 * m.latent_channels
        x = torch.randn(h * w, p2c, generator=g).to(self.device)  # fp32 noise drawn on the host, as upstream
        pos_ids = grid_position_ids(h, w, m.max_latent_size, device=self.device)
        markers = self._markers()
        cfg = dict(cfg_text_scale=cfg_text_scale, cfg_img_scale=cfg_img_scale, cfg_interval=tuple(cfg_interval),
                   cfg_renorm_type=cfg_renorm_type, cfg_renorm_min=cfg_renorm_min)

        def velocity(xt, t):
            return m(xt, t, pos_ids, markers, c.full, c.no_text, c.no_image, **cfg)

        x = euler_sample(x, flow_timesteps(num_inference_steps, timestep_shift), velocity, progress=progress)
        return self.decode_latents(x, h, w, output_type)

    def decode_latents(self, tokens: torch.Tensor, h: int, w: int, output_type: str = "pil"):
        """64-d latent tokens -> image through the FLUX VAE (un-scale, un-shift, decode);
        PIL pixels are truncated to uint8 as upstream."""
        m, vae = self.model, self.vae
        z = unpatchify(tokens, h, w, m.latent_patch_size, m.latent_channels)[None]
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        img = vae.decode(z.to(next(vae.parameters()).dtype)).sample[0].float()
        img = ((img * 0.5 + 0.5).clamp(0, 1))
        if output_type == "pt":
            return img
        return to_uint8_image(img)

    def __call__(self, prompt: str, image=None, *, task: str | None = None, think: bool = False, **kwargs):
        """One request. task: "generate" (text-to-image; the default without an image),
        "edit" (the default with an image) or "understand" (text answer; image optional).
        think=True: the model reasons first (generate/edit return a ThinkingOutput; an
        understanding answer holds the reasoning in <think> </think>)."""
        if isinstance(image, (str, os.PathLike)):
            image = open_image(image, "image")  # a path: a str item would otherwise be read as text
        elif image is not None and not _is_pil(image):
            raise TypeError(f"image: a PIL image or an image file's path, got {type(image).__name__}")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt: a string, got {type(prompt).__name__}")
        task = task or ("generate" if image is None else "edit")
        if task not in TASKS:
            near = difflib.get_close_matches(str(task), TASKS, n=1)
            raise ValueError(f"task {task!r}: choose one of {', '.join(TASKS)}"
                             + (f" (did you mean {near[0]!r}?)" if near else ""))
        if task == "edit" and image is None:
            raise ValueError("task 'edit' needs an input image (image=...)")
        if task == "generate" and image is not None:
            raise ValueError("task 'generate' takes no input image; use task='edit' or task='understand'")
        call = dict(self.call_defaults)
        edit_defaults = call.pop("edit", {})
        if task == "edit":
            call.update(edit_defaults)
            for k in ("height", "width"):
                if kwargs.get(k) is not None:
                    raise ValueError(f"{k}: an edit keeps the input image's size (after the VAE-side resize)")
                call.pop(k, None)
        given = {k: v for k, v in kwargs.items() if v is not None}
        if task == "understand":
            extra = sorted(set(given) - {"max_new_tokens"})
            if extra:
                raise ValueError(f"{', '.join(extra)}: task 'understand' samples no image; it takes max_new_tokens")
        elif "max_new_tokens" in given:
            if not think:
                raise ValueError("max_new_tokens applies to task='understand' or, with think=True, to the "
                                 "reasoning (also settable as max_think_tokens)")
            given["max_think_tokens"] = given.pop("max_new_tokens")
        call.update(given)
        if task == "understand":
            return self.understand(image, prompt, max_new_tokens=call["max_new_tokens"], think=think)
        call.pop("max_new_tokens", None)
        if task == "edit":
            return self.edit_image(image, prompt, think=think, **call)
        return self.generate_image(prompt, think=think, **call)
