"""`PrecisionSpec`: the number format of a region's matmuls (the plan's ``precision``
section)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from .section import SectionSpec, register_section

MATMUL_FORMATS = ("bf16", "fp8")


@register_section
class PrecisionSpec(SectionSpec):
    """The number format of a region's matmuls and attention. Frozen.

    A spec file lists the regions that may run in fp8 (the repeated blocks' linears) with
    ``matmul = "bf16"``; `load(..., precision="fp8")` flips exactly those (matmul and attention). Embeddings,
    norms, modulation and the first and last layers are simply not listed. A region listed only for
    its fusions (``vae = { fuse_norm_act = true }``) names no matmul and stays as built under fp8.
    """

    section: ClassVar[str] = "precision"

    matmul: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="'bf16': the linears as built; 'fp8': float8 e4m3 weights with one scale per "
        "output row (quantized once, at apply) and activations quantized per row at run time "
        "(torch._scaled_mm); needs a card with fp8 matmuls.",
    )

    attention: Literal["bf16", "fp8"] = Field(
        "bf16",
        description="'bf16': attention as the attention section sets it; 'fp8': QK^T and PV in float8 "
        "e4m3 with per-head scales and K/V smoothed over tokens (exact rewrites), on the fa3 "
        "kernel; layers whose backend is not fa3 stay bf16, with a warning.",
    )

    keep_bf16: tuple[str, ...] = Field(
        (),
        description="Linears under the region (paths relative to it, fnmatch globs, e.g. 'ffn.net.2') "
        "that stay bf16 when matmul='fp8': where quantizing the input costs more than the fp8 GEMM "
        "saves (a wide input with a narrow output). A pattern that matches no linear is an error.",
    )
    fast_accum: bool = Field(
        False,
        description="fp8 GEMMs with cuBLAS fast accumulation (faster, slightly less accurate sums).",
    )
    fuse_gelu: bool = Field(
        True,
        description="With matmul='fp8': quantize a GELU (tanh) output inside one kernel that reads the "
        "pre-activation once (kernels/fp8_quant.py) -- a FeedForward's down projection, and the parts an "
        "adapter hands an fp8 linear (Flux's single-block proj_out) -- instead of inductor's two-pass "
        "quantization of a materialized GELU.",
    )
    gelu_epilogue: bool = Field(
        True,
        description="A bf16 linear followed by a GELU (tanh) -- diffusers' GELU module, and the pairs an "
        "adapter fuses (Flux's single-block MLP) -- runs as one cuBLASLt GEMM with the bias and the GELU in "
        "its epilogue (`magi_zoo::linear_gelu_tanh`, kernels/gelu_linear.py) on CUDA, instead of a GEMM and "
        "an elementwise pass over its wide output. Same function (the GELU reads the fp32 accumulator); in "
        "bf16 and fp8 regions alike (an fp8 up projection is fused by fuse_gelu instead).",
    )

    fuse_norm_rope: bool = Field(
        True,
        description="An attention's RMSNorm of q and k and its rotary embedding in one pass where the "
        "adapter's attention supports it (kernels/norm_rope.py): Wan's self-attention, normalised over all "
        "heads (`magi_zoo::rms_norm_rope`), and Flux's, FLUX.2's and Qwen-Image's attention, normalised per "
        "head with the text stream "
        "joined in front in the same pass (`magi_zoo::rms_norm_rope_heads`): one read and one write of q "
        "and k instead of reductions, strided pair accesses and a concatenation. Same function (no "
        "rounding between the norm and the rotation).",
    )

    fuse_norm_act: bool = Field(
        True,
        description="A VAE's channel RMSNorm and the SiLU after it in one pass where the adapter declares the "
        "pairing (the Wan VAE's residual blocks and heads; kernels/channel_norm.py, "
        "`magi_zoo::channel_rms_norm_act`): one read and one write per element instead of diffusers' fp32 "
        "normalisation, casts, affine and activation passes. Same function (the kernel rounds once, at the end).",
    )

    @field_validator("keep_bf16", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        # One name, or a list of names (a TOML array): the field is strict about the rest.
        return (v,) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v

    @classmethod
    def from_shorthand(cls, value: Any) -> "PrecisionSpec":
        # `WanTransformerBlock = "fp8"` is shorthand for { matmul = "fp8" }.
        if isinstance(value, str):
            return cls(matmul=value)
        return super().from_shorthand(value)
