"""One-pass fp8 quantization of GELU outputs (`magi_zoo::rowwise_fp8_gelu_cat`): its
definition, the FeedForward fusion the precision step makes, Flux's single-block proj_out
taking its input in parts, `fuse_gelu = false`, and (GPU) the Triton kernel against the
definition. torch's CPU build runs _scaled_mm, so the model paths run here on the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import magi_zoo
from magi_zoo.engine import remove
from magi_zoo.engine.kernels import fp8_quant
from magi_zoo.engine.precision import Fp8Linear, rowwise_fp8

CPU_FP8 = magi_zoo.get_profile("cpu").model_copy(update={"fp8": True})


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _deq(q, s):
    return q.float() * s


def test_op_is_the_rowwise_quantization_of_the_concatenated_gelu():
    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(7, 48, generator=g), torch.randn(7, 80, generator=g), torch.randn(80, generator=g)
    q, s = fp8_quant.rowwise_fp8_gelu_cat(a, b, None, bias, False, True)
    want_q, want_s = rowwise_fp8(torch.cat([a, F.gelu(b + bias, approximate="tanh")], dim=-1))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (7, 128) and s.shape == (7, 1)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(_deq(q, s), _deq(want_q, want_s), rtol=0, atol=0)
    q1, s1 = fp8_quant.rowwise_fp8_gelu_cat(b, None, bias, None, True, False)  # one part
    w1, ws1 = rowwise_fp8(F.gelu(b + bias, approximate="tanh"))
    torch.testing.assert_close(_deq(q1, s1), _deq(w1, ws1), rtol=0, atol=0)


def test_op_refuses_mismatched_parts_and_biases():
    with pytest.raises(ValueError, match="same rows"):
        fp8_quant.rowwise_fp8_gelu_cat(torch.randn(3, 16), torch.randn(4, 16), None, None, False, True)
    with pytest.raises(ValueError, match="one value per column"):
        fp8_quant.rowwise_fp8_gelu_cat(torch.randn(3, 16), None, torch.randn(8), None, True, False)


def _flux(**precision):
    h = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    spec = {"matmul": "fp8", **precision}
    plan = {"compile": {"": False}, "precision": {"FluxTransformerBlock": spec, "FluxSingleTransformerBlock": spec}}
    return h, plan


def _forward(h):
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    with torch.inference_mode():
        return h.pipe.transformer(**kw)[0]


def test_flux_fp8_fuses_feedforward_gelu_and_single_block_proj_out(monkeypatch):
    h, plan = _flux()
    ref = _forward(h)
    blocks = h.pipe.transformer
    n_double, n_single = len(blocks.transformer_blocks), len(blocks.single_transformer_blocks)
    rep = magi_zoo.apply(h.modules, plan, gpu=CPU_FP8, preparations=h.adapter.preparations(h.pipe))
    did = rep.step("precision").did
    assert f"{2 * n_double} FeedForward GELU(s) quantized in one pass" in did  # ff and ff_context per double block
    assert "fused single-block MLP" in rep.step("prepare").did
    assert "GELU of the input fused" in repr(blocks.transformer_blocks[0].ff)  # the fused module prints
    calls = []
    real = fp8_quant.rowwise_fp8_gelu_cat
    monkeypatch.setattr(fp8_quant, "rowwise_fp8_gelu_cat",
                        lambda *a: calls.append(a[1] is not None) or real(*a))
    fused = _forward(h)
    # per double block: ff and ff_context (one part each); per single block: proj_out in two parts
    assert calls.count(False) == 2 * n_double and calls.count(True) == n_single
    remove(h.modules)
    assert not any(isinstance(m, Fp8Linear) for m in blocks.modules())
    assert all("forward" not in b.__dict__ for b in blocks.single_transformer_blocks)
    torch.testing.assert_close(_forward(h), ref, rtol=0, atol=0)  # undone exactly
    # fp8 rounding only: the fused path quantizes the GELU from fp32, the unfused one from bf16/fp32
    h2, plan2 = _flux(fuse_gelu=False)
    h2.modules.load_state_dict(h.modules.state_dict())
    rep2 = magi_zoo.apply(h2.modules, plan2, gpu=CPU_FP8, preparations=h2.adapter.preparations(h2.pipe))
    assert "quantized in one pass" not in rep2.step("precision").did
    calls.clear()
    unfused = _forward(h2)
    assert calls == []  # fuse_gelu=false: the op is never called
    assert _rel(fused, unfused) < 2e-2 and _rel(fused, ref) < 1e-1


@pytest.mark.gpu
@pytest.mark.parametrize("ka, kb, gelu_a, gelu_b, bias", [
    (3072, 12288, False, True, "b"),   # Flux single block proj_out
    (12288, 0, True, False, "a"),      # a FeedForward's down projection
    (8960, 0, True, False, "a"),       # Wan-1.3B FFN width: split 8,192 + 768 for the kernel
    (13824, 0, True, False, "a"),      # Wan-14B FFN width: kept whole (a split saves no registers)
    (3000, 0, False, False, None),     # split, no GELU, no bias
    (100, 36, True, False, None),      # narrow, odd widths
])
def test_triton_kernel_equals_the_definition(ka, kb, gelu_a, gelu_b, bias):
    g = torch.Generator(device="cuda").manual_seed(0)
    m = 333
    a = torch.randn(m, ka, device="cuda", generator=g).bfloat16() * 3
    b = torch.randn(m, kb, device="cuda", generator=g).bfloat16() * 3 if kb else None
    ba = torch.randn(ka, device="cuda", generator=g).bfloat16() if bias == "a" else None
    bb = torch.randn(kb, device="cuda", generator=g).bfloat16() if bias == "b" else None
    q, s = fp8_quant.rowwise_fp8_gelu_cat(a, b, ba, bb, gelu_a, gelu_b)
    want_q, want_s = fp8_quant.reference(a, b, ba, bb, gelu_a, gelu_b)
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=0)
    # At most one e4m3 step apart: GELU's last bits differ between Triton and torch, so a value
    # near a rounding boundary may round the other way. A step is 2^-3 of the value (3 mantissa
    # bits) for normal numbers, 2^-9 times the row's scale for subnormal ones.
    d = (_deq(q, s) - _deq(want_q, want_s)).abs()
    step = torch.maximum(want_q.float().abs() * want_s * 2 ** -3, want_s * 2 ** -9)
    assert float((d / step).max()) <= 1.0 + 1e-6
    assert _rel(_deq(q, s), _deq(want_q, want_s)) < 1e-2
    assert float((d > 0).float().mean()) < 0.02  # and such flips are rare
