"""`Fp8Linear`: an `nn.Linear` in fp8, and the FeedForward GELU folded into its input quantization.

Its weight is quantized once, at apply, to float8 e4m3 with one fp32 scale per output row; at run
time each activation row gets its own scale (amax / 448) and the product is one scaled fp8 GEMM
(`compat.torch.scaled_mm`) with row-wise scales, accumulated in fp32 and written in the input
dtype. Everything is plain aten ops, so a compiled region traces it whole (fullgraph) and inductor
fuses the activation quantization into the preceding elementwise work; no tensor subclass is
traced (the tensor-subclass path of torchao made the cold compile 119-175 s, docs/precision.md).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..compat import torch as torch_compat
from ..kernels import fp8_quant

E4M3_MAX = 448.0  # largest finite float8_e4m3fn
_EPS = 1e-12  # keeps an all-zero row's scale finite


def rowwise_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 tensor, fp32 per-row scale) with x ~= fp8 * scale, row = last dim."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=_EPS)
    scale = amax / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(nn.Module):
    """An `nn.Linear` with fp8 weights (per output row scales) and fp8 activations (per
    token scales), through one scaled fp8 GEMM. Forward only (no gradient to the weight)."""

    def __init__(self, linear: nn.Linear, fast_accum: bool = False):
        super().__init__()
        self.fast_accum = fast_accum
        # True: the input is a pre-activation and GELU (tanh) runs inside the one-pass
        # quantization kernel (`fuse_gelu`: the precision step sets it on a FeedForward's down
        # projection after taking the GELU out of the up projection).
        self.input_gelu = False
        self.input_bias: torch.Tensor | None = None  # with input_gelu: the up projection's bias
        # May an adapter hand this linear its input in parts (`forward_parts`)? The precision
        # step sets it from the spec's fuse_gelu; an Fp8Linear built by hand says no.
        self.fuse_gelu = False
        w = linear.weight.detach()
        q, scale = rowwise_fp8(w)  # (out, in) fp8 and (out, 1) fp32
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_fp8", q)
        self.register_buffer("weight_scale", scale.reshape(1, -1).contiguous())  # (1, out) for the GEMM
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (for code that reads `.weight`, e.g. dtype checks)."""
        return self.weight_fp8.float() * self.weight_scale.reshape(-1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.input_gelu:  # x is the up projection's raw output; its bias joins in the kernel
            xq, xs = fp8_quant.rowwise_fp8_gelu_cat(x2, None, self.input_bias, None, True, False)
        else:
            xq, xs = rowwise_fp8(x2)
        return self._matmul(xq, xs, x.dtype, shape[:-1])

    def forward_parts(self, a: torch.Tensor, b: torch.Tensor, bias_b: torch.Tensor | None,
                      gelu_a: bool, gelu_b: bool) -> torch.Tensor:
        """`forward(cat([gelu?(a), gelu?(b + bias_b)], -1))` without materializing the
        concatenation or the GELU: one kernel quantizes both parts per row
        (`kernels/fp8_quant.py`). `b` may be another fp8 linear's `raw` output with its bias."""
        lead = a.shape[:-1]
        xq, xs = fp8_quant.rowwise_fp8_gelu_cat(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]),
                                                None, bias_b, gelu_a, gelu_b)
        return self._matmul(xq, xs, a.dtype, lead)

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T without the bias: for a consumer that adds the bias itself (the one-pass
        quantization of the next fp8 linear reads this output once, bias included)."""
        shape = x.shape
        xq, xs = rowwise_fp8(x.reshape(-1, shape[-1]))
        return self._matmul(xq, xs, x.dtype, shape[:-1], bias=False)

    def _matmul(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype, lead, bias: bool = True) -> torch.Tensor:
        # b must be column-major: the transpose of the row-major (out, in) weight is.
        out_dtype = dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        y = torch_compat.scaled_mm(xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale,
                                   out_dtype=out_dtype, use_fast_accum=self.fast_accum)
        if bias and self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 rowwise"
                + (", fast accumulation" if self.fast_accum else "") + (", GELU of the input fused" if self.input_gelu else ""))


class _RawUp(nn.Module):
    """A FeedForward's up projection without its bias, whose output the down projection's
    one-pass quantization reads (adding this bias and the GELU there)."""

    def __init__(self, up: Fp8Linear):
        super().__init__()
        self.up = up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up.raw(x)


def eligible(linear: nn.Module) -> bool:
    """The fp8 GEMM needs both matrix dims to be multiples of 16."""
    return type(linear) is nn.Linear and linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def fuse_feedforward_gelu(root: nn.Module, fusions: list) -> int:
    """In every diffusers-style FeedForward under `root` whose net is [GELU(tanh) with its `proj`,
    Dropout(0), fp8 linear(, Dropout(0))], move the GELU into the down projection's one-pass
    quantization: net[0] becomes the bare up projection, the down projection's `input_gelu` is
    set (with an fp8 up projection, its bias is added there too: its raw output is read once).
    Same function; the GELU output is quantized from fp32 instead of bf16. Appends
    (FeedForward.net, its GELU, down projection) to `fusions` (the undo); returns how many."""
    n = 0
    for m in root.modules():
        net = getattr(m, "net", None)
        if not isinstance(net, nn.ModuleList) or len(net) not in (3, 4):
            continue
        act, drops, down = net[0], [net[1], *list(net)[3:]], net[2]
        if not (type(act).__name__ == "GELU" and getattr(act, "approximate", None) == "tanh"
                and isinstance(getattr(act, "proj", None), nn.Module) and isinstance(down, Fp8Linear)
                and all(isinstance(d, nn.Dropout) and d.p == 0 for d in drops)):
            continue
        up = act.proj
        fusions.append((net, act, down))
        net[0] = _RawUp(up) if isinstance(up, Fp8Linear) else up
        down.input_gelu = True
        down.input_bias = up.bias if isinstance(up, Fp8Linear) else None
        n += 1
    return n


def unfuse_feedforward_gelu(fusions: list) -> None:
    """Undo `fuse_feedforward_gelu` (last first)."""
    for net, act, down in reversed(fusions):
        net[0] = act
        down.input_gelu, down.input_bias = False, None


def reference_linear(x: torch.Tensor, linear: Fp8Linear) -> torch.Tensor:
    """What an Fp8Linear computes, in fp32 from the dequantized operands (for tests)."""
    xq, xs = rowwise_fp8(x.reshape(-1, x.shape[-1]))
    y = F.linear(xq.float() * xs, linear.weight, None if linear.bias is None else linear.bias.float())
    return y.reshape(*x.shape[:-1], -1)
