"""The BAGEL adapter: variants, build (random / official checkpoint dir / hub id),
components, denoiser and `run` for the CLI."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ...engine import progress_stage
from .._tokenizers import byte_bpe_tokenizer
from ..base import FLAGS, Adapter, CallLimits, Output, Variant, init_on
from ..diffusers_pipeline import LOAD_ERRORS, weights_error
from .checkpoint import load_bagel_checkpoint, save_bagel_checkpoint
from .config import BAGEL_7B_MOT, EDIT_DEFAULTS, T2I_DEFAULTS, TINY, config_from_dir

VARIANTS = {
    v.name: v
    for v in [
        Variant(name="bagel-7b-mot", family="bagel", config=BAGEL_7B_MOT, hub_id="ByteDance-Seed/BAGEL-7B-MoT",
                description="BAGEL-7B-MoT: Qwen2.5-7B MoT (28 layers, 3584) + SigLIP so400m (26 layers) + FLUX AE",
                call_defaults=dict(T2I_DEFAULTS, edit=dict(EDIT_DEFAULTS))),
        Variant(name="bagel-tiny", family="bagel", config=TINY, tiny=True,
                description="3 MoT layers, width 64; 2 ViT layers; small FLUX-style AE; random, offline",
                call_defaults=dict(T2I_DEFAULTS, num_inference_steps=3, height=64, width=64, max_new_tokens=8,
                                   max_think_tokens=8, edit=dict(EDIT_DEFAULTS, num_inference_steps=3))),
    ]
}


def build_modules(cfg: dict[str, Any], dtype: torch.dtype, device: torch.device):
    """Bagel module + FLUX AE at `cfg`, created directly on device/dtype (random init)."""
    # lazy: diffusers and transformers cost seconds; the registry imports this module to list models
    from diffusers import AutoencoderKL
    from transformers import Qwen2Config, SiglipVisionConfig  # lazy: as above

    from .model import Bagel  # lazy: its modules are transformers' (seconds to import)

    llm_cfg = Qwen2Config(**cfg["llm"])
    vit_cfg = SiglipVisionConfig(**cfg["vit"])
    with init_on(device, dtype):
        model = Bagel(llm_cfg, vit_cfg, latent_patch_size=cfg["latent_patch_size"],
                      max_latent_size=cfg["max_latent_size"],
                      vit_max_num_patch_per_side=cfg["vit_max_num_patch_per_side"],
                      latent_channels=cfg["vae"]["latent_channels"])
        vae = AutoencoderKL(**cfg["vae"])
    return model.eval().requires_grad_(False), vae.eval().requires_grad_(False)


def _tokenizer_factory(cfg: dict[str, Any], local_dir: Path | None):
    def make():
        if local_dir is not None and (local_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer  # lazy: transformers costs seconds

            return AutoTokenizer.from_pretrained(str(local_dir), local_files_only=True)
        # In-process byte BPE with the Qwen-style specials pinned at the model's ids.
        return byte_bpe_tokenizer(vocab_size=cfg["tokenizer_vocab"], specials=[], eos="<|im_end|>",
                                  bos="<|im_start|>", extra_ids=cfg["special_ids"])
    return make


class BagelAdapter(Adapter):
    family = "bagel"
    spec_file = "bagel.toml"
    variants = VARIANTS
    aliases = {"bagel": "bagel-7b-mot", "bagel-7b": "bagel-7b-mot"}
    entry_points = ("denoise",)
    run_options = ("image", "task", "think", "num_inference_steps", "height", "width", "seed", "max_new_tokens")
    image_kinds = ("PIL", "path")  # its pipeline reads a PIL image or opens a file
    prompt_lists = False  # one conversation per call

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        return self._pipeline(variant, dict(variant.config), None, dtype, device)

    def load_pretrained(self, variant: Variant, source: str, local: bool, dtype: torch.dtype,
                        device: torch.device):
        """A directory in the official layout, or a hub id fetched into the hub cache first."""
        if local:
            path = Path(source)
        else:
            from huggingface_hub import snapshot_download  # lazy: huggingface_hub costs ~0.1 s; hub ids only

            try:
                path = Path(snapshot_download(source))
            except LOAD_ERRORS() as e:  # offline, not cached, or no such id
                raise weights_error(variant, source, local, e) from e
        return self._pipeline(variant, config_from_dir(path, dict(variant.config)), path, dtype, device)

    def _pipeline(self, variant: Variant, cfg: dict[str, Any], local: Path | None, dtype: torch.dtype,
                  device: torch.device):
        from .pipeline import BagelPipeline  # lazy: it imports the model, built on transformers (seconds)

        model, vae = build_modules(cfg, dtype, device)
        if local is not None:
            load_bagel_checkpoint(model, vae, local)
        return BagelPipeline(model, vae, _tokenizer_factory(cfg, local), cfg, variant.call_defaults)

    def save_pretrained(self, pipe, path: str | Path) -> Path:
        """The official layout (llm_config.json, vit_config.json, ema.safetensors,
        ae.safetensors) plus the tokenizer files, which `build(weights=path)` loads back."""
        path = save_bagel_checkpoint(pipe.model, pipe.vae, pipe.config, path)
        pipe.tokenizer.save_pretrained(str(path))
        return path

    def call_defaults(self, variant: Variant) -> dict[str, Any]:
        return {}  # BagelPipeline applies the variant's defaults itself, per task

    def components(self, pipe) -> dict[str, nn.Module]:
        return {"model": pipe.model, "vae": pipe.vae}

    def denoiser(self, pipe) -> nn.Module:
        """`Bagel.forward` is one guided denoising step (up to three `denoise_step` calls)."""
        return pipe.model

    def entry(self, pipe, name: str) -> tuple[nn.Module, str]:
        self.check_entry(name)
        return pipe.model, "forward"

    def example_inputs(self, pipe, variant: Variant, entry: str, **shape) -> dict[str, Any]:
        self.check_entry(entry)
        return self.denoiser_inputs(pipe, variant, **shape)

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0, text_len: int = 32, cfg_img_scale: float = 1.5) -> dict[str, Any]:
        """One text-to-image step with CFG over three contexts: full (a `text_len`-token
        prompt), no-text (empty) and no-image (= full for text-to-image). cfg_img_scale 1.5
        (the inferencer's default) makes all three branches run; t = 0.9 is inside the
        interval. K/V caches are random at the right shapes."""
        if frames is not None or batch != 1:
            raise ValueError("BAGEL generates one image per call: frames must be None and batch 1")
        d = variant.call_defaults
        m = pipe.model
        h, w = pipe.latent_grid(height or d["height"], width or d["width"])
        g = torch.Generator(device="cpu").manual_seed(seed)
        p = m.vae2llm.weight
        cfg = m.language_model.config
        rnd = lambda *s: torch.randn(*s, generator=g).to(device=p.device, dtype=p.dtype)
        kv = lambda n: [rnd(n, cfg.num_key_value_heads, m.head_dim) for _ in m.layers]
        from .model import KVContext  # lazy: the model module imports transformers (seconds)

        full = KVContext(kv(text_len), kv(text_len), text_len)
        sid = pipe.special_ids
        return dict(
            x_t=torch.randn(h * w, m.latent_patch_size ** 2 * m.latent_channels, generator=g).to(p.device),
            t=0.9, latent_pos_ids=torch.arange(h * w, device=p.device) % (m.max_latent_size ** 2),
            marker_ids=torch.tensor([sid["<|vision_start|>"], sid["<|vision_end|>"]], device=p.device),
            full=full, no_text=m.empty_context(), no_image=full.copy(),
            cfg_text_scale=d["cfg_text_scale"], cfg_img_scale=cfg_img_scale, cfg_interval=d["cfg_interval"],
            cfg_renorm_type=d["cfg_renorm_type"], cfg_renorm_min=d["cfg_renorm_min"])

    @staticmethod
    def task_of(given: dict[str, Any]) -> str:
        """The task of `magi-zoo run` options: --task if given, else edit with --image and
        generate without (the official demo's two image tasks)."""
        return given.get("task") or ("edit" if given.get("image") is not None else "generate")

    def out_suffixes(self, variant: Variant, given: dict[str, Any]) -> tuple[str, ...]:
        return (".txt",) if self.task_of(given) == "understand" else (".png", ".jpg", ".jpeg", ".webp")

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """The answer's and the reasoning's token budgets at most the language model's position
        table (`max_position_embeddings`): a reply cannot run past it. BAGEL's sampler steps in
        continuous time (`flow.flow_timesteps`), with no scheduler grid to cap its steps."""
        n = variant.config["llm"]["max_position_embeddings"]
        why = f"its language model holds {n:,} positions"
        return {"max_new_tokens": (n, why), "max_think_tokens": (n, why)}

    def call_limits(self, variant: Variant) -> CallLimits:
        """From the config: pixels divide by the VAE's downsampling times `latent_patch_size`;
        at most `max_latent_size` patches per side (the rows of `latent_pos_embed`)."""
        cfg = variant.config
        down, p, n = 2 ** (len(cfg["vae"]["block_out_channels"]) - 1), cfg["latent_patch_size"], cfg["max_latent_size"]
        return CallLimits(pixel_multiple=down * p, why_multiple=f"VAE {down}x down x {p}x{p} latent patches",
                          max_grid=n, why_grid=f"its latent position embedding has {n} positions per side",
                          output_types=("pil", "pt"))  # pipeline.decode_latents: a tensor, else PIL

    def check_run(self, variant: Variant, options: dict[str, Any], out: Path | None = None) -> dict[str, Any]:
        """Beyond the base checks: --task is one of generate / edit / understand and fits
        --image; sizes and steps only where an image is sampled (an edit keeps the input's
        size); --max-new-tokens where text is written (an answer, or the reasoning of --think)."""
        from .pipeline import TASKS  # lazy: it imports the model, built on transformers (seconds)

        task = options.get("task")
        if task is not None and task not in TASKS:
            near = difflib.get_close_matches(str(task), TASKS, n=1)
            raise ValueError(f"--task {task!r}: choose one of {', '.join(TASKS)}"
                             + (f" (did you mean {near[0]!r}?)" if near else ""))
        given = super().check_run(variant, options, out)
        task = self.task_of(given)
        flags = lambda keys: ", ".join(FLAGS.get(k, "--" + k.replace("_", "-")) for k in keys)  # noqa: E731
        if task == "edit" and given.get("image") is None:
            raise ValueError(f"{variant.name}: --task edit needs --image (the image to edit)")
        if task == "generate" and given.get("image") is not None:
            raise ValueError(f"{variant.name}: --task generate takes no --image; drop --task to edit the image, "
                             "or pass --task understand to ask about it")
        allowed = {"generate": {"num_inference_steps", "height", "width", "seed"},
                   "edit": {"image", "num_inference_steps", "seed"},
                   "understand": {"image", "max_new_tokens"}}[task] | {"task", "think"}
        if given.get("think") and task != "understand":
            allowed |= {"max_new_tokens"}  # the reasoning's token budget
        bad = sorted(set(given) - allowed)
        if bad:
            hint = {"max_new_tokens": " (--max-new-tokens applies to --task understand, or to the reasoning "
                                      "with --think)",
                    "height": " (an edit keeps the input image's size)",
                    "width": " (an edit keeps the input image's size)"}
            verb = "does" if len(bad) == 1 else "do"
            raise ValueError(f"{variant.name}: {flags(bad)} {verb} not apply to --task {task}"
                             + "".join(dict.fromkeys(hint.get(b, "") for b in bad)))
        return given

    def generate(self, handle, *, prompt: str, progress: bool = True, **options) -> Output:
        """Text-to-image, editing (image: a path or PIL image) or understanding (text out);
        think: the model reasons first (the reasoning is printed with the image)."""
        from .pipeline import ThinkingOutput  # lazy: it imports the model, built on transformers (seconds)

        task = self.task_of(options)
        options.pop("task", None)
        think = bool(options.pop("think", False))
        image = options.pop("image", None)  # a path or a PIL image: the pipeline reads a path itself
        if task == "understand":  # no bar of its own: the heartbeat names the stage
            with progress_stage("understanding: the prompt" + (" and image" if image is not None else "")
                                + ", then the answer's tokens"):
                return Output("text", handle(prompt, image=image, task=task, think=think,
                                             max_new_tokens=options.get("max_new_tokens")))
        if options.get("max_new_tokens") is None:
            options.pop("max_new_tokens", None)  # with --think, a given value is the reasoning's budget
        result = handle(prompt, image=image, task=task, think=think, progress=progress, **options)
        if isinstance(result, ThinkingOutput):
            return Output("image", result.image, note="thinking: " + " ".join(result.text.split()))
        return Output("image", result)
