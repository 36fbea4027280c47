"""Shared adapter logic for families that are a diffusers pipeline (Wan, Wan2.2, Flux):
loading a local directory or hub id, naming components, the denoiser entry point, and
generation for `magi-zoo run`."""

from __future__ import annotations

import inspect
import os
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn as nn
from packaging.version import Version

from ..engine import Preparation, cfg_parallel_active
from . import fp8_checkpoint
from .images import open_image
from .latents_check import guard_latents
from .base import Adapter, Output, Variant

try:  # a corrupt safetensors file raises safetensors' own error type (releases without it raise OSError)
    from safetensors import SafetensorError
except ImportError:  # pragma: no cover
    SafetensorError = None


def LOAD_ERRORS() -> tuple[type[BaseException], ...]:
    """What a library's loader raises for unreadable or missing weights (a corrupt
    safetensors file raises safetensors' own error type)."""
    if SafetensorError is None:  # pragma: no cover
        return (OSError, ValueError, RuntimeError)
    return (OSError, ValueError, RuntimeError, SafetensorError)


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def weights_error(variant: Variant, source: str, local: bool, e: BaseException) -> ValueError:
    """One error for weights that cannot be loaded, in every family's `load_pretrained`:
    it says what to pass instead (a library's own advice, e.g. `local_files_only=False`,
    names arguments our API does not have, so it is not repeated; `--debug` shows it)."""
    instead = ("Pass weights='random' (CLI: --weights random; the published config with random "
               "weights, no download) or a local directory saved by save_pretrained (--weights DIR)")
    if local:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(". ")
        return ValueError(f"{variant.name}: cannot load the weights in directory {source!r}: {first}. {instead}")
    why = ("offline (HF_HUB_OFFLINE is set) and not in the local hub cache" if _offline()
           else "not in the local hub cache and not downloadable (no network, or no such hub id)")
    if not os.path.exists(os.path.expanduser(source)):  # `org/name` reads as a hub id and as a relative path
        why += f", and there is no local directory {source!r} either"
    return ValueError(f"{variant.name}: the weights {source!r} are {why}. {instead}")


def read_rgb(path: str | os.PathLike):
    """An input image file as an RGB PIL image, read whole (the file may change after)."""
    return open_image(path).convert("RGB")


class DiffusersPipelineAdapter(Adapter):
    """An `Adapter` over a diffusers pipeline. Subclasses set `component_names`,
    `output_kind` and implement `build_random` and `denoiser_inputs`. A family whose pipeline
    takes a conditioning image lists "image" in `run_options`: `generate` hands the pipeline
    `image=` as an RGB PIL image (a path is read here, after `check_inputs` checked it)."""

    component_names: ClassVar[tuple[str, ...]]  # pipeline attributes the spec keys refer to
    fp32_components: ClassVar[tuple[str, ...]] = ()  # kept in fp32 after from_pretrained
    output_kind: ClassVar[str]  # "video" or "image"
    fps: ClassVar[int | None] = None  # video frame rate written by `magi-zoo run`
    entry_points = ("denoise",)
    run_options = ("num_inference_steps", "height", "width", "seed")
    # The call argument whose value > `cfg_threshold` turns classifier-free guidance on (two
    # denoiser forwards per step: what CFG parallel splits over two processes); None = the
    # pipeline runs no CFG. The threshold is the pipeline's own: 1 for most (guidance 1 is the
    # conditional prediction alone), 0 for ZImagePipeline (`guidance_scale > 0`).
    cfg_option: ClassVar[str | None] = None
    cfg_threshold: ClassVar[float] = 1.0
    # True CFG that also needs a negative prompt (FluxPipeline, QwenImagePipeline: the uncond
    # forward runs only when `negative_prompt` is given as well as `cfg_option` > 1).
    cfg_needs_negative_prompt: ClassVar[bool] = False
    # Guidance held by a pipeline component, not a call argument (HunyuanVideo-1.5's guider): the
    # variant config's key for its scale; CFG runs where that is > 1.
    cfg_config_key: ClassVar[str | None] = None
    # (tokenizer attribute, the call argument capping its tokens) for each text encoder whose
    # pipeline reads `tokenizer(prompt, max_length=<argument>, truncation=True)`: diffusers drops
    # what is past the cap without a word (Wan's UMT5, LTX-2's Gemma), so `prompt_truncation`
    # counts the tokens itself. Encoders that wrap the prompt in a chat template are not listed:
    # the template's tokens would make the count a guess.
    prompt_caps: ClassVar[tuple[tuple[str, str], ...]] = ()

    def prompt_truncation(self, native: Any, prompt: str, call: dict[str, Any]) -> dict[str, int]:
        out: dict[str, int] = {}
        for attr, option in self.prompt_caps:
            tokenizer = getattr(native, attr, None)
            limit = call.get(option)
            if limit is None:  # the pipeline's own default for the argument
                param = inspect.signature(type(native).__call__).parameters.get(option)
                limit = None if param is None else param.default
            if tokenizer is None or not isinstance(limit, int):
                continue
            # whitespace collapsed as the pipelines' prompt cleaning does before tokenizing
            if len(tokenizer(" ".join(prompt.split()), add_special_tokens=True).input_ids) > limit:
                encoder = getattr(native, attr.replace("tokenizer", "text_encoder"), None)
                out[type(encoder).__name__ if encoder is not None else attr] = limit
        return out

    def runs_cfg(self, call: dict[str, Any], variant: Variant | None = None) -> bool:
        """Whether a pipeline call with these arguments runs classifier-free guidance (`variant`:
        the variant called, for a family where only some variants' pipelines run it)."""
        if self.cfg_config_key is not None:
            return variant is not None and float(variant.config.get(self.cfg_config_key) or 0.0) > 1.0
        if self.cfg_needs_negative_prompt and call.get("negative_prompt") is None:
            return False
        return self.cfg_option is not None and not self.cfg_scale_off(call)

    def cfg_scale_off(self, call: dict[str, Any]) -> bool:
        """Whether this call's `cfg_option` is at or below `cfg_threshold` (left out, it counts as
        0): the setting that turns guidance off, which the errors about guidance name."""
        return self.cfg_option is not None and float(call.get(self.cfg_option) or 0.0) <= self.cfg_threshold

    def check_given(self, variant: Variant, given: dict[str, Any], call: dict[str, Any], *,
                    name=lambda k: k) -> None:
        """The guidance arguments a pipeline would drop without a word: a negative prompt in a
        call that runs no classifier-free guidance (diffusers builds the unconditional branch
        only when guidance is on), and a true-CFG scale without the negative prompt it needs
        (FluxPipeline / QwenImagePipeline only log a warning). Checked where the family says
        when its pipeline runs CFG (`cfg_option` or `cfg_config_key`); the base's image checks first."""
        super().check_given(variant, given, call, name=name)
        if self.cfg_option is None and self.cfg_config_key is None:
            return
        opt, thr = self.cfg_option, self.cfg_threshold
        low = self.cfg_scale_off(call)
        if given.get("negative_prompt") is not None and not self.runs_cfg(call, variant):
            has = (f"has {opt}={call[opt]!r}" if call.get(opt) is not None
                   else f"leaves {opt} at the pipeline's default")
            why = (f"guidance runs at {opt} > {thr:g}, and this call {has}" if low
                   else f"{variant.name} runs no classifier-free guidance")
            fix = f"raise {name(opt)} above {thr:g}, or drop it" if low else "drop it"
            raise ValueError(f"{name('negative_prompt')} would be ignored: {why}; {fix}")
        if (self.cfg_needs_negative_prompt and opt in given and not low and call.get("negative_prompt") is None):
            family = type(self).__name__.removesuffix("Adapter")
            raise ValueError(f"{name(opt)}={given[opt]!r} would be ignored: {family}'s true classifier-free "
                             f"guidance runs only with a negative prompt; pass "
                             f"{name('negative_prompt')}, or drop {name(opt)}")

    def load_pretrained(self, variant: Variant, source: str, local: bool, dtype: torch.dtype,
                        device: torch.device):
        import diffusers  # lazy: diffusers costs seconds; the registry imports the families that use this class
        from diffusers import DiffusionPipeline  # lazy: as above

        # diffusers >= 0.42 takes `dtype=` and warns (FutureWarning) on `torch_dtype=`.
        dtype_kw = "dtype" if Version(diffusers.__version__).release >= (0, 42) else "torch_dtype"
        # A path loads strictly offline; anything else is a hub id, fetched by diffusers. An fp8
        # checkpoint's quantized components are read first, as Fp8Linear (no bf16 copy), and handed in.
        given = fp8_checkpoint.components_from(source, torch.device("cpu")) if local else {}
        try:
            pipe = DiffusionPipeline.from_pretrained(source, local_files_only=local, **{dtype_kw: dtype}, **given)
            if given:  # (model_index.json lists them as null: set them as the pipeline's modules)
                pipe.register_modules(**given)
        except LOAD_ERRORS() as e:
            raise weights_error(variant, source, local, e) from e
        for name in self.fp32_components:
            getattr(pipe, name).to(torch.float32)
        return pipe.to(device)

    def finish(self, pipe) -> None:
        super().finish(pipe)
        pipe.set_progress_bar_config(disable=True)
        guard_latents(pipe)

    def components(self, pipe) -> dict[str, nn.Module]:
        return {n: getattr(pipe, n) for n in self.component_names if isinstance(getattr(pipe, n, None), nn.Module)}

    # -- entry point: one denoiser forward --------------------------------------------------
    def denoiser(self, pipe) -> nn.Module:
        """The module that runs once per denoising step (benchmarks time one forward of it)."""
        return pipe.transformer

    def denoiser_inputs(self, pipe, variant: Variant, *, height=None, width=None, frames=None,
                        batch: int = 1, seed: int = 0) -> dict[str, Any]:
        raise NotImplementedError

    def entry(self, pipe, name: str) -> tuple[nn.Module, str]:
        self.check_entry(name)
        return self.denoiser(pipe), "forward"

    def example_inputs(self, pipe, variant: Variant, entry: str, **shape) -> dict[str, Any]:
        self.check_entry(entry)
        return self.denoiser_inputs(pipe, variant, **shape)

    # -- `magi-zoo run` ---------------------------------------------------------------------
    def generate(self, handle, *, prompt: str, progress: bool = True, **options) -> Output:
        seed = options.pop("seed", None)
        if isinstance(options.get("image"), (str, os.PathLike)):  # `--image FILE`, checked by check_inputs
            options["image"] = read_rgb(options["image"])
        if seed is not None:
            options["generator"] = torch.Generator(device="cpu").manual_seed(int(seed))
        call = {**handle.call_defaults(), **options}
        self.check_shape(handle.pipe, call)
        if cfg_parallel_active(handle.plan) and not self.runs_cfg(call, handle.variant):
            off = self.cfg_scale_off(call)
            why = f"{self.cfg_option} <= {self.cfg_threshold:g}" if off else "not with these settings"
            raise ValueError(f"cfg parallel splits classifier-free guidance, which this call of {handle.variant.name} "
                             f"does not run ({why}); drop cfg parallel (--no-cfg-parallel)")
        handle.pipe.set_progress_bar_config(disable=not progress)
        if self.output_kind == "video":
            return Output("video", np.asarray(handle(prompt=prompt, output_type="np", **options).frames[0]),
                          fps=handle.variant.config.get("fps", self.fps))
        return Output("image", handle(prompt=prompt, output_type="pil", **options).images[0])

    def check_shape(self, pipe, call: dict[str, Any]) -> None:
        """Raise a clear error for a resolution the pipeline cannot make (before any work)."""

    # -- packed-latent image families (FLUX.2, Qwen-Image): one token per 2x2 latent patch ------
    def check_packed_shape(self, pipe, call: dict[str, Any], label: str) -> None:
        """`check_shape` for a packed-latent image pipeline: height and width divide by the VAE's
        downsampling times the 2x2 patch (16 for the published VAEs)."""
        f = pipe.vae_scale_factor * 2
        if call["height"] % f or call["width"] % f:
            raise ValueError(f"{label} needs height and width divisible by {f} (VAE x{pipe.vae_scale_factor} "
                             f"times 2x2 patches); got {call['height']}x{call['width']}")

    def packed_grid(self, pipe, variant: Variant, height, width, frames, seed: int):
        """(token rows, token columns, rnd) for a packed-latent image denoiser's example inputs:
        the call defaults fill what is not given, `check_shape` checks the size, and `rnd(*shape)`
        draws seeded random tensors on the denoiser's device in its dtype."""
        if frames not in (None, 1):
            raise ValueError(f"{variant.name} makes images; frames={frames} has no meaning")
        d = variant.call_defaults
        height, width = height or d["height"], width or d["width"]
        self.check_shape(pipe, {"height": height, "width": width})
        p = next(pipe.transformer.parameters())
        g = torch.Generator(device="cpu").manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(device=p.device, dtype=p.dtype)  # noqa: E731
        f = pipe.vae_scale_factor * 2
        return height // f, width // f, rnd



def same_layout_preparation(blocks: nn.ModuleList, inputs: tuple[int | str, ...], what: str) -> Preparation:
    """Hand the FIRST of a model's repeated blocks its `inputs` (positions or keyword names) as
    fresh contiguous tensors, as every later block receives them (each block's output is a new
    tensor). A model whose prologue ends in a view (a patch embedding's `flatten(2).transpose(1,
    2)`) otherwise gives block 0 a strided view: a compiled block class guards on its strides
    (with symbolic shapes, on the view's base) and compiles twice. The copy is one hidden state
    per forward; values are unchanged bit for bit."""
    fresh = lambda x: x.clone(memory_format=torch.contiguous_format) if torch.is_tensor(x) else x  # noqa: E731

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        args = tuple(fresh(a) if i in inputs else a for i, a in enumerate(args))
        return args, {k: fresh(v) if k in inputs else v for k, v in kwargs.items()}

    def install(root: nn.Module):
        return blocks[0].register_forward_pre_hook(hook, with_kwargs=True).remove if len(blocks) else (lambda: None)

    return Preparation("same block layout", f"{what} block 0 gets its inputs {list(inputs)} as fresh contiguous "
                       "tensors, like blocks 1..N-1 (one compile per block class instead of two)", install)
