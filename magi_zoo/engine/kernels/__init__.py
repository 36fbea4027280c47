"""Kernels beyond torch's and diffusers' own, one module each: FA3 attention (`fa3`, whose
kernel wheel loads only when a plan names it), the one-pass fp8 GELU quantization
(`fp8_quant`), the GELU-epilogue GEMM (`gelu_linear`), Wan's, Flux's and Qwen-Image's q/k norm + rope
(`norm_rope`), the joint text + image attention processors run on it (`joint_attention`), and
the Wan VAE's channel RMSNorm + SiLU (`channel_norm`).
None imports triton or a kernel wheel at import time: each Triton kernel is built on its first
CUDA call, so `import magi_zoo` works on CPU builds of torch."""

import functools


@functools.cache  # asked on every kernel call; the answer cannot change within a process
def triton_available() -> bool:
    """Whether triton imports here (every CUDA build of torch ships it; CPU builds may not)."""
    try:
        # lazy: triton is optional (CPU builds of torch lack it); this asks whether it is here
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - every CUDA torch ships triton
        return False
    return True
