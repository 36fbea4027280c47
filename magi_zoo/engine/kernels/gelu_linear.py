"""``gelu_tanh(x @ W^T + b)`` as one GEMM: the `magi_zoo::linear_gelu_tanh` custom op.

Why: a FeedForward's up projection writes an N-wide output (8,960 at Wan2.1-1.3B, 13,824 at
14B, 12,288 at Flux) that a separate elementwise pass reads back for the GELU and writes
again. cuBLASLt can apply the bias and the tanh GELU in the GEMM's epilogue
(``torch._addmm_activation(bias, x, W^T, use_gelu=True)``), so the output is written once,
already activated. Measured on an H100 (benchmarks/results/kernels/gelu_epilogue_h100.md): Wan-1.3B's
up projection 1.815 -> 1.38 ms against the same two ops under torch.compile, Wan-14B's 7.34 ->
6.50, Flux's 0.68 -> 0.44 (FeedForward) and 0.59 -> 0.48 (single-block MLP), with a smaller
error against fp32 (the GELU is applied to the fp32 accumulator, not to a bf16-rounded one).
Whole forwards, same runs: Wan-1.3B 464.3 -> 448.4 ms with the norm + rope kernel, I2V-14B
2581 -> 2550 ms, Flux 1024^2 only 132.9 -> 131.3 (in Flux's single blocks inductor had already
fused the GELU into the concatenation proj_out reads, which the epilogue output still goes through).

Why a rewrite at all: model code calls ``gelu(linear(x))``, and inductor compiles that as a
cuBLAS GEMM plus a Triton pointwise kernel; it does not move the GELU into cuBLASLt's epilogue.
Why an opaque custom op rather than ``_addmm_activation`` inline: aten's own off-CUDA path of
that op applies the *exact* GELU, not the tanh one (torch/_decomp), so the op's definition is
spelled out here for every device, and the traced graph shows one named node. Off CUDA, or for
dtypes/layouts the epilogue does not take, the op is ``F.gelu(F.linear(x, W, b), "tanh")``.
It has a backward (recomputing the pre-activation from the saved input), so a trained
region may use it. For recompute it is a matmul (`OP_GROUPS["matmuls"]`): an option that keeps
the matmuls keeps its output, the others recompute it. Marked compute-sensitive (kept by every
selective option) it charged each "keep attention" block of Wan-1.3B at 480x832x81 its
32,760 x 8,960 bf16 output, 0.55 GiB (0.83 GiB kept a block instead of 0.28), so `auto` under a
16 GiB cap fell back to full recompute on 21 of 30 blocks (H100: 1.25x eager + full
checkpointing; 1.43x with the op as a matmul, benchmarks/results/train/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..compat import torch as torch_compat
from ..custom_ops import register_custom_op


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The op's definition."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def _fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _epilogue_ok(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and bias is not None and bias.dtype == x.dtype and x.shape[0] > 0)


@register_custom_op("linear_gelu_tanh", fake=_fake)
def linear_gelu_tanh(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x @ weight^T + bias) for a 2-D x: one cuBLASLt GEMM with the bias and GELU in
    its epilogue on CUDA (bf16/fp16 with a bias), the definition (`reference`) elsewhere."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_gelu_tanh takes x (M, K) and weight (N, K); got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if _epilogue_ok(x, weight, bias):
        return torch_compat.addmm_gelu(bias, x, weight.t())
    return reference(x, weight, bias)


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    # The GELU's derivative at the recomputed pre-activation (one GEMM, not stored), through
    # aten's own fused gelu_backward: one pass with fp32 math inside for bf16 (as the epilogue
    # applies the GELU to the fp32 accumulator). Spelled out in torch ops instead, the fp32
    # temporaries (pre, inner, tanh, derivative: 4 B each per element) of one Wan-1.3B up
    # projection (32,760 x 8,960) are 4 x 1.17 GB live at once in an eager backward -- the
    # working set that ran eager + full checkpointing out of a 16 GiB cap (peak 16.1 GiB
    # allocated, against 9.7 without the rewrite). Compiled, inductor fuses either form.
    pre = F.linear(x, weight, bias)
    g = torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    del pre
    dx = g @ weight if ctx.needs_input_grad[0] else None
    dw = g.t() @ x if ctx.needs_input_grad[1] else None
    db = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db


linear_gelu_tanh.register_autograd(_backward, setup_context=_setup_context)


def apply(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """`linear_gelu_tanh` for an input of any leading shape and an `nn.Linear`."""
    lead = x.shape[:-1]
    return linear_gelu_tanh(x.reshape(-1, x.shape[-1]), linear.weight, linear.bias).reshape(*lead, -1)
