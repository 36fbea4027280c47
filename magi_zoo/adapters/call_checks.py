"""The general rule a call's counts and sizes are checked by, before any work.

Every family says what its calls can make as a `CallLimits`, filled from its variant's
config (`Adapter.call_limits`); `check_call` applies the same rule to all of them:

- counts (steps, frames, sizes, token budgets) are positive integers (numpy's too); guidance
  scales are finite numbers >= 0; a seed is an integer a torch.Generator takes (0 to 2**64 - 1);
  a `generator` is a torch.Generator, or a list of them; a list of negative prompts has one
  per prompt; an `output_type` is one the family's pipeline returns (`CallLimits.output_types`,
  diffusers' four by default): the pipelines read it only after the last step, and then
  diffusers' image pipelines turned another value into numpy arrays with a deprecation
  warning, its video pipelines raised, BAGEL's returned a PIL image;
- a prompt is a string or a non-empty list of strings (a negative prompt likewise, empty
  strings allowed); `callback_on_step_end` is callable; the `*attention_kwargs` dicts are
  dicts; `return_dict` is a bool (diffusers reads its truth: "no" returned the object); a
  list of generators has one per output, and `latents` are a tensor (their shape is checked
  by the pipeline's own `prepare_latents`, `latents_check`);
- a custom schedule (`sigmas`, `timesteps`) is a non-empty list of finite numbers, and a
  `num_inference_steps` given beside it is its length (the pipelines take the schedule's
  length and drop the count without a word: `check_given_counts`);
- a count the family caps (`Adapter.count_caps`: the denoising steps at the scheduler's
  training timesteps, a token budget at the language model's position table) is at most its
  cap: past it a call would only fill the memory (a static KV cache sized by the budget, a
  sigma schedule of that length) or run without end, never make a better output;
- height and width divide by the pixels one token covers (the VAE's downsampling times the
  patch size), and a video's frame count is 1 + k times the VAE's temporal factor (the
  pipelines would otherwise round it, or fail deep inside a reshape);
- no axis has more patches than the model's position table holds (Wan's RoPE table,
  BAGEL's latent position embedding);
- the decoded output (float32 frames, times the outputs per prompt and the prompts of a list)
  fits the machine: the host's memory, and the card's when the call runs on one. It is a lower
  bound of what the call needs, so a refusal is never wrong; it turns an allocator's abort into
  a line that says how big the ask was.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Callable, Mapping

import torch

# Call arguments that count something: positive integers.
COUNTS = ("num_inference_steps", "num_frames", "height", "width", "max_new_tokens", "max_think_tokens",
          "talker_max_new_tokens", "max_sequence_length", "num_images_per_prompt", "num_videos_per_prompt")
# Guidance scales: a negative one has no meaning (0 / 1 turn guidance off, per pipeline).
SCALES = ("guidance_scale", "guidance_scale_2", "true_cfg_scale", "cfg_text_scale", "cfg_img_scale")
# What diffusers' pipelines return: their image processor's and video processor's kinds, and
# the latents themselves.
OUTPUT_TYPES = ("pil", "np", "pt", "latent")
# Dicts the pipelines hand to the attention processors (a non-dict failed at the first step).
MAPPINGS = ("attention_kwargs", "joint_attention_kwargs", "cross_attention_kwargs")
# A custom schedule the pipelines hand to the scheduler (a string in it failed inside numpy).
SCHEDULES = ("sigmas", "timesteps")
# Flags the pipelines read by truth value: a string or a number passed for one is a mistake.
FLAGS = ("return_dict",)
SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 64-bit seeds; a larger one overflows at generation


@dataclasses.dataclass(frozen=True)
class CallLimits:
    """What one variant's calls can make (each family fills it from its config)."""

    pixel_multiple: int = 1  # height and width divide by this: the VAE's downsampling x the patch size
    why_multiple: str = ""  # e.g. "VAE 8x down x 2x2 patches"
    max_grid: int | None = None  # patches per axis at most (the position table's length)
    why_grid: str = ""  # e.g. "its RoPE table has 32 positions per axis"
    frame_step: int | None = None  # video: num_frames = 1 + k * frame_step (the VAE's temporal factor)
    max_latent_frames: int | None = None  # latent frames at most (the position table, on the time axis)
    output_types: tuple[str, ...] = OUTPUT_TYPES  # the `output_type` values the pipeline returns


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _label(name: Callable[[str], str], key: str, value: Any) -> str:
    flag = name(key)
    return f"{flag} {value}" if flag.startswith("--") else f"{flag}={value!r}"


def _is_generator(g: Any) -> bool:
    return isinstance(g, torch.Generator)


def outputs_of(call: Mapping[str, Any]) -> int:
    """How many images or videos a call makes: its outputs per prompt times the prompts of a list."""
    prompts = call.get("prompt")
    n = len(prompts) if isinstance(prompts, (list, tuple)) and prompts else 1
    per = call.get("num_images_per_prompt") or call.get("num_videos_per_prompt") or 1
    return n * int(per)


def _check_prompts(call: Mapping[str, Any], name: Callable[[str], str], lists: bool = True) -> None:
    """A prompt is a string or (`lists`: the pipeline batches prompts) a non-empty list of
    strings; a negative prompt likewise, and may be an empty string.
    The tokenizers fail on anything else only after the pipeline starts (an empty list was an
    IndexError inside the tokenizer, a number in a list a TypeError inside the text cleaner)."""
    for k in ("prompt", "negative_prompt"):
        v = call.get(k)
        if v is None or isinstance(v, str):
            continue
        if not lists:
            raise TypeError(f"{name(k)} must be a string (one prompt per call), got {type(v).__name__}")
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{name(k)} must be a string or a list of strings, got {type(v).__name__}")
        if not v:
            raise ValueError(f"{name(k)} is an empty list: give at least one prompt")
        bad = next((x for x in v if not isinstance(x, str)), None)
        if bad is not None:
            raise TypeError(f"{name(k)}: every item must be a string, got {type(bad).__name__} ({bad!r})")


def check_given_counts(given: Mapping[str, Any], name: Callable[[str], str] = lambda k: k) -> None:
    """What the caller gave that contradicts itself: `num_inference_steps` beside a custom
    schedule of another length (diffusers' `retrieve_timesteps` sets the step count from the
    schedule and ignores the argument)."""
    steps = given.get("num_inference_steps")
    for k in SCHEDULES:
        v = given.get(k)
        if v is not None and steps is not None and hasattr(v, "__len__") and len(v) != steps:
            raise ValueError(f"{name('num_inference_steps')}={steps!r} but {name(k)} has {len(v)} entries; the "
                             f"pipeline runs one step per entry: drop {name('num_inference_steps')} or make them agree")


def check_call(variant: str, call: Mapping[str, Any], limits: CallLimits | None, *,
               name: Callable[[str], str] = lambda k: k, device_gib: float | None = None,
               caps: Mapping[str, tuple[int, str]] | None = None, prompt_lists: bool = True) -> None:
    """Raise a ValueError naming the argument (`name(key)`: a CLI flag or the keyword) and
    what would work, for a call `variant` cannot make. `device_gib`: the card's memory when
    the call runs on one (None: on the host). `caps`: count -> (largest value, why).
    `prompt_lists`: whether the pipeline takes a list of prompts (BAGEL's and Qwen3-Omni's do not)."""
    for k in COUNTS:
        v = call.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"{name(k)} must be a positive integer, got {v!r}")
    for k, (cap, why) in (caps or {}).items():
        v = call.get(k)
        if v is not None and v > cap:
            raise ValueError(f"{_label(name, k, v)}: {variant} takes at most {cap:,} ({why}); ask for fewer")
    for k in SCALES:
        v = call.get(k)
        # inf passed `>= 0` and made a video of NaNs: the guided prediction is inf * (cond - uncond)
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf):
            raise ValueError(f"{name(k)} must be a finite number >= 0, got {v!r}")
    prompts, negatives = call.get("prompt"), call.get("negative_prompt")
    n = len(prompts) if isinstance(prompts, (list, tuple)) else 1
    if isinstance(negatives, (list, tuple)) and len(negatives) != n:
        raise ValueError(f"{name('negative_prompt')}: {len(negatives)} negative prompts for {n} prompt(s); give one "
                         f"per prompt, or one string for all")
    _check_prompts(call, name, prompt_lists)
    callback = call.get("callback_on_step_end")
    if callback is not None and not callable(callback):
        raise TypeError(f"{name('callback_on_step_end')} must be callable (a function or a diffusers "
                        f"PipelineCallback), got {type(callback).__name__}")
    for k in MAPPINGS:
        v = call.get(k)
        if v is not None and not isinstance(v, Mapping):
            raise TypeError(f"{name(k)} must be a dict (e.g. {{'scale': 1.0}}), got {type(v).__name__}")
    for k in FLAGS:
        v = call.get(k)
        if v is not None and not isinstance(v, bool):
            raise TypeError(f"{name(k)} must be True or False, got {v!r}")
    for k in SCHEDULES:
        v = call.get(k)
        if v is None:
            continue
        if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or not len(v):
            raise TypeError(f"{name(k)} must be a non-empty list of numbers, got {v!r}")
        items = v.tolist() if hasattr(v, "tolist") else v  # a numpy array or a 1-D tensor: its numbers
        bad = next((x for x in items if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x)),
                   None)
        if bad is not None:
            raise ValueError(f"{name(k)}: every item must be a finite number, got {bad!r}")
    for k in ("latents", "audio_latents"):
        v = call.get(k)
        if v is not None and not isinstance(v, torch.Tensor):
            raise TypeError(f"{name(k)} must be a torch.Tensor, got {type(v).__name__}")
    g = call.get("generator")
    if g is not None and not (_is_generator(g) or (isinstance(g, (list, tuple)) and g and all(map(_is_generator, g)))):
        raise ValueError(f"{name('generator')} must be a torch.Generator or a list of them (one per output), got "
                         f"{type(g).__name__}; for a seeded one: torch.Generator().manual_seed(N)")
    if isinstance(g, (list, tuple)) and len(g) != outputs_of(call):
        raise ValueError(f"{name('generator')}: {len(g)} generators for {outputs_of(call)} output(s) (prompts x outputs "
                         f"per prompt); give one per output, or one generator for all")
    kind, kinds = call.get("output_type"), limits.output_types if limits else OUTPUT_TYPES
    if kind is not None and kind not in kinds:
        raise ValueError(f"{name('output_type')} must be one of {', '.join(map(repr, kinds))}, got {kind!r}")
    seed = call.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX):
        raise ValueError(f"{name('seed')} must be an integer from 0 to 2**64 - 1 (a torch.Generator seed), got "
                         f"{seed!r}")
    if limits is None:
        return
    m = limits.pixel_multiple
    for k in ("height", "width"):
        v = call.get(k)
        if v is None:
            continue
        if v % m:
            near = sorted({max(m, v // m * m), (v // m + 1) * m})
            raise ValueError(f"{_label(name, k, v)}: {variant} needs height and width divisible by {m} "
                             f"({limits.why_multiple}); e.g. {' or '.join(map(str, near))}")
        if limits.max_grid is not None and v // m > limits.max_grid:
            raise ValueError(f"{_label(name, k, v)}: {variant} makes at most {limits.max_grid * m} px per side "
                             f"({limits.max_grid} patches of {m} px: {limits.why_grid})")
    f, s = call.get("num_frames"), limits.frame_step
    if f is not None and s:
        if (f - 1) % s:
            near = sorted({max(1, f - (f - 1) % s), f - (f - 1) % s + s})
            raise ValueError(f"{_label(name, 'num_frames', f)}: {variant} makes 1 + {s} k frames (its VAE turns "
                             f"each {s} frames after the first into one latent frame); e.g. "
                             f"{' or '.join(map(str, near))}")
        if limits.max_latent_frames is not None and (f - 1) // s + 1 > limits.max_latent_frames:
            raise ValueError(f"{_label(name, 'num_frames', f)}: {variant} makes at most "
                             f"{1 + s * (limits.max_latent_frames - 1)} frames ({limits.max_latent_frames} latent "
                             f"frames: {limits.why_grid})")
    h, w = call.get("height"), call.get("width")
    if h is None or w is None:
        return
    frames, outputs = f or 1, outputs_of(call)
    # the decoded outputs as float32, all of them: a lower bound of the call's memory
    need = frames * h * w * 3 * 4 * outputs
    host = host_memory_bytes()
    places = [(host, "this machine's memory")] if host else []
    if device_gib is not None:
        places.append((device_gib * 2**30, "the card"))
    for have, where in places:
        if need > have:
            size = f"{h}x{w}" + (f" x {f} frames" if f else "") + (f" x {outputs} outputs" if outputs > 1 else "")
            raise ValueError(f"{size}: {variant}'s decoded output alone is {need / 2**30:,.1f} GiB (float32), more "
                             f"than the {have / 2**30:,.0f} GiB of {where}; ask for a smaller size or fewer outputs")
