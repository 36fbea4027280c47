"""Wan's q/k RMSNorm + rotary embedding in one pass (`magi_zoo::rms_norm_rope`, the precision
section's `fuse_norm_rope`, the Wan adapter's attention processor): the op's definition against
diffusers' own processor, the model path (op calls per forward, exact on CPU, undo, the switch
off), shape errors, and (GPU) the Triton kernel against the definition."""

from __future__ import annotations

import pytest
import torch

import magi_zoo
from magi_zoo.adapters import wan_attention
from magi_zoo.engine.kernels import norm_rope
from magi_zoo.engine.precision import NORM_ROPE_MARK

from fusion_helpers import assert_undone_exactly, count_calls, forward


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _plan(**fields):
    return {"compile": {"": False}, "precision": {"WanTransformerBlock": fields}}


def test_wan_self_attention_runs_fused_exactly_and_undoes(monkeypatch):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    tr = h.pipe.transformer
    ref = forward(h)
    originals = [m.processor for m in tr.modules() if type(m).__name__ == "WanAttention"]
    rep = magi_zoo.apply(h.modules, _plan(), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    assert "fused q/k norm + rope" in rep.step("prepare").did
    n_blocks = len(tr.blocks)
    # attn1 and attn2 of each block carry the processor; it fuses only where a rotary embedding
    # follows: self-attention
    assert f"({2 * n_blocks} attention layer(s) whose processor fuses them)" in rep.step("precision").did
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope")
    out = forward(h)
    assert len(calls) == 2 * n_blocks  # q and k of each self-attention; cross-attention stays the class's
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # on CPU the op is diffusers' math, op for op
    assert_undone_exactly(h, ref, calls, lambda: [m for m in tr.modules() if NORM_ROPE_MARK in m.__dict__]
                          + [p for p, o in zip([m.processor for m in tr.modules()
                                                if type(m).__name__ == "WanAttention"], originals) if p is not o])


def test_fuse_norm_rope_false_keeps_diffusers_path(monkeypatch):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    rep = magi_zoo.apply(h.modules, _plan(fuse_norm_rope=False), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    assert "RoPE in one pass" not in rep.step("precision").did
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope")
    forward(h)
    assert calls == []


def test_processor_keeps_the_state_of_the_one_it_replaces():
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    attn = h.pipe.transformer.blocks[0].attn1
    attn.processor._attention_backend = "sentinel"
    prep = h.adapter.preparations(h.pipe)[0]
    undo = prep.install(h.pipe)
    assert type(attn.processor).__name__ == "NormRopeWanAttnProcessor"
    assert attn.processor._attention_backend == "sentinel"
    undo()
    assert type(attn.processor).__name__ == "WanAttnProcessor"


def test_op_refuses_shapes_it_cannot_rotate():
    x, w = torch.randn(1, 4, 12), torch.ones(12)
    cos = torch.ones(1, 4, 1, 6)
    with pytest.raises(ValueError, match="even head_dim"):
        norm_rope.rms_norm_rope(x, w, 1e-6, cos, cos, 4)  # head_dim 3
    with pytest.raises(ValueError, match="one per channel"):
        norm_rope.rms_norm_rope(x, torch.ones(6), 1e-6, cos, cos, 2)
    with pytest.raises(ValueError, match="end in head_dim=6"):
        norm_rope.rms_norm_rope(x, w, 1e-6, torch.ones(1, 4, 1, 4), torch.ones(1, 4, 1, 4), 2)
    assert not wan_attention.fusable(object(), torch.ones(1), None)  # cross-attention: the class path


def _rope_inputs(b, s, heads, d, device, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(b, s, heads * d, device=device, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(heads * d, device=device, generator=g)).to(dtype)
    ang = torch.rand(1, s, 1, d // 2, device=device, generator=g) * 6.28
    cos = torch.cos(ang).repeat_interleave(2, -1)
    sin = torch.sin(ang).repeat_interleave(2, -1)
    return x, w, cos, sin


@pytest.mark.gpu
@pytest.mark.parametrize("b, s, heads, d", [(1, 300, 12, 128), (2, 77, 40, 128), (1, 5, 2, 32)])
def test_triton_kernel_equals_the_definition(b, s, heads, d):
    x, w, cos, sin = _rope_inputs(b, s, heads, d, "cuda")
    got = norm_rope.rms_norm_rope(x, w, 1e-6, cos, sin, heads)
    want = norm_rope.reference(x, w, 1e-6, cos, sin, heads)
    fp32 = norm_rope.reference(x.float(), w.float(), 1e-6, cos, sin, heads)
    assert got.shape == (b, s, heads, d) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # no rounding between norm and rotation: at least as close to fp32 as the unfused path
    assert _rel(got, fp32) <= _rel(want, fp32) * 1.05 + 1e-5


def test_training_takes_the_differentiable_definition():
    norm = torch.nn.RMSNorm(12, eps=1e-6)
    x = torch.randn(1, 4, 12, requires_grad=True)
    ang = torch.rand(1, 4, 1, 3)
    cos, sin = torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1)
    out = norm_rope.apply(x, norm, (cos, sin), 2)
    out.square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():  # inference: the op, same values
        torch.testing.assert_close(norm_rope.apply(x, norm, (cos, sin), 2), out.detach(), rtol=0, atol=0)
