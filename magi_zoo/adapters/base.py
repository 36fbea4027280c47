"""The adapter contract: WHAT a model is. No compile logic lives here.

The base class owns the build flow -- weights (random | local directory | hub id) -> seed
-> build on the device in the dtype -> eval -- and a family fills in small hooks:

- `build_random(variant, dtype, device)`: the native object at the variant's config with
  random weights, created offline directly on device/dtype;
- `load_pretrained(variant, source, local, dtype, device)`: from a local directory
  (strictly offline) or a hub id (fetched by the library's own `from_pretrained`);
- `finish(native)`: what every build path does afterwards (default: eval every component).

It declares:
- `components(native)`: the named module roots the spec's keys are relative to;
- `entry_points`: the per-call entry points a benchmark or conformance test drives (a
  diffusion family's denoiser step, an LLM family's `prefill` / `decode_step`), with
  `entry(native, name)` -> (module, method) and `example_inputs(native, variant, name,
  **shape)` -> keyword arguments for one call;
- `preparations(native)`: model-specific graph preparations the engine's first step
  installs (shown in the report, undone by `remove`);
- `run_options` and `output_suffixes`: what `magi-zoo run` may pass and write, checked
  before anything is built; `generate(handle, prompt, **options)` returns an `Output`
  that the CLI writes (magi_zoo/cli/writers.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn

from ..engine import Preparation
from ..engine.compat.diffusers import keep_in_fp32_modules
from ..specs import spec_path as shipped_spec_path
from ._notices import quiet_library_notices
from .call_checks import CallLimits, check_call, check_given_counts
from .fast_init import parallel_fills
from .weights_check import FAMILY_WEIGHTS, Identity, identify, identify_hub, path_reason

# CLI flag of each run option (for error messages).
FLAGS = {"num_inference_steps": "--steps", "num_frames": "--frames", "max_new_tokens": "--max-new-tokens",
         "audio_out": "--audio-out", "image": "--image", "height": "--height", "width": "--width", "seed": "--seed",
         "task": "--task", "think": "--think", "audio": "--audio", "voice": "--voice"}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of a family's flavour table: a published (or tiny) configuration."""

    name: str
    family: str
    config: dict[str, Any]  # component name -> config kwargs, or whatever the adapter needs
    hub_id: str | None = None  # where the published weights live (used only when asked)
    tiny: bool = False  # tiny variants are always random and fully offline
    description: str = ""
    call_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # what the handle's call fills in


@dataclasses.dataclass
class Output:
    """What `Adapter.generate` returns; the CLI writes it (the kind picks the writer)."""

    kind: str  # "video" | "image" | "text"
    # video: an (F, H, W, 3) float array in [0, 1] (or a list of H x W x 3 frames); image: a PIL
    # image; text: a str. A pipeline's array is kept as it is: a list of 81 frames at 480 x 832
    # would be stacked again by the writer, a 388 MB copy on every video written.
    value: Any
    fps: int | None = None  # video
    # optional float waveform in [-1, 1], 1-D (mono) or (channels, samples): a text reply's
    # speech, or a video's sound track (an .mp4 carries it; `--audio-out` writes it as .wav)
    audio: Any = None
    sample_rate: int | None = None
    note: str | None = None  # one line the CLI prints with the result (e.g. "0 tokens decoded")


class Adapter:
    """Base class of model families. Subclasses fill the class attributes and the hooks."""

    family: ClassVar[str]
    spec_file: ClassVar[str]  # file name under magi_zoo/specs/
    variants: ClassVar[dict[str, Variant]]
    aliases: ClassVar[dict[str, str]] = {}
    entry_points: ClassVar[tuple[str, ...]] = ()  # e.g. ("denoise",) or ("prefill", "decode_step")
    run_options: ClassVar[tuple[str, ...]] = ()  # `magi-zoo run` options this family takes
    output_suffixes: ClassVar[tuple[str, ...]] = ()  # file suffixes `--out` may have
    weights_families: ClassVar[tuple[str, ...]] = ()  # checkpoint families it loads (default: FAMILY_WEIGHTS)
    sound_track: ClassVar[bool] = False  # its videos carry audio (Output.audio): an .mp4 needs PyAV to mux it
    # An image-to-video variant's first frame sets the video's size (HunyuanVideo-1.5): --height /
    # --width are refused beside --image. False: they stay the call's (Wan2.1 I2V resizes the frame).
    image_sets_size: ClassVar[bool] = False
    # The smallest side (pixels) an input image may have (FLUX.2's conditioning image: 64); None: any.
    min_image_side: ClassVar[int | None] = None
    # What an API call's `image=` may be ("PIL", "numpy", "tensor", "path"): by default the kinds
    # diffusers' image processors read, a list of them too (FLUX.2's reads PIL images only; BAGEL
    # and Qwen3-Omni read a PIL image or a file). Another kind is refused before any work.
    image_kinds: ClassVar[tuple[str, ...]] = ("PIL", "numpy", "tensor")
    # Whether the pipeline takes a list of prompts (a batch) besides one string.
    prompt_lists: ClassVar[bool] = True

    # -- build flow (owned here) ------------------------------------------------------------
    def build(self, variant: Variant, *, weights: str | Path | None, dtype: torch.dtype,
              device: torch.device) -> Any:
        """Return the native pipeline/model for `variant`.

        weights: None (tiny: random; published: the variant's hub id), "random" (random
        init at the published config, no download), a local directory, or a hub id.
        """
        source = self.weights_source(variant, weights)
        quiet_library_notices()
        torch.manual_seed(0)  # random weights (and anything a loader initialises) are reproducible
        if source == "random":
            native = self.build_random(variant, dtype, device)
        else:
            native = self.load_pretrained(variant, source, Path(source).is_dir(), dtype, device)
        self.finish(native)
        return native

    def build_random(self, variant: Variant, dtype: torch.dtype, device: torch.device) -> Any:
        """The native object at the variant's config, random weights, built offline."""
        raise NotImplementedError(f"{self.family}: build_random")

    def load_pretrained(self, variant: Variant, source: str, local: bool, dtype: torch.dtype,
                        device: torch.device) -> Any:
        """Load from a local directory (local=True: strictly offline) or a hub id."""
        raise NotImplementedError(f"{self.family}: loading weights is not supported; use weights='random'")

    def finish(self, native: Any) -> None:
        """Run on every built object: eval mode (fresh modules are in training mode, dropout on)."""
        for m in self.components(native).values():
            m.eval()

    def weights_source(self, variant: Variant, weights: str | Path | None) -> str:
        """Normalise `weights=`: 'random', a local directory, or a hub id -- decided by the shape
        of the string (`weights_check.path_reason`): a missing local path is an error about the
        path, and a local directory holding another family's checkpoint is refused by name
        (`check_weights_dir`). Cheap (a few small JSON files): `load` calls it before the plan."""
        if weights is None:
            if variant.tiny:
                return "random"
            if variant.hub_id is None:
                raise ValueError(f"{variant.name} has no published weights; pass weights='random' or a path")
            return variant.hub_id
        text = str(weights)
        if text == "random":
            return "random"
        path = Path(text).expanduser()
        if path.is_dir():
            self.check_weights_dir(variant, path)
            return str(path)
        if path.exists():
            raise ValueError(f"{variant.name}: weights {text!r} is a file; pass the checkpoint directory that holds "
                             "it (with its config files), or weights='random' (--weights random)")
        why = path_reason(text)
        if why is not None:
            raise ValueError(f"{variant.name}: weights {text!r}: no such directory (it reads as a local path: {why}); "
                             "pass an existing checkpoint directory, a hub id ('org/name'), or weights='random' "
                             "(--weights random)")
        if variant.tiny:
            raise ValueError(f"{variant.name} is a tiny random variant; weights= must be None, 'random' or a local "
                             f"directory saved from it, not {text!r} (no such directory)")
        if self.accepted_weights():  # a hub id already in the local hub cache: identified from it (offline)
            self.refuse_foreign(variant, repr(text), identify_hub(text))
        return text

    def accepted_weights(self) -> tuple[str, ...] | None:
        """The checkpoint families this adapter loads (`weights_families`, else the shipped
        families' table); None: not checked."""
        return self.weights_families or FAMILY_WEIGHTS.get(self.family)

    def check_weights_dir(self, variant: Variant, path: Path) -> None:
        """Refuse a directory whose declared classes (model_index.json's / config.json's
        `_class_name`, transformers' `architectures`, the original layouts' files) name
        another family's checkpoint -- before a plan is resolved against what it would build."""
        if self.accepted_weights():
            self.refuse_foreign(variant, f"in {str(path)!r}", identify(path))

    def refuse_foreign(self, variant: Variant, where: str, found: Identity | None) -> None:
        """A ValueError when `found` (an identified checkpoint) is not of a family this adapter loads."""
        accepted = self.accepted_weights()
        if found is None or not accepted or found.family in accepted:
            return
        raise ValueError(f"{variant.name}: the weights {where} are a {found.family} checkpoint "
                         f"({found.layout}: found {found.found}), not {' or '.join(accepted)}; pass a "
                         f"{accepted[0]} checkpoint directory, run these weights with a {found.family} model "
                         "(magi-zoo list), or pass weights='random' (--weights random)")

    def save_pretrained(self, native: Any, path: str | Path) -> Path:
        """Write the weights (and tokenizer) so that `build(weights=path)` loads them back."""
        native.save_pretrained(path)
        return Path(path)

    def spec_path(self) -> Path:
        """The spec file: shipped under magi_zoo/specs/, or (out-of-tree adapters) next to
        the adapter's own module."""
        path = shipped_spec_path(self.spec_file)
        if path.is_file():
            return path
        return Path(sys.modules[type(self).__module__].__file__).parent / self.spec_file

    # -- what the engine and the tools see --------------------------------------------------
    def components(self, native: Any) -> dict[str, nn.Module]:
        """The named module roots the spec's keys are relative to."""
        raise NotImplementedError

    def preparations(self, native: Any) -> list[Preparation]:
        """Graph preparations the engine installs as its first step (default: none)."""
        return []

    def entry(self, native: Any, name: str) -> tuple[nn.Module, str]:
        """(module, method name) of one entry point: what a benchmark times."""
        raise NotImplementedError(f"{self.family}: no entry point {name!r}")

    def example_inputs(self, native: Any, variant: Variant, entry: str, **shape) -> dict[str, Any]:
        """Keyword arguments for one call of `entry` at a shape (None = the variant's call
        defaults), random but seeded, on the module's device and dtype."""
        raise NotImplementedError(f"{self.family}: no example inputs for {entry!r}")

    def check_entry(self, name: str) -> None:
        if name not in self.entry_points:
            raise ValueError(f"{self.family} has no entry point {name!r}; entry points: "
                             f"{', '.join(self.entry_points) or '(none)'}")

    def call_defaults(self, variant: Variant) -> dict[str, Any]:
        """What the handle fills into a call the user left unset (default: the variant's)."""
        return dict(variant.call_defaults)

    # -- `magi-zoo run` -----------------------------------------------------------------------
    def check_run(self, variant: Variant, options: dict[str, Any], out: Path | None = None) -> dict[str, Any]:
        """The options the user gave (None = not given), checked before anything is built:
        an option this family cannot use, a bad value or an `--out` suffix it cannot write
        is a clear error naming what it does take. An image-to-video variant (`image_to_video`)
        requires `--image` (the first frame: a file, or a PIL image in the API) and with
        `image_sets_size` refuses --height / --width; another variant given `--image` that it
        cannot use is told which variants take it. Input files are `check_inputs`' job (the CLI
        calls both before the build, the server both when a request arrives)."""
        image = options.get("image")
        if self.image_to_video(variant):
            if image is None:
                raise ValueError(f"{variant.name} is image-to-video: pass --image FILE (the first frame)")
            bad = [FLAGS.get(k, "--" + k) for k in ("height", "width") if options.get(k) is not None]
            if self.image_sets_size and bad:
                raise ValueError(f"{variant.name} takes the video's size from --image; drop {' and '.join(bad)}")
            given = self._check_options(variant, {k: v for k, v in options.items() if k != "image"}, out)
            return {**given, "image": image}  # the file itself: `check_inputs`, once
        try:
            return self._check_options(variant, options, out)
        except ValueError as e:
            i2v = [n for n, v in self.variants.items() if self.image_to_video(v)]
            if image is None or not i2v or "image" in self.run_options:
                raise
            raise ValueError(f"{e}; --image is for the image-to-video variants: {', '.join(i2v)}") from None

    def _check_options(self, variant: Variant, options: dict[str, Any], out: Path | None) -> dict[str, Any]:
        """`check_run` without the first-frame rule: the options against `run_options`, the
        call's limits and `--out`."""
        flag = lambda k: FLAGS.get(k, "--" + k.replace("_", "-"))  # noqa: E731
        given = {k: v for k, v in options.items() if v is not None}
        bad = sorted(set(given) - set(self.run_options))
        if bad:
            raise ValueError(f"{variant.name} cannot use {', '.join(flag(k) for k in bad)}; "
                             f"it takes --prompt, --out and {', '.join(flag(k) for k in self.run_options)}")
        # counts, sizes against the family's limits, the output against this machine's memory
        self.check_call(variant, {**self.call_defaults(variant), **given}, name=flag)
        if out is not None:
            suffix, suffixes = Path(out).suffix.lower(), self.out_suffixes(variant, given)
            if suffix not in suffixes:
                raise ValueError(f"--out {str(out)!r}: {variant.name} writes {' or '.join(suffixes)} here")
            call = {**self.call_defaults(variant), **given}
            wide = [k for k in ("height", "width") if isinstance(call.get(k), int) and call[k] > MP4_MAX_SIDE]
            if suffix == ".mp4" and wide:
                raise ValueError(f"{' and '.join(f'{flag(k)} {call[k]}' for k in wide)}: an .mp4 (H.264, libx264) "
                                 f"frame is at most {MP4_MAX_SIDE} px a side; ask for a smaller size (or --out .gif)")
            if self.sound_track and suffix == ".mp4" and not can_mux_audio():
                raise ValueError(f"--out {str(out)!r}: {variant.name}'s video has a sound track; an .mp4 with "
                                 f"it needs PyAV: {AV_HINT}")
        if given.get("audio_out") is not None and Path(given["audio_out"]).suffix.lower() != ".wav":
            raise ValueError(f"--audio-out {str(given['audio_out'])!r}: audio is written as .wav")
        return given

    def check_inputs(self, given: dict[str, Any]) -> None:
        """The input files among checked run options (`--image`, `--audio`): each exists, is
        readable and (an image) opens with PIL, and an image has `min_image_side` -- before the
        build, not after it. Run after `check_run`, so an option the family refuses is named first."""
        sizes = {k: check_input_file(given[k], FLAGS[k], image=k == "image")
                 for k in ("image", "audio") if isinstance(given.get(k), (str, os.PathLike))}
        image = given.get("image")
        if image is not None and self.min_image_side is not None:
            # a file's size from the header check above, a PIL image's (API, server) from itself
            size, what = (sizes["image"], f"{FLAGS['image']} {str(image)!r}") if "image" in sizes \
                else (image.size, "the input image")
            if min(size) < self.min_image_side:
                raise ValueError(f"{what}: {size[0]}x{size[1]}; {self.family} takes input images of at least "
                                 f"{self.min_image_side}x{self.min_image_side} pixels")

    def activation_estimate(self, variant: Variant, call: dict[str, Any],
                            bytes_per_element: int) -> dict[str, float] | None:
        """The activation peaks of a call (call defaults filled in), GiB per offload key: "" the
        plan-wide reserve (the denoiser's forward), a unit key its phase's (a VAE), estimated from
        the config and the call's shape in the weights' dtype (`bytes_per_element`). The offload
        plan's reserves are these plus a margin (`magi_zoo.overrides.activation_reserves`); None
        (the default): the spec's fixed `activation_gib` / `phase_activation_gib` stand."""
        return None

    def call_limits(self, variant: Variant) -> CallLimits | None:
        """What `variant`'s calls can make (pixel multiple, position-table length, frame step),
        from its config; None: sizes are not the family's (counts are still checked)."""
        return None

    def count_caps(self, variant: Variant) -> dict[str, tuple[int, str]]:
        """call key -> (the largest count a call may ask, why), from `variant`'s config. Default:
        `num_inference_steps` at most the scheduler's `num_train_timesteps` where the config
        names one: the schedule has no finer grid to step on (diffusers' discrete schedulers
        refuse more steps themselves; a flow-matching one builds sigma arrays of any length and
        runs that many forwards). Families with a language model add its token budgets, capped
        at its position table."""
        sched = variant.config.get("scheduler") if isinstance(variant.config, dict) else None
        if not isinstance(sched, dict):
            return {}
        # a config that leaves it out gets the library's default: 1,000 in every diffusers scheduler
        n = sched.get("num_train_timesteps", 1000)
        return {"num_inference_steps": (n, f"its scheduler has {n:,} training timesteps")}

    def check_call(self, variant: Variant, call: dict[str, Any], *, name=lambda k: k,
                   device_gib: float | None = None, given: dict[str, Any] | None = None) -> None:
        """A call (call defaults filled in) checked before any work, by the general rule of
        `call_checks.check_call` over `call_limits(variant)` and `count_caps(variant)`: the
        handle runs it before each call, `check_run` before the build. `name(key)` words the
        argument (a CLI flag). `given`: what the caller passed (before the defaults), for
        `check_given`."""
        check_call(variant.name, call, self.call_limits(variant), name=name, device_gib=device_gib,
                   caps=self.count_caps(variant), prompt_lists=self.prompt_lists)
        if given is not None:
            check_given_counts(given, name)
            self.check_given(variant, given, call, name=name)

    def check_given(self, variant: Variant, given: dict[str, Any], call: dict[str, Any], *,
                    name=lambda k: k) -> None:
        """Raise for an argument the caller gave that this call would ignore or fail on late
        (`call`: with the defaults filled in). Here: an image-to-video variant's call has an
        `image=`, and an API call's `image=` is of a kind the
        pipeline reads (`image_kinds`; a path only where the pipeline opens files itself) and
        a PIL image has `min_image_side`. Families add their own (the diffusers base: guidance
        arguments a call would drop)."""
        image = given.get("image")
        if image is None:
            if self.image_to_video(variant):  # the pipeline's own error was Python's "missing argument"
                raise ValueError(f"{variant.name} is image-to-video: pass {name('image')}= (the first frame, "
                                 f"e.g. PIL.Image.open(path))")
            return
        if isinstance(image, (str, os.PathLike)) and "path" in self.image_kinds:
            return  # the pipeline opens the file first thing, with its own errors (no such file, not an image)
        items = list(image) if isinstance(image, (list, tuple)) else [image]
        if not items:
            raise ValueError(f"{name('image')} is an empty list: pass an image, or none")
        import numpy as np  # lazy: only a call with an image needs it
        import PIL.Image  # lazy: PIL costs ~15 ms; only a call with an image needs it
        kinds = {"PIL": PIL.Image.Image, "numpy": np.ndarray, "tensor": torch.Tensor}
        words = {"PIL": "a PIL image", "numpy": "a numpy array", "tensor": "a torch.Tensor", "path": "a file's path"}
        for item in items:
            if not isinstance(item, tuple(kinds[k] for k in self.image_kinds if k in kinds)):
                what = " or ".join(words[k] for k in self.image_kinds)
                raise TypeError(f"{name('image')} must be {what}, got {type(item).__name__}"
                                + ("; for a file, PIL.Image.open(path)" if "path" not in self.image_kinds else ""))
            if isinstance(item, PIL.Image.Image):
                self.check_inputs({"image": item})

    def prompt_truncation(self, native: Any, prompt: str, call: dict[str, Any]) -> dict[str, int]:
        """encoder -> token limit, for each text encoder of `native` that will read only the
        start of `prompt` in this call (call defaults filled in): what `magi-zoo run` says in
        its one `prompt truncated` line where the library drops tokens without a word.
        Default: none known."""
        return {}

    def image_to_video(self, variant: Variant) -> bool:
        """Whether `variant` makes a video from a first frame it requires (`--image` on the CLI,
        `image=` in the API, `input_reference` in the server's videos API). Default: no."""
        return False

    def out_suffixes(self, variant: Variant, given: dict[str, Any]) -> tuple[str, ...]:
        """The `--out` suffixes valid for these options (default: `output_suffixes`)."""
        return self.output_suffixes

    def generate(self, handle: Any, *, prompt: str, progress: bool = True, **options) -> Output:
        """Generate for `magi-zoo run` through the handle (options already checked)."""
        raise NotImplementedError(f"{self.family}: `magi-zoo run` is not supported for this family")


# libx264's largest frame side: measured through PyAV, 16384 px encodes and 16386 fails to open
# the encoder (avcodec_open2) -- after a whole generation, if not checked before it
MP4_MAX_SIDE = 16384
AV_HINT = "pip install 'magi-zoo[av]' (or write a .gif, and the sound with --audio-out FILE.wav)"


def can_mux_audio() -> bool:
    """Whether an .mp4 can carry a sound track here: PyAV (the `av` extra) is importable."""
    return importlib.util.find_spec("av") is not None


def check_input_file(path: str | os.PathLike, flag: str, *, image: bool = False) -> tuple[int, int] | None:
    """An input file the run reads: it exists, is a readable file and (image=True) is an
    image PIL can read -- checked before the build, the error naming the flag and the path.
    Returns an image's (width, height) from its header (None for another file)."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {str(path)!r}: no such file")
    if not p.is_file():
        raise ValueError(f"{flag} {str(path)!r}: not a file (a directory?); pass the file itself")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{flag} {str(path)!r}: the file is not readable (permissions)")
    if image:
        from PIL import Image, UnidentifiedImageError  # lazy: PIL costs ~15 ms; only image inputs need it

        try:
            with Image.open(p) as img:
                img.verify()  # reads the header and checks the data without decoding the pixels
                return img.size
        except Image.DecompressionBombError as e:  # PIL's guard against images too large to decode safely
            raise ValueError(f"{flag} {str(path)!r}: the image is too large to decode safely ({e}); resize it "
                             "(the model works at a few megapixels at most)") from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"{flag} {str(path)!r}: not an image PIL can read ({type(e).__name__}: "
                             f"{' '.join(str(e).split())}); pass a .png, .jpg or .webp file") from None
    return None


@contextlib.contextmanager
def init_on(device: torch.device | str, dtype: torch.dtype):
    """Create modules directly on `device` in `dtype` (random init at published sizes:
    no host-side fp32 copy of a 14B model, no cast afterwards). In host memory the random
    fills run on every core (`fast_init.parallel_fills`): one thread would take minutes for
    a 20 G-parameter pipeline."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    via = "cuda" if torch.cuda.is_available() else None  # a card draws them far faster, even for the host
    fills = parallel_fills(via=via) if torch.device(device).type == "cpu" else contextlib.nullcontext()
    try:
        with torch.device(device), fills:
            yield
    finally:
        torch.set_default_dtype(old)


def keep_fp32_modules(model: nn.Module) -> nn.Module:
    """Upcast the submodules a diffusers model declares in `_keep_in_fp32_modules`, as its
    `from_pretrained(torch_dtype=...)` would (norms, time embedders, RoPE tables)."""
    keep = set(keep_in_fp32_modules(model))
    for name, mod in model.named_modules():
        if keep.intersection(name.split(".")):
            mod.float()
    return model
