"""The adapter contract: WHAT a model is. No compile logic lives here.

An adapter builds the native object (a diffusers pipeline, a transformers model, or our
own modules) from local weights, a hub id or random init at a published config; names
its compilable components; and says how to run it from the CLI and benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of a family's flavour table: a published (or tiny) configuration."""

    name: str
    family: str
    config: dict[str, Any]  # component name -> config kwargs, or whatever the adapter needs
    hub_id: str | None = None  # where the published weights live (used only when asked)
    tiny: bool = False  # tiny variants are always random and fully offline
    description: str = ""
    call_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)  # demo/CLI call kwargs


class Adapter:
    """Base class of model families. Subclasses fill the class attributes and `build`."""

    family: ClassVar[str]
    spec_file: ClassVar[str]  # file name under magi_zoo/specs/
    variants: ClassVar[dict[str, Variant]]
    aliases: ClassVar[dict[str, str]] = {}

    def build(self, variant: Variant, *, weights: str | Path | None, dtype: torch.dtype,
              device: torch.device) -> Any:
        """Return the native pipeline/model for `variant`.

        weights: None (tiny: random; published: the variant's hub id), "random" (random
        init at the published config, no download), a local directory, or a hub id.
        """
        raise NotImplementedError

    def components(self, native: Any) -> dict[str, nn.Module]:
        """The named module roots the spec's keys are relative to."""
        raise NotImplementedError

    def denoiser(self, native: Any) -> nn.Module:
        """The module that runs once per denoising step (benchmarks time one forward of it)."""
        raise NotImplementedError(f"{self.family}: no denoiser to benchmark")

    def denoiser_inputs(self, native: Any, variant: Variant, *, height: int | None = None,
                        width: int | None = None, frames: int | None = None,
                        batch: int = 1, seed: int = 0) -> dict[str, Any]:
        """Keyword arguments for one denoiser forward at a resolution (None = the variant's
        call defaults), random but seeded, on the denoiser's device and dtype."""
        raise NotImplementedError(f"{self.family}: no denoiser inputs")

    def run(self, handle: Any, *, prompt: str, out: Path, progress: bool = True, **kwargs) -> Path:
        """Generate from the CLI (`magi-zoo run`) and write the result to `out`."""
        raise NotImplementedError(f"{self.family}: `magi-zoo run` is not supported for this family")

    @staticmethod
    def run_options(variant: Variant, kwargs: dict[str, Any], supported: tuple[str, ...]) -> dict[str, Any]:
        """The `run` options the user gave (None = not given). A given option this family
        cannot use is a clear error naming the CLI flags it does take."""
        flag = lambda k: {"num_inference_steps": "--steps", "num_frames": "--frames"}.get(  # noqa: E731
            k, "--" + k.replace("_", "-"))
        given = {k: v for k, v in kwargs.items() if v is not None}
        bad = sorted(set(given) - set(supported))
        if bad:
            raise ValueError(f"{variant.name} cannot use {', '.join(flag(k) for k in bad)}; "
                             f"it takes --prompt, --out and {', '.join(flag(k) for k in supported)}")
        return given

    def weights_source(self, variant: Variant, weights: str | Path | None) -> str:
        """Normalise `weights=`: 'random', a local directory, or a hub id."""
        if variant.tiny:
            if weights not in (None, "random") and not Path(str(weights)).is_dir():
                raise ValueError(
                    f"{variant.name} is a tiny random variant; weights= must be None, 'random' "
                    f"or a local directory saved from it, not {weights!r}"
                )
            return "random" if weights in (None, "random") else str(weights)
        if weights is None:
            if variant.hub_id is None:
                raise ValueError(f"{variant.name} has no published weights; pass weights='random' or a path")
            return variant.hub_id
        return str(weights)


@contextlib.contextmanager
def init_on(device: torch.device | str, dtype: torch.dtype):
    """Create modules directly on `device` in `dtype` (random init at published sizes:
    no host-side fp32 copy of a 14B model, no cast afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def keep_fp32_modules(model: nn.Module) -> nn.Module:
    """Upcast the submodules a diffusers model declares in `_keep_in_fp32_modules`, as its
    `from_pretrained(torch_dtype=...)` would (norms, time embedders, RoPE tables)."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    for name, mod in model.named_modules():
        if keep.intersection(name.split(".")):
            mod.float()
    return model
