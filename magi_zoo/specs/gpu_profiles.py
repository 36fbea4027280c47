"""GPU profiles: the facts about a card that a spec section and the engine choose by.

`gpu="auto"` detects the card from `torch.cuda.get_device_name()`; without CUDA it is
the "cpu" profile. Detection happens only when asked (never at import).
"""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ConfigDict, Field, field_validator


class GpuProfile(BaseModel):
    """What the engine needs to know about one kind of device."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="profile key, e.g. 'h100'")
    device: str = Field(description="torch device type: 'cuda' or 'cpu'")
    memory_gib: float = Field(description="device memory in GiB (host RAM budget for cpu)")
    bf16: bool = Field(description="native bf16 matmul")
    fp8: bool = Field(False, description="native fp8 matmul (Hopper, Ada, Blackwell); the precision "
                      "step refuses matmul='fp8' without it")
    attention_backends: tuple[str, ...] = Field(
        ("native",), description="backend='auto' of an `attention` spec: the first of these "
        "that can run here, in order (the engine's attention step reads it); names are "
        "diffusers backends or the engine's ('fa3')")
    bf16_tflops: float | None = Field(None, description="dense bf16 matmul peak, TFLOP/s (spec sheet)")
    match: tuple[str, ...] = Field((), description="substrings of the CUDA device name")

    @field_validator("attention_backends")
    @classmethod
    def _preferences(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        # Names are checked against diffusers' registry when the attention step runs
        # (importing diffusers here would make `import magi_zoo` heavy).
        if not v:
            raise ValueError("attention_backends needs at least one backend, e.g. ('native',)")
        if "auto" in (n.lower() for n in v):
            raise ValueError("attention_backends lists what 'auto' chooses from; it cannot contain 'auto'")
        return tuple(n.lower() for n in v)

    @property
    def attention_backend(self) -> str:
        """The card's preferred attention backend (first of `attention_backends`)."""
        return self.attention_backends[0]

    @property
    def default_dtype(self) -> str:
        """bf16 where the card has it, float32 on CPU (CPU bf16 is slow and inexact)."""
        return "bfloat16" if self.device == "cuda" and self.bf16 else "float32"


# Spec-sheet numbers (dense, no sparsity). Measured bf16 matmuls reach ~800 TFLOP/s on H100/H200
# (docs/benchmarks.md); the spec sheet's 989 is the ceiling a %-of-peak column is taken against.
#
# attention_backends (what an attention spec's backend="auto" picks, first that can run):
# - h100 / h200: ("fa3", "native"). Measured on an H100 (benchmarks/results/attention/attention_kernels_h100.md):
#   FA3 660-710 TFLOP/s against SDPA's 589-598 at the Wan shapes (32,760 tokens x 12 or 40
#   heads), and one Wan2.1-1.3B forward 520.4 -> 463.3 ms (1.12x); at Flux 1024^2 (4,608
#   tokens) FA3 is no faster (605 vs 624), so the Flux spec does not ask for auto. Without
#   the `hopper` extra, auto falls back to native with one warning naming it.
# - native = torch SDPA's own dispatch, which already picks cuDNN at the Wan shape (H200:
#   native 629.7 ms vs forced _native_cudnn 648.3 ms eager, 530.4 vs 535.9 ms compiled;
#   benchmarks/results/attention/attention_backends_wan2.1-t2v-1.3b_h200.md). Other cards are not
#   measured; native is the library default there.
PROFILES: dict[str, GpuProfile] = {
    p.name: p
    for p in [
        GpuProfile(name="cpu", device="cpu", memory_gib=16, bf16=False),
        GpuProfile(name="h100", device="cuda", memory_gib=80, bf16=True, fp8=True, bf16_tflops=989.0, match=("H100",),
                   attention_backends=("fa3", "native")),
        GpuProfile(name="h200", device="cuda", memory_gib=141, bf16=True, fp8=True, bf16_tflops=989.0, match=("H200",),
                   attention_backends=("fa3", "native")),
        GpuProfile(name="a100", device="cuda", memory_gib=80, bf16=True, bf16_tflops=312.0, match=("A100",)),
        GpuProfile(name="l40s", device="cuda", memory_gib=48, bf16=True, fp8=True, bf16_tflops=362.0, match=("L40S",)),
        GpuProfile(name="rtx4090", device="cuda", memory_gib=24, bf16=True, fp8=True, bf16_tflops=165.0, match=("4090",)),
        GpuProfile(name="rtx5090", device="cuda", memory_gib=32, bf16=True, fp8=True, bf16_tflops=209.0, match=("5090",)),
    ]
}

GPU_CHOICES = ("auto", *PROFILES)


def detect_profile_name() -> str:
    """The profile of the current CUDA device, or 'cpu' when there is none."""
    import torch  # lazy: specs are data and import no torch (seconds to import); only detection asks CUDA

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name()
    for p in PROFILES.values():
        if any(m in name for m in p.match):
            return p.name
    raise ValueError(
        f"gpu='auto' found {name!r}, which matches no profile; pass gpu= one of "
        f"{', '.join(PROFILES)} (the closest card), e.g. magi_zoo.load(..., gpu='a100')"
    )


def get_profile(gpu: str) -> GpuProfile:
    """Resolve a `gpu=` argument to a profile; unknown names list the choices."""
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a string, one of {', '.join(GPU_CHOICES)}")
    key = gpu.lower()
    if key == "auto":
        key = detect_profile_name()
    if key not in PROFILES:
        close = difflib.get_close_matches(key, GPU_CHOICES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown gpu {gpu!r}; choices: {', '.join(GPU_CHOICES)}.{hint}")
    return PROFILES[key]
