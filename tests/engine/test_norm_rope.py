"""Wan's, Flux's, FLUX.2's and Qwen-Image's q/k RMSNorm + rotary embedding in one pass (`magi_zoo::rms_norm_rope`, the precision
section's `fuse_norm_rope`, the Wan adapter's attention processor): the op's definition against
diffusers' own processor, the model path (op calls per forward, exact on CPU, undo, the switch
off), shape errors, and (GPU) the Triton kernel against the definition."""

from __future__ import annotations

import warnings

import pytest
import torch

import magi_zoo
from magi_zoo.adapters.wan import attention as wan_attention
from magi_zoo.engine import counters
from magi_zoo.engine.kernels import norm_rope
from magi_zoo.engine.precision import NORM_ROPE_MARK
from magi_zoo.overrides import spec_layers

from helpers.fusion import assert_undone_exactly, count_calls, forward


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
    # not repeated per pair (diffusers' Wan tables are): every channel its own angle, so a kernel
    # that read cos[2j + 1] or sin[2j] where the definition reads cos[2j] and sin[2j + 1] fails
    ang = torch.rand(1, s, 1, d, device=device, generator=g) * 6.28
    return x, w, torch.cos(ang), torch.sin(ang)


@pytest.mark.gpu
@pytest.mark.parametrize("b, s, heads, d", [(1, 300, 12, 128), (2, 77, 40, 128), (1, 5, 2, 32), (1, 9, 3, 96)])
def test_triton_kernel_equals_the_definition(b, s, heads, d):
    x, w, cos, sin = _rope_inputs(b, s, heads, d, "cuda")
    got = norm_rope.rms_norm_rope(x, w, 1e-6, cos, sin, heads)
    want = norm_rope.reference(x, w, 1e-6, cos, sin, heads)
    fp32 = norm_rope.reference(x.float(), w.float(), 1e-6, cos, sin, heads)
    assert got.shape == (b, s, heads, d) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # no rounding between norm and rotation: at least as close to fp32 as the unfused path
    assert _rel(got, fp32) <= _rel(want, fp32) * 1.05 + 1e-5
    # no norm weight (padded heads and channels masked the same way)
    torch.testing.assert_close(norm_rope.rms_norm_rope(x, None, 1e-6, cos, sin, heads),
                               norm_rope.reference(x, None, 1e-6, cos, sin, heads), rtol=2e-2, atol=2e-2)


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


# -- Flux: per-head norm + join + rope (magi_zoo::rms_norm_rope_heads) ----------------------

FLUX_BLOCKS = ("FluxTransformerBlock", "FluxSingleTransformerBlock")


def _flux_plan(**fields):
    # gelu_epilogue off: the split proj_out rounds differently, and this checks the norm + rope alone
    return {"compile": {"": False}, "precision": {b: dict(gelu_epilogue=False, **fields) for b in FLUX_BLOCKS}}


def _flux2_plan(**fields):
    return {"compile": {"": False},
            "precision": {b: dict(fields) for b in ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")}}


def _qwen_plan(**fields):
    # gelu_epilogue off: this checks the norm + rope alone
    return {"compile": {"": False}, "precision": {"QwenImageTransformerBlock": dict(gelu_epilogue=False, **fields)}}


# The models whose joint attention runs on the per-head op: (tiny model, plan of the fusion's
# switches, how many layers it fuses once block 0's norms differ, tolerance against diffusers'
# processor: Flux's op is diffusers' math op for op on CPU, Qwen-Image's rotation is not complex)
JOINT = [("flux-tiny", _flux_plan, lambda tr: len(tr.transformer_blocks) - 1 + len(tr.single_transformer_blocks), 0.0),
         ("flux.2-tiny", _flux2_plan, lambda tr: len(tr.transformer_blocks) - 1 + len(tr.single_transformer_blocks),
          0.0),
         ("qwen-image-tiny", _qwen_plan, lambda tr: len(tr.transformer_blocks) - 1, 1e-5)]


@pytest.mark.parametrize("name, plan", [c[:2] for c in JOINT], ids=[c[0] for c in JOINT])
def test_joint_fuse_norm_rope_false_keeps_diffusers_path(name, plan, monkeypatch):
    h = magi_zoo.load(name, gpu="cpu", compile=False)
    rep = magi_zoo.apply(h.modules, plan(fuse_norm_rope=False), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    assert "RoPE in one pass" not in rep.step("precision").did
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
    forward(h)
    assert calls == []


@pytest.mark.parametrize("name, plan, fused, tol", JOINT, ids=[c[0] for c in JOINT])
def test_joint_norms_of_different_eps_take_the_class_path(name, plan, fused, tol, monkeypatch):
    """The op takes one eps: a layer whose norms differ is not fused (diffusers' own call), the
    others are, and the output is diffusers'."""
    h = magi_zoo.load(name, gpu="cpu", compile=False)
    tr = h.pipe.transformer
    tr.transformer_blocks[0].attn.norm_added_k.eps = 1e-3
    ref = forward(h)
    magi_zoo.apply(h.modules, plan(), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
    out = forward(h)
    assert len(calls) == 2 * fused(tr)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


# Flux.1's and FLUX.2's processors: (tiny model, plan, the fused processor classes' names)
FLUX_STYLE = [("flux-tiny", _flux_plan, {"NormRopeFluxAttnProcessor"}),
              ("flux.2-tiny", _flux2_plan, {"NormRopeFlux2AttnProcessor", "NormRopeFlux2ParallelSelfAttnProcessor"})]


@pytest.mark.parametrize("name, plan, classes", FLUX_STYLE, ids=[c[0] for c in FLUX_STYLE])
def test_flux_attention_runs_fused_exactly_and_undoes(name, plan, classes, monkeypatch):
    """Every double and single block's q and k through the op, diffusers' output bit for bit on
    CPU (the op's definition is diffusers' math, op for op), and `remove` undoes it exactly."""
    h = magi_zoo.load(name, gpu="cpu", compile=False)
    tr = h.pipe.transformer
    ref = forward(h)
    originals = [m.processor for m in tr.modules() if hasattr(m, "processor")]
    rep = magi_zoo.apply(h.modules, plan(), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    layers = len(tr.transformer_blocks) + len(tr.single_transformer_blocks)
    assert "magi_zoo::rms_norm_rope_heads" in rep.step("prepare").did
    did = rep.step("precision").did
    assert f"({len(tr.transformer_blocks)} attention layer(s) whose processor fuses them)" in did
    assert f"({len(tr.single_transformer_blocks)} attention layer(s) whose processor fuses them)" in did
    assert {type(m.processor).__name__ for m in tr.modules() if hasattr(m, "processor")} == classes
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
    out = forward(h)
    assert len(calls) == 2 * layers  # q and k of every double and single block
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # on CPU the op is diffusers' math, op for op
    procs = lambda: [m.processor for m in tr.modules() if hasattr(m, "processor")]
    assert_undone_exactly(h, ref, calls, lambda: [m for m in tr.modules() if NORM_ROPE_MARK in m.__dict__]
                          + [p for p, o in zip(procs(), originals) if p is not o])


def test_flux2_single_block_fuses_with_a_split_of_diffusers_shape(monkeypatch):
    """The single block's fused processor splits q, k, v and the MLP's input by diffusers' ratio:
    its output equals diffusers' processor's on the same layer, and a call without a rotary
    embedding is the class's own (no op call)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2ParallelSelfAttnProcessor

    h = magi_zoo.load("flux.2-tiny", gpu="cpu", compile=False)
    attn = h.pipe.transformer.single_transformer_blocks[0].attn
    magi_zoo.apply(h.modules, _flux2_plan(), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    fused = attn.processor
    x = torch.randn(1, 7, attn.query_dim)
    ang = torch.rand(7, attn.head_dim // 2)
    rope = (torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1))
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
    with torch.inference_mode():
        got = fused(attn, x, image_rotary_emb=rope)
        want = Flux2ParallelSelfAttnProcessor()(attn, x, image_rotary_emb=rope)
        assert len(calls) == 2
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        fused(attn, x, image_rotary_emb=None)
    assert len(calls) == 2


def test_processor_swap_leaves_a_users_own_processor_alone():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class Mine(FluxAttnProcessor):  # e.g. an IP-adapter's: not ours to replace
        pass

    h = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    attn = h.pipe.transformer.transformer_blocks[0].attn
    mine = attn.processor = Mine()
    other = h.pipe.transformer.transformer_blocks[1].attn
    undo = h.adapter.preparations(h.pipe)[-1].install(h.pipe)
    assert attn.processor is mine and type(other.processor).__name__ == "NormRopeFluxAttnProcessor"
    undo()
    assert type(other.processor) is FluxAttnProcessor


def test_heads_op_refuses_shapes_it_cannot_join_or_rotate():
    x, w = torch.randn(1, 4, 2, 8), torch.ones(8)
    cs = torch.ones(4, 8)
    with pytest.raises(ValueError, match="even head_dim"):
        norm_rope.rms_norm_rope_heads(torch.randn(1, 4, 2, 7), None, None, None, 1e-6, torch.ones(4, 7),
                                      torch.ones(4, 7))
    with pytest.raises(ValueError, match="the prefix must be"):
        norm_rope.rms_norm_rope_heads(x, w, torch.randn(1, 3, 4, 8), w, 1e-6, torch.ones(7, 8), torch.ones(7, 8))
    with pytest.raises(ValueError, match="both norm weights or neither"):
        norm_rope.rms_norm_rope_heads(x, w, torch.randn(1, 3, 2, 8), None, 1e-6, torch.ones(7, 8), torch.ones(7, 8))
    with pytest.raises(ValueError, match="head_dim=8 values"):
        norm_rope.rms_norm_rope_heads(x, torch.ones(16), None, None, 1e-6, cs, cs)
    with pytest.raises(ValueError, match=r"prefix \+ tokens=7"):
        norm_rope.rms_norm_rope_heads(x, w, torch.randn(1, 3, 2, 8), w, 1e-6, cs, cs)  # cos covers x only


def test_heads_training_takes_the_differentiable_definition():
    norm, pnorm = torch.nn.RMSNorm(8, eps=1e-6), torch.nn.RMSNorm(8, eps=1e-6)
    x = torch.randn(1, 4, 2, 8, requires_grad=True)
    prefix = torch.randn(1, 3, 2, 8)
    ang = torch.rand(7, 4)
    rope = (torch.cos(ang).repeat_interleave(2, -1), torch.sin(ang).repeat_interleave(2, -1))
    out = norm_rope.apply_heads(x, norm, rope, prefix, pnorm)
    out.square().sum().backward()
    assert x.grad is not None and norm.weight.grad is not None and pnorm.weight.grad is not None
    with torch.no_grad():  # inference: the op, same values
        torch.testing.assert_close(norm_rope.apply_heads(x, norm, rope, prefix, pnorm), out.detach(), rtol=0, atol=0)


def _heads_inputs(b, t, s, heads, d, device, dtype=torch.bfloat16):
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(b, s, heads * d, device=device, generator=g) * 3 + 0.5).to(dtype).unflatten(-1, (heads, d))
    p = (torch.randn(b, t, heads * d, device=device, generator=g) * 2 - 0.3).to(dtype).unflatten(-1, (heads, d))
    w = (1 + 0.1 * torch.randn(d, device=device, generator=g)).to(dtype)
    pw = (1 + 0.1 * torch.randn(d, device=device, generator=g)).to(dtype)
    # Flux's tables: cos/sin of each pair repeated, fp32; a second set that is not repeated
    # checks the kernel reads every channel's own entry, as diffusers' formula does
    ang = torch.rand(t + s, d, device=device, generator=g) * 6.28
    return x, w, p, pw, torch.cos(ang), torch.sin(ang)


@pytest.mark.gpu
@pytest.mark.parametrize("b, t, s, heads, d", [(1, 512, 4096, 24, 128), (1, 0, 4608, 24, 128), (2, 3, 5, 2, 16),
                                               (1, 7, 33, 3, 96)])
def test_heads_triton_kernel_equals_the_definition(b, t, s, heads, d):
    x, w, p, pw, cos, sin = _heads_inputs(b, t, s, heads, d, "cuda")
    p, pw = (p, pw) if t else (None, None)
    got = norm_rope.rms_norm_rope_heads(x, w, p, pw, 1e-6, cos, sin)
    want = norm_rope.reference_heads(x, w, p, pw, 1e-6, cos, sin)
    fp32 = norm_rope.reference_heads(x.float(), w.float(), None if p is None else p.float(),
                                     None if pw is None else pw.float(), 1e-6, cos, sin)
    assert got.shape == (b, t + s, heads, d) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert _rel(got, fp32) <= _rel(want, fp32) * 1.05 + 1e-5
    # strided inputs (fused-projection views) and no weights
    wide = torch.cat([x.flatten(2), x.flatten(2)], dim=-1)[..., : heads * d].unflatten(-1, (heads, d))
    torch.testing.assert_close(norm_rope.rms_norm_rope_heads(wide, None, None, None, 1e-6, cos[t:], sin[t:]),
                               norm_rope.reference_heads(x, None, None, None, 1e-6, cos[t:], sin[t:]),
                               rtol=2e-2, atol=2e-2)


def test_compiled_flux_with_the_fusions_equals_eager_without_breaks(fresh_dynamo, monkeypatch):
    h = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    ref = forward(h)
    before = counters.snapshot()  # the shipped plan for the cpu profile: inductor, both fusions on
    rep = magi_zoo.apply(h.modules, layers=spec_layers(h.adapter, magi_zoo.get_profile("cpu")), gpu="cpu",
                         preparations=h.adapter.preparations(h.pipe))
    assert "RoPE in one pass" in rep.step("precision").did and "GELU in the GEMM epilogue" in rep.step("precision").did
    out = forward(h)
    counters.expect(counters.delta(before), frames=2, breaks=0, recompiles=0)  # one per block class
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_flux_split_proj_out_only_for_a_plain_linear(monkeypatch):
    from magi_zoo.adapters.flux import single_blocks

    lin = torch.nn.Linear(12, 5)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 8)
    torch.testing.assert_close(single_blocks._split_linear(lin, a, b), lin(torch.cat([a, b], -1)),
                               rtol=1e-5, atol=1e-5)
    assert single_blocks._plain_linear(lin)
    handle = lin.register_forward_pre_hook(lambda m, args: None)  # e.g. an offload hook: call the module
    assert not single_blocks._plain_linear(lin)
    handle.remove()
    h = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    plan = {"compile": {"": False}, "precision": {b: {} for b in FLUX_BLOCKS}}  # gelu_epilogue on
    magi_zoo.apply(h.modules, plan, gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    split = []
    real = single_blocks._split_linear
    monkeypatch.setattr(single_blocks, "_split_linear", lambda *a: split.append(1) or real(*a))
    forward(h)
    assert len(split) == len(h.pipe.transformer.single_transformer_blocks)


# -- Qwen-Image: diffusers' RMSNorm, a complex rotary table, the text mask -----------------------

def _qwen_fused(h):
    return [m for m in h.pipe.transformer.modules()
            if type(getattr(m, "processor", None)).__name__ == "NormRopeQwenAttnProcessor"]


def test_qwen_image_attention_runs_fused_and_undoes(monkeypatch):
    """The processor's real-arithmetic rotation of the joint sequence equals diffusers' complex
    one (fp32 on CPU: the op's definition), two op calls per block, and `remove` undoes it exactly."""
    h = magi_zoo.load("qwen-image-tiny", gpu="cpu", compile=False)
    tr = h.pipe.transformer
    ref = forward(h)
    rep = magi_zoo.apply(h.modules, _qwen_plan(), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    blocks = len(tr.transformer_blocks)
    assert "magi_zoo::rms_norm_rope_heads" in rep.step("prepare").did
    assert f"({blocks} attention layer(s) whose processor fuses them)" in rep.step("precision").did
    assert len(_qwen_fused(h)) == blocks
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
    out = forward(h)
    assert len(calls) == 2 * blocks  # q and k of every block, text joined in front
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_undone_exactly(h, ref, calls, lambda: [m for m in tr.modules() if NORM_ROPE_MARK in m.__dict__]
                          + _qwen_fused(h))


def test_qwen_image_masked_batch_and_bf16_take_the_fused_path(monkeypatch):
    """A batch of prompts of different lengths (the text mask diffusers' processor turns into the
    joint mask) in bf16: fused, and equal to diffusers' processor within bf16 rounding."""
    h = magi_zoo.load("qwen-image-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant, batch=2, text_len=8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    kw["encoder_hidden_states_mask"] = mask
    with torch.inference_mode():
        ref = h.pipe.transformer(**kw)[0]
        unmasked = h.pipe.transformer(**{**kw, "encoder_hidden_states_mask": None})[0]
    magi_zoo.apply(h.modules, _qwen_plan(), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    calls = count_calls(monkeypatch, norm_rope, "rms_norm_rope_heads")
    with torch.inference_mode():
        out = h.pipe.transformer(**kw)[0]
    assert len(calls) == 2 * len(h.pipe.transformer.transformer_blocks)
    assert _rel(out, ref) < 1e-2 < _rel(unmasked, ref)  # the mask mattered, and the fused path kept it


def test_rms_norm_width_reads_torch_and_diffusers_norms():
    from diffusers.models.normalization import RMSNorm

    from magi_zoo.engine.precision.fusions import rms_norm_width

    assert rms_norm_width(torch.nn.RMSNorm(64)) == 64
    assert rms_norm_width(torch.nn.RMSNorm((4, 64))) is None  # over two dims: not the kernels' norm
    assert rms_norm_width(RMSNorm(128, eps=1e-6)) == 128
    assert rms_norm_width(RMSNorm(128, eps=1e-6, elementwise_affine=False)) == 128
    assert rms_norm_width(RMSNorm(128, eps=1e-6, bias=True)) is None  # the kernels add no bias
    assert rms_norm_width(torch.nn.LayerNorm(128)) is None


def test_compiled_qwen_image_with_the_fusion_equals_eager_without_breaks(fresh_dynamo):
    h = magi_zoo.load("qwen-image-tiny", gpu="cpu", compile=False)
    ref = forward(h)
    before = counters.snapshot()  # the shipped plan for the cpu profile: inductor, the fusion on
    rep = magi_zoo.apply(h.modules, layers=spec_layers(h.adapter, magi_zoo.get_profile("cpu")), gpu="cpu",
                         preparations=h.adapter.preparations(h.pipe))
    assert "RoPE in one pass" in rep.step("precision").did
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = forward(h)
    counters.expect(counters.delta(before), frames=1, breaks=0, recompiles=0)  # one graph for the block class
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # diffusers' complex rotation is what inductor cannot generate code for (it warns, and runs it eager)
    assert not [w for w in caught if "complex operators" in str(w.message)]
