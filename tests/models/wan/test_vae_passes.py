"""The Wan VAE's passes (adapters/wan/vae.py) and the channel RMSNorm + SiLU op
(`magi_zoo::channel_rms_norm_act`, the precision section's `fuse_norm_act`): the op's definition
against diffusers' own modules, the VAE through the plan (op calls, equal decode and encode,
undo), the switch off, fp8 leaving the VAE alone, and (GPU) the Triton kernel against the
definition in both layouts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.adapters.wan import vae as wan_vae_passes
from magi_zoo.engine import NORM_ACT_PAIRS
from magi_zoo.engine.kernels import channel_norm
from magi_zoo.overrides import fp8_region_keys, spec_layers, with_precision
from magi_zoo.specs import get_profile

from helpers.fusion import count_calls

PLAN = {"compile": {"": False}, "precision": {"vae": {"fuse_norm_act": True}}}


def _wan_vae_module():
    # lazy: diffusers costs seconds; the module is imported by the first load in each test
    from diffusers.models.autoencoders import autoencoder_kl_wan
    return autoencoder_kl_wan


def _latents(vae, frames=3, side=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, vae.config.z_dim, frames, side, side, generator=g)


def _decode_encode(vae, z):
    with torch.inference_mode():
        video = vae.decode(z, return_dict=False)[0]
        return video, vae.encode(video.clamp(-1, 1)).latent_dist.mode()


def _leftovers(vae):
    """Anything the preparation or the fusion left on the VAE's modules."""
    return [n for n, m in vae.named_modules()
            if "forward" in m.__dict__ or NORM_ACT_PAIRS in m.__dict__
            or type(getattr(m, "nonlinearity", nn.SiLU())) is not nn.SiLU]


@pytest.mark.parametrize("images, bias, silu", [(False, False, True), (False, True, True), (True, False, False)])
def test_op_definition_is_diffusers_norm_then_silu(images, bias, silu):
    norm = _wan_vae_module().WanRMS_norm(6, images=images, bias=bias)
    with torch.no_grad():
        norm.gamma.normal_(1, 0.2)
        if bias:
            norm.bias.normal_(0, 0.2)
    x = torch.randn(2, 6, 4, 5) if images else torch.randn(2, 6, 3, 4, 5)
    for dtype in (torch.float32, torch.bfloat16):
        n, xx = norm.to(dtype), x.to(dtype)
        want = nn.functional.silu(n(xx)) if silu else n(xx)
        got = channel_norm.channel_rms_norm_act(xx, n.gamma, n.bias if bias else None, n.scale, 1e-12, silu)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # on CPU the op is diffusers' math, op for op


def test_op_refuses_shapes_it_cannot_normalise():
    with pytest.raises(ValueError, match="one value per channel"):
        channel_norm.channel_rms_norm_act(torch.randn(1, 4, 2, 2), torch.ones(3), None, 2.0, 1e-12, True)
    with pytest.raises(ValueError, match="batch, channels"):
        channel_norm.channel_rms_norm_act(torch.randn(4, 2), torch.ones(2), None, 2.0, 1e-12, True)


def test_vae_runs_fused_exactly_and_undoes(monkeypatch):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    vae = h.pipe.vae
    z = _latents(vae)
    ref_video, ref_latents = _decode_encode(vae, z)
    rep = magi_zoo.apply(h.modules, PLAN, gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    assert "Wan VAE passes" in rep.step("prepare").did
    wan = _wan_vae_module()
    pairs = {id(getattr(m, n)) for m in vae.modules() if type(m) in (wan.WanResidualBlock, wan.WanEncoder3d,
                                                                      wan.WanDecoder3d)
             for n in (("norm1", "norm2") if type(m) is wan.WanResidualBlock else ("norm_out",))}
    assert f"channel RMSNorm + SiLU in one pass on vae ({len(pairs)} norm(s))" in rep.step("precision").did
    assert rep.step("precision").details["norm_act_fusions"] == len(pairs)
    # the attention block's norm (no SiLU after it) keeps the class's forward
    assert all("forward" not in m.__dict__ for m in vae.modules()
               if type(m) is wan.WanRMS_norm and id(m) not in pairs)
    calls = count_calls(monkeypatch, channel_norm, "channel_rms_norm_act")
    video, latents = _decode_encode(vae, z)
    frames = z.shape[2]
    decoder_norms = sum(id(m) in pairs for m in vae.decoder.modules())
    assert len(calls) >= decoder_norms * frames  # every fused norm, every decoded frame
    torch.testing.assert_close(video, ref_video, rtol=0, atol=1e-6)
    torch.testing.assert_close(latents, ref_latents, rtol=0, atol=1e-6)
    magi_zoo.remove(h.modules)
    assert not _leftovers(vae), _leftovers(vae)
    calls.clear()
    video, latents = _decode_encode(vae, z)
    assert calls == []
    torch.testing.assert_close(video, ref_video, rtol=0, atol=0)


def test_fuse_norm_act_false_keeps_the_norms_and_the_silu(monkeypatch):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    rep = magi_zoo.apply(h.modules, {"compile": {"": False}, "precision": {"vae": {"fuse_norm_act": False}}},
                         gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    assert "SiLU" not in rep.step("precision").did
    calls = count_calls(monkeypatch, channel_norm, "channel_rms_norm_act")
    _decode_encode(h.pipe.vae, _latents(h.pipe.vae))
    assert calls == []
    assert all(type(m.nonlinearity) is nn.SiLU for m in h.pipe.vae.modules() if hasattr(m, "nonlinearity"))


def test_a_pairing_that_does_not_hold_is_left_as_built():
    """A declared block whose activation is not a SiLU (a user's change) keeps its modules."""
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    block = next(m for m in h.pipe.vae.modules() if type(m) is _wan_vae_module().WanResidualBlock)
    block.nonlinearity = nn.GELU()
    rep = magi_zoo.apply(h.modules, PLAN, gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    assert type(block.nonlinearity) is nn.GELU and "forward" not in block.norm1.__dict__
    assert rep.step("precision").details["norm_act_fusions"] > 0  # the other blocks still fuse


def test_upsampling_in_the_vae_dtype_keeps_the_bits():
    up = _wan_vae_module().WanUpsample(scale_factor=(2.0, 2.0), mode="nearest-exact")
    x = torch.randn(2, 3, 5, 7).to(torch.bfloat16)
    torch.testing.assert_close(wan_vae_passes._upsample_forward(up)(x), up(x), rtol=0, atol=0)


def test_causal_conv_pads_inside_the_convolution():
    """Every cache case of WanCausalConv3d (none, one frame, two frames) and a 1x1x1 conv."""
    wan = _wan_vae_module()
    g = torch.Generator().manual_seed(1)
    for conv in (wan.WanCausalConv3d(4, 5, 3, padding=1), wan.WanCausalConv3d(4, 5, 1),
                 wan.WanCausalConv3d(4, 8, (3, 1, 1), padding=(1, 0, 0))):
        fast = wan_vae_passes._conv_forward(conv)
        x = torch.randn(1, 4, 2, 6, 7, generator=g)
        for cache in (None, torch.randn(1, 4, 1, 6, 7, generator=g), torch.randn(1, 4, 2, 6, 7, generator=g)):
            torch.testing.assert_close(fast(x, cache), conv(x, cache), rtol=1e-6, atol=1e-6)


def test_fp8_leaves_a_fusion_only_region_as_built():
    """`vae` is listed in wan.toml's precision section for its fusion only: precision='fp8'
    flips the blocks, not the VAE."""
    from magi_zoo import adapters

    adapter, _ = adapters.lookup("wan2.1-tiny")
    layers = spec_layers(adapter, get_profile("h100"))
    assert fp8_region_keys(layers) == ["WanTransformerBlock"]
    assert "vae" in [k for _, layer in layers for k in layer.entries("precision")]
    top = with_precision(layers, "fp8")[-1][1].entries("precision")
    assert set(top) == {"WanTransformerBlock"}


def test_self_forcing_streaming_decode_with_the_passes_equals_as_built():
    h = magi_zoo.load("self-forcing-tiny", gpu="cpu", compile=False)
    call = dict(height=32, width=32, num_frames=9, max_sequence_length=16, seed=3)
    ref = h(prompt="a corgi", **call)
    magi_zoo.apply(h.modules, {"compile": {"": False}, "precision": {"vae": {"fuse_norm_act": True}}},
                   gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    got = h(prompt="a corgi", **call)
    torch.testing.assert_close(torch.as_tensor(got.frames), torch.as_tensor(ref.frames), rtol=0, atol=1e-6)


# -- GPU: the Triton kernel -------------------------------------------------------------------


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 96, 2, 30, 52), (1, 384, 1, 15, 26), (2, 20, 3, 7, 5), (1, 192, 4, 8)])
@pytest.mark.parametrize("layout", ["standard", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_equals_the_definition(shape, layout, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    c = shape[1]
    x = (torch.randn(shape, device="cuda", generator=g) * 3 + 0.5).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)
    gamma = (1 + 0.1 * torch.randn(c, 1, 1, 1, device="cuda", generator=g)).to(dtype)
    bias = (0.1 * torch.randn(c, 1, 1, 1, device="cuda", generator=g)).to(dtype)
    for b in (None, bias):
        for silu in (True, False):
            got = channel_norm.channel_rms_norm_act(x, gamma, b, c ** 0.5, 1e-12, silu)
            want = channel_norm.reference(x, gamma, b, c ** 0.5, 1e-12, silu)
            fp32 = channel_norm.reference(x.float(), gamma.float(), None if b is None else b.float(), c ** 0.5,
                                          1e-12, silu)
            assert got.stride() == x.stride() and got.dtype == x.dtype
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            # one rounding, at the end: at least as close to fp32 as diffusers' composite
            assert _rel(got, fp32) <= _rel(want, fp32) * 1.05 + 1e-6


@pytest.mark.gpu
def test_published_width_vae_decode_fused_against_fp32(monkeypatch):
    """The Wan2.1 VAE at its published widths (random weights), a 480x832-sized crop of latent
    frames, channels-last as the plans run it: fused in bf16 is at least as close to the fp32
    decode as diffusers' bf16 decode, and fused in fp32 equals it to float rounding."""
    from diffusers import AutoencoderKLWan

    from magi_zoo.adapters.wan.config import VAE

    torch.manual_seed(0)
    # fp32 convolutions in fp32: cuDNN's default TF32 rounds each product's inputs to 10 bits, and
    # the two paths pick different kernels (padded input vs padding inside the convolution), which
    # through 30 convolutions of random weights left them 6.5e-3 apart at 8ff617c on an H100
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    vae = AutoencoderKLWan(**VAE).cuda().eval()
    vae16 = copy.deepcopy(vae).to(torch.bfloat16)  # a copy: a round trip through bf16 would round the weights
    z = torch.randn(1, 16, 3, 30, 52, device="cuda")
    plan = {"compile": {"": {"enabled": False}}, "memory_format": {"": True}}
    fused_plan = {**plan, "precision": {"": {"fuse_norm_act": True}}}
    out = {}
    for name, model, zz in (("fp32", vae, z), ("bf16", vae16, z.bfloat16())):
        magi_zoo.apply(model, plan, gpu="auto")
        with torch.no_grad():
            out[name] = model.decode(zz, return_dict=False)[0]
        magi_zoo.remove(model)
        magi_zoo.apply(model, fused_plan, gpu="auto", preparations=[wan_vae_passes.vae_preparation(model)])
        with torch.no_grad():
            out[f"fused {name}"] = model.decode(zz, return_dict=False)[0]
        magi_zoo.remove(model)
    assert _rel(out["fused fp32"], out["fp32"]) < 1e-4
    assert _rel(out["fused bf16"], out["fp32"]) <= _rel(out["bf16"], out["fp32"]) * 1.05
