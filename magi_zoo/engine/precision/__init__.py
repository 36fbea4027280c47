"""The precision step: run a region's linears (and its fa3 attention) in fp8, and install the
kernel fusions (GELU in the GEMM epilogue, q/k norm + rope in one pass) in bf16 and fp8 regions.

`fp8_linear` holds `Fp8Linear`, `fp8_attention` the switch of fa3 layers to fp8 FA3, `fusions`
the fusions and the marks adapters read, `step` is `precision_step`. docs/precision.md describes
the formats, their measured error and speed.
"""

from .fp8_linear import E4M3_MAX, Fp8Linear, eligible, reference_linear, rowwise_fp8
from .fusions import GELU_EPILOGUE_MARK, NORM_ACT_PAIRS, NORM_ROPE_MARK, GeluLinear, marked_norm, marked_norms
from .step import precision_step

__all__ = ["precision_step", "Fp8Linear", "E4M3_MAX", "eligible", "reference_linear", "rowwise_fp8",
           "GELU_EPILOGUE_MARK", "NORM_ACT_PAIRS", "NORM_ROPE_MARK", "GeluLinear", "marked_norm", "marked_norms"]
