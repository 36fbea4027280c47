"""LightX2V's step- and CFG-distilled Wan: 4 steps, no classifier-free guidance.

Sources (ModelTC/LightX2V, read for these numbers and layouts):
- configs/distill/wan21/wan_i2v_distill_model_4step_cfg.json, wan_t2v_distill_model_4step_cfg.json,
  wan_i2v_distill_lora_4step_cfg.json, wan_t2v_distill_lora_4step_cfg.json: ``infer_steps`` 4,
  ``denoising_step_list`` [1000, 750, 500, 250], ``sample_shift`` 5, ``enable_cfg`` false,
  480x832, 81 frames; the LoRA configs merge the distill LoRA at strength 1.0 over the base.
- configs/distill/wan22/wan_moe_t2v_distill_lora.json: Wan2.2 T2V-A14B, the same 4 steps and
  shift, ``boundary_step_index`` 2 (2 high-noise steps, then 2 low-noise), a high-noise LoRA
  and a low-noise LoRA, each at 1.0.
- lightx2v/models/schedulers/wan/step_distill/scheduler.py (`WanStepDistillScheduler`):
  sigmas = shift * s / (1 + (shift - 1) * s) over s = linspace(1, 0, 1001)[:-1], taken at
  indices 1000 - t for t in the step list (so s = t / 1000: 1.0, 0.75, 0.5, 0.25 -> 1.0,
  0.9375, 0.8333, 0.625 at shift 5); timesteps = sigma * 1000; each step
  x <- x - sigma * v + sigma_next * v (sigma_next = 0 after the last): an Euler step of the
  flow. That is diffusers' FlowMatchEulerDiscreteScheduler given those sigmas, which
  `StepDistill` below passes it for any step count N: s = linspace(1, 0, N + 1)[:-1] (N = 4:
  the published list exactly). Wan2.2's boundary 0.875 x 1000 = 875 splits the timesteps
  1000, 937.5 | 833.3, 625 after step 2, LightX2V's boundary_step_index.
- docs/EN/source/method_tutorials/step_distill.md: the full distilled DiT goes in a
  ``distill_models/`` folder of the original Wan model directory (``distill_model.safetensors``
  or ``.pt``), read in the original key names; the LoRAs are published under the hub
  repositories' ``loras/`` folders (lightx2v/Wan2.1-I2V-14B-480P-StepDistill-CfgDistill-Lightx2v,
  lightx2v/Wan2.1-T2V-14B-StepDistill-CfgDistill-Lightx2v, lightx2v/Wan2.2-Distill-Loras).
- configs/bench/lightx2v_5_distill.json / lightx2v_6_distill.json: the distilled rows of
  LightX2V's whole-generation benchmark (benchmarks/whole_generation.py reproduces the workload).
"""

from __future__ import annotations

import functools
from typing import Any

# The sampler of every distilled variant (the published configs' values).
SHIFT = 5.0
DENOISING_STEPS = (1000, 750, 500, 250)
CALL = dict(num_inference_steps=len(DENOISING_STEPS), guidance_scale=1.0)  # guidance 1: no CFG forward
CONFIG = dict(shift=SHIFT, denoising_step_list=DENOISING_STEPS)

# Published distill LoRAs, as hub paths (org/name/path/file): what the -distill-lora variants merge.
LORA_I2V = ("lightx2v/Wan2.1-I2V-14B-480P-StepDistill-CfgDistill-Lightx2v/loras/"
            "Wan21_I2V_14B_lightx2v_cfg_step_distill_lora_rank64.safetensors")
LORA_T2V = ("lightx2v/Wan2.1-T2V-14B-StepDistill-CfgDistill-Lightx2v/loras/"
            "Wan21_T2V_14B_lightx2v_cfg_step_distill_lora_rank64.safetensors")
LORA_22_T2V = [
    {"source": "lightx2v/Wan2.2-Distill-Loras/wan2.2_t2v_A14b_high_noise_lora_rank64_lightx2v_4step_1217.safetensors",
     "component": "transformer"},
    {"source": "lightx2v/Wan2.2-Distill-Loras/wan2.2_t2v_A14b_low_noise_lora_rank64_lightx2v_4step_1217.safetensors",
     "component": "transformer_2"},
]


@functools.lru_cache(maxsize=None)
def scheduler_class() -> type:
    """`StepDistill`: diffusers' FlowMatchEulerDiscreteScheduler that, asked for N steps with no
    sigmas, uses LightX2V's evenly spaced ones (built on first use: diffusers costs seconds)."""
    import numpy as np  # lazy: with diffusers, below
    from diffusers import FlowMatchEulerDiscreteScheduler  # lazy: diffusers costs seconds

    class StepDistill(FlowMatchEulerDiscreteScheduler):
        """Step-distilled Wan's sampler: Euler over sigmas s = linspace(1, 0, N + 1)[:-1],
        shifted by `shift` (the parent's set_timesteps applies the shift and appends sigma 0)."""

        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            if sigmas is None and timesteps is None and num_inference_steps:
                sigmas = np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()
            return super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu,
                                         timesteps=timesteps)

    return StepDistill


def make_scheduler(config: dict[str, Any]):
    """The distilled sampler for a variant's `distill` config."""
    return scheduler_class()(num_train_timesteps=1000, shift=float(config["shift"]))


def install(pipe, config: dict[str, Any]) -> None:
    """Put the distilled sampler on a built pipeline (any build path: random, diffusers
    directory, original layout)."""
    pipe.scheduler = make_scheduler(config)


def plain(pipe):
    """A library scheduler with the distilled one's config, for `save_pretrained` (a saved
    model_index.json must name a class diffusers can load; `install` runs again at load)."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # lazy: diffusers costs seconds

    return FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)


def lightx2v_sigmas(steps=DENOISING_STEPS, shift: float = SHIFT) -> list[float]:
    """LightX2V's sigmas, computed as its WanStepDistillScheduler does (for tests and docs)."""
    import torch  # lazy: keeps this module importable without torch work at listing time

    s = torch.linspace(1.0, 0.0, 1001)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    return [float(s[1000 - t]) for t in steps]
