"""Shared adapter logic for families that are a diffusers pipeline (Wan, Flux): building
from random weights / a local directory / a hub id, naming components, the denoiser."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn as nn

from .base import Adapter, Variant


class DiffusersPipelineAdapter(Adapter):
    """An `Adapter` over a diffusers pipeline. Subclasses set `component_names` and
    implement `random_pipeline`; `post_build` may adjust the built pipeline."""

    component_names: ClassVar[tuple[str, ...]]  # pipeline attributes the spec keys refer to
    fp32_components: ClassVar[tuple[str, ...]] = ()  # kept in fp32 after from_pretrained

    def random_pipeline(self, variant: Variant, dtype: torch.dtype, device: torch.device):
        """The pipeline with random weights at the variant's config, built offline."""
        raise NotImplementedError

    def post_build(self, pipe) -> None:
        """Hook run on every built pipeline, random or loaded."""

    def build(self, variant: Variant, *, weights: Any, dtype: torch.dtype, device: torch.device):
        source = self.weights_source(variant, weights)
        if source == "random":
            torch.manual_seed(0)  # random weights are reproducible run to run
            pipe = self.random_pipeline(variant, dtype, device)
        else:
            from diffusers import DiffusionPipeline

            local = Path(source).is_dir()
            # A path loads strictly offline; anything else is a hub id, fetched by diffusers.
            pipe = DiffusionPipeline.from_pretrained(source, torch_dtype=dtype, local_files_only=local)
            for name in self.fp32_components:
                getattr(pipe, name).to(torch.float32)
            pipe.to(device)
        self.post_build(pipe)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def components(self, pipe) -> dict[str, nn.Module]:
        return {n: getattr(pipe, n) for n in self.component_names if isinstance(getattr(pipe, n, None), nn.Module)}

    def denoiser(self, pipe) -> nn.Module:
        return pipe.transformer
