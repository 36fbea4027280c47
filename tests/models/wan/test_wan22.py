"""Wan2.2 adapter: published configs, two experts under one compiled block, the TI2V path."""

import contextlib

import numpy as np
import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo import adapters

TINY = "wan2.2-tiny"  # two experts, switched mid-run
TINY_TI2V = "wan2.2-ti2v-tiny"  # the 5B path: 48-channel VAE latents, per-token timesteps
AOT = {"backend": "aot_eager"}  # cheap backend: inductor numerics are tests/conformance's


def _run(handle, seed=0, **over):
    call = dict(handle.variant.call_defaults, prompt="a corgi surfing")
    call.update(over)
    return handle(generator=torch.Generator().manual_seed(seed), output_type="np", **call).frames


@contextlib.contextmanager
def _block_calls(pipe):
    """Count forwards of each expert's WanTransformerBlocks (pre-hooks sit outside the
    compiled method, so they count compiled and eager calls alike)."""
    counts = {n: 0 for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None}
    hooks = [b.register_forward_pre_hook(lambda *_, n=n: counts.__setitem__(n, counts[n] + 1))
             for n in counts for b in getattr(pipe, n).blocks]
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def eager_frames():
    return _run(magi_zoo.load(TINY, gpu="cpu", compile=False))


def test_published_variants_are_exact_configs():
    from magi_zoo.adapters.wan import VARIANTS as WAN21

    v5 = adapters.lookup("wan2.2-5b")[1]
    assert v5.name == "wan2.2-ti2v-5b" and v5.hub_id == "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    t, vae = v5.config["transformer"], v5.config["vae"]
    # 24 heads x 128 = 3072 hidden, 30 layers, FFN 14336; in/out = the VAE's 48 latent channels
    assert (t["num_attention_heads"] * t["attention_head_dim"], t["num_layers"], t["ffn_dim"]) == (3072, 30, 14336)
    assert t["in_channels"] == t["out_channels"] == vae["z_dim"] == 48
    assert "transformer_2" not in v5.config
    # Wan2.2 VAE: 2x2 pixel patches (3 x 2 x 2 = 12 channels in) then 3 x 2x downsamples = 16x
    assert (vae["in_channels"], vae["patch_size"] * 2 ** 3, vae["scale_factor_spatial"]) == (12, 16, 16)
    assert (vae["base_dim"], vae["decoder_base_dim"], vae["is_residual"]) == (160, 256, True)
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 48
    assert v5.config["pipeline"] == {"expand_timesteps": True} and v5.config["scheduler"]["flow_shift"] == 5.0
    d = v5.call_defaults  # 704 = 44 latent rows x 16; 121 frames = 1 + 4 x 30
    assert (d["height"], d["width"], d["num_frames"], d["num_inference_steps"], d["guidance_scale"]) == (
        704, 1280, 121, 50, 5.0)

    a14 = adapters.lookup("wan2.2")[1]
    assert a14.name == "wan2.2-t2v-a14b" and a14.hub_id == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    hi, lo = a14.config["transformer"], a14.config["transformer_2"]
    # two experts of the Wan2.1-14B shape: 40 heads x 128 = 5120 hidden, 40 layers, FFN 13824
    assert hi == lo == WAN21["wan2.1-t2v-14b"].config["transformer"]
    assert (hi["num_attention_heads"] * hi["attention_head_dim"], hi["num_layers"], hi["ffn_dim"]) == (5120, 40, 13824)
    assert a14.config["vae"] == WAN21["wan2.1-t2v-14b"].config["vae"]  # the Wan2.1 VAE (z 16, 8x)
    # switch at t = 0.875 x 1000 = 875; guidance 4.0 (high noise) / 3.0 (low noise), 40 steps
    assert a14.config["pipeline"] == {"boundary_ratio": 0.875} and a14.config["scheduler"]["flow_shift"] == 3.0
    d = a14.call_defaults
    assert (d["num_frames"], d["num_inference_steps"], d["guidance_scale"], d["guidance_scale_2"]) == (81, 40, 4.0, 3.0)
    models = magi_zoo.list_models()  # Wan2.2's rows follow Wan2.1's, in table order
    i = models.index("wan2.2-ti2v-5b")
    assert models[i - 1] == "wan2.1-tiny" and models[i:i + 4] == ["wan2.2-ti2v-5b", "wan2.2-t2v-a14b", TINY, TINY_TI2V]


@pytest.mark.parametrize("name, shape, timestep, experts", [
    # 121 frames -> 1 + 120/4 = 31 latent frames, 704/16 = 44, 1280/16 = 80; one timestep per
    # 1x2x2 patch token: 31 x 22 x 40 = 27280
    ("wan2.2-ti2v-5b", (1, 48, 31, 44, 80), (1, 27280), 1),
    # 81 frames -> 21 latent frames, 480/8 = 60, 832/8 = 104; one timestep per sample
    ("wan2.2-t2v-a14b", (1, 16, 21, 60, 104), (1,), 2),
])
def test_published_on_meta_inputs_and_spec(name, shape, timestep, experts):
    """The real module trees (meta device: no memory): denoiser inputs, and the Wan spec
    resolves with one WanTransformerBlock region over every block of every expert."""
    from magi_zoo.engine.resolve import resolve
    from magi_zoo.overrides import spec_layers

    adapter, variant = adapters.lookup(name)
    pipe = adapter.build(variant, weights="random", dtype=torch.bfloat16, device=torch.device("meta"))
    kw = adapter.denoiser_inputs(pipe, variant)
    assert kw["hidden_states"].shape == shape and kw["timestep"].shape == timestep
    assert kw["encoder_hidden_states"].shape == (1, 512, 4096)  # 512 UMT5-XXL tokens
    with torch.no_grad():  # the real forward takes them (meta: shapes only, no compute)
        assert adapter.denoiser(pipe)(**kw)[0].shape == shape
    modules = nn.ModuleDict(adapter.components(pipe))
    assert set(modules) == {"transformer", "text_encoder", "vae"} | ({"transformer_2"} if experts == 2 else set())
    regions = resolve(modules, spec_layers(adapter, magi_zoo.get_profile("h100"))).regions()
    blocks = regions[("WanTransformerBlock", "forward")]
    n = variant.config["transformer"]["num_layers"]
    assert len(blocks) == experts * n  # 5B: 30 blocks; A14B: 2 x 40 = 80 blocks, one region
    assert sorted({t.path.split(".")[0] for t in blocks}) == ["transformer", "transformer_2"][:experts]
    assert all(t.spec.fullgraph and t.spec.dynamic is False for t in blocks)  # [gpu.h100]


@pytest.mark.parametrize("dynamic", [True, False])
def test_both_experts_one_compiled_block(fresh_dynamo, eager_frames, dynamic):
    # dynamic=True is the CPU section's setting, False the H100/H200 sections' (static shapes).
    h = magi_zoo.load(TINY, gpu="cpu", compile={"WanTransformerBlock": dict(AOT, dynamic=dynamic)})
    with _block_calls(h.pipe) as calls:
        frames = _run(h)
    # The whole run, switch included, equals the eager pipeline (the conformance suite
    # compares inductor to eager on the denoiser alone, which is one expert).
    np.testing.assert_allclose(frames, eager_frames, atol=1e-4, rtol=0)
    # 4 UniPC steps at flow shift 3.0: t = 999, 900 >= 875 run `transformer`, 750, 500 run
    # `transformer_2`; per step 2 forwards (CFG) x 4 blocks => 2 x 2 x 4 = 16 block calls each.
    assert calls == {"transformer": 16, "transformer_2": 16}
    r = h.report().region("WanTransformerBlock")
    assert len(r.modules) == 8 and r.calls == 32  # 4 blocks x 2 experts
    # The experts' blocks have one type and one set of tensor shapes: the blocks of both
    # cost one compiled frame, and the switch at t = 875 recompiles nothing.
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)


def test_ti2v_tiny_per_token_timesteps(fresh_dynamo):
    h = magi_zoo.load(TINY_TI2V, gpu="cpu", compile={"WanTransformerBlock": AOT})
    assert h.pipe.config.expand_timesteps and h.pipe.vae_scale_factor_spatial == 16
    assert set(h.modules) == {"transformer", "text_encoder", "vae"}  # no transformer_2
    with _block_calls(h.pipe) as calls:
        frames = _run(h)
    assert frames.shape == (1, 9, 64, 64, 3)
    assert calls == {"transformer": 16}  # 2 steps x 2 (CFG) x 4 blocks
    r = h.report().region("WanTransformerBlock")
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)
    # 9 frames -> 3 latent frames; 64/16 = 4 latent rows/cols -> 2 x 2 tokens per frame: 12
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    assert kw["hidden_states"].shape == (1, 48, 3, 4, 4) and kw["timestep"].shape == (1, 12)
    with torch.no_grad():
        assert h.adapter.denoiser(h.pipe)(**kw)[0].shape == kw["hidden_states"].shape


def test_local_load_switches_experts(tmp_path, eager_frames):
    # model_index.json keeps transformer_2 and boundary_ratio: a local load switches experts
    # too (weights and the denoiser after save -> load are the conformance suite's).
    h0 = magi_zoo.load(TINY, gpu="cpu", compile=False)
    h0.adapter.save_pretrained(h0.pipe, tmp_path)
    h = magi_zoo.load(TINY, gpu="cpu", weights=str(tmp_path), compile=False)
    assert h.pipe.config.boundary_ratio == 0.875 and set(h.modules) >= {"transformer", "transformer_2"}
    np.testing.assert_array_equal(_run(h), eager_frames)
