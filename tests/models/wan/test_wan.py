"""Wan2.1 adapter on the tiny variant: load, specs end to end through the pipeline, counters.

What every family must do (inductor equals eager on the denoiser, 4 blocks one compile,
save -> load, `run` writes, call defaults) is checked by tests/conformance; this file keeps
what is Wan's own."""

import numpy as np
import pytest
import torch

import magi_zoo
from magi_zoo import PlanError

TINY = "wan2.1-tiny"


def _run(handle, seed=0, **over):
    call = dict(handle.variant.call_defaults, prompt="a corgi surfing")
    call.update(over)
    gen = torch.Generator().manual_seed(seed)
    return handle(generator=gen, output_type="np", **call).frames


@pytest.fixture(scope="module")
def eager_handle():
    return magi_zoo.load(TINY, gpu="cpu", compile=False)


@pytest.fixture(scope="module")
def eager_frames(eager_handle):
    return _run(eager_handle)


def test_handle_surface(eager_handle):
    h = eager_handle
    assert type(h.pipe).__name__ == "WanPipeline"
    assert set(h.modules) == {"transformer", "text_encoder", "vae"}
    assert h.report() is None and h.plan is None  # compile=False applies nothing
    assert h.dtype == torch.float32 and h.device.type == "cpu"
    assert len(h.pipe.transformer.blocks) == 4
    # where load's seconds went, per phase (apply_s counts even when nothing is applied)
    assert set(h.timings) == {"plan_s", "build_s", "apply_s"} and all(v >= 0 for v in h.timings.values())


def test_published_variants_are_exact_configs():
    from magi_zoo.adapters.wan import VARIANTS

    t = VARIANTS["wan2.1-t2v-1.3b"].config["transformer"]
    # 12 heads x 128 = 1536 hidden, 30 layers, FFN 8960 (Wan2.1-T2V-1.3B config.json)
    assert (t["num_attention_heads"] * t["attention_head_dim"], t["num_layers"], t["ffn_dim"]) == (1536, 30, 8960)
    t14 = VARIANTS["wan2.1-i2v-14b-480p"].config["transformer"]
    assert (t14["num_attention_heads"] * t14["attention_head_dim"], t14["num_layers"], t14["in_channels"]) == (5120, 40, 36)
    # the published variants first, then LightX2V's distilled ones over them, then the tiny one
    assert magi_zoo.list_models()[:9] == ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b-480p",
                                          "wan2.1-i2v-14b-720p", "wan2.1-i2v-14b-480p-distill",
                                          "wan2.1-t2v-14b-distill", "wan2.1-i2v-14b-480p-distill-lora",
                                          "wan2.1-t2v-14b-distill-lora", TINY]


def test_unknown_model_did_you_mean():
    with pytest.raises(ValueError, match=r"unknown model 'wan2.1-tinny'\. Did you mean 'wan2.1-tiny'"):
        magi_zoo.load("wan2.1-tinny", gpu="cpu")


def test_tiny_rejects_foreign_weights():
    with pytest.raises(ValueError, match="tiny random variant"):
        magi_zoo.load(TINY, gpu="cpu", weights="Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


def test_bad_override_names_real_submodules():
    with pytest.raises(PlanError, match=r"'WanTransformerBlok'.*Closest.*WanTransformerBlock"):
        magi_zoo.load(TINY, gpu="cpu", compile={"WanTransformerBlok": {"dynamic": True}})
    with pytest.raises(PlanError, match=r"has no method 'decod'.*decode"):
        magi_zoo.load(TINY, gpu="cpu", compile={"vae": {"decod": {"enabled": False}}})
    with pytest.raises(TypeError, match="compile= takes"):
        magi_zoo.load(TINY, gpu="cpu", compile="yes")


@pytest.mark.parametrize("dynamic, frames, recompiles", [
    # symbolic shapes from the first call: 9 and 5 frames share one compiled block
    (True, 1, 0),
    # static shapes: 5 frames (2 latent frames) fail the 9-frame (3 latent) size guard
    (False, 2, 1),
])
def test_dynamic_setting_end_to_end(fresh_dynamo, eager_frames, dynamic, frames, recompiles):
    # Acceptance 2: a non-default setting on one region, end to end through the pipeline.
    # (Inductor numerics of the denoiser and "4 blocks, one compile" are the conformance
    # suite's, tests/conformance; this is the pipeline around them, on the aot_eager backend.)
    h = magi_zoo.load(TINY, gpu="cpu", compile={"WanTransformerBlock": {"dynamic": dynamic, "backend": "aot_eager"}})
    np.testing.assert_allclose(_run(h, num_frames=9), eager_frames, atol=1e-4, rtol=0)  # 9 = the call default
    _run(h, num_frames=5)
    rep = h.report()
    r = rep.region("WanTransformerBlock")
    assert r.spec.dynamic is dynamic and r.spec.fullgraph is True  # fullgraph kept from the spec file
    assert r.layers == ["model default", "gpu", "user"]
    # 2 runs x 2 steps x 2 (CFG) x 4 blocks = 32 block calls, under the pipeline's no_grad
    assert r.calls == 32
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (frames, recompiles, 0)
    # The spec's other regions: the text encoder and the VAE fenced off (enabled=False);
    # the encoder runs for the prompt and the negative prompt of each run: 2 x 2 = 4 calls.
    labels = {x.label: x for x in rep.regions}
    assert set(labels) == {"WanTransformerBlock", "text_encoder", "vae.decode", "vae.encode"}
    assert labels["text_encoder"].spec.enabled is False and labels["text_encoder"].calls == 4
    assert all(label in rep.table() for label in labels)


def test_saved_tokenizer_encodes_the_same(tmp_path, eager_handle):
    # Weights and the denoiser output after save -> load are the conformance suite's;
    # here: the in-process tokenizer survives the round trip.
    eager_handle.adapter.save_pretrained(eager_handle.pipe, tmp_path)
    h = magi_zoo.load(TINY, gpu="cpu", weights=str(tmp_path), compile=False)
    text = "a corgi surfing"
    assert h.pipe.tokenizer(text)["input_ids"] == eager_handle.pipe.tokenizer(text)["input_ids"]


def test_spec_file_override(tmp_path, fresh_dynamo):
    p = tmp_path / "mine.toml"
    p.write_text('[default.compile]\n"transformer.blocks.*" = { backend = "eager", fullgraph = true }\n')
    h = magi_zoo.load(TINY, gpu="cpu", spec_file=p)
    assert [(r.label, r.spec.backend) for r in h.report().regions] == [("transformer.blocks.*", "eager")]


def test_denoiser_inputs_shapes(eager_handle):
    a = eager_handle.adapter
    kw = a.denoiser_inputs(eager_handle.pipe, eager_handle.variant, frames=5)
    assert kw["hidden_states"].shape == (1, 16, 2, 4, 4)  # (5-1)/4+1 latent frames, 32/8 spatial
    with torch.no_grad():
        assert a.denoiser(eager_handle.pipe)(**kw)[0].shape == kw["hidden_states"].shape


def test_run_options(eager_handle, tmp_path):
    from magi_zoo.cli import generate_to

    # --seed becomes the pipeline's generator
    [out1] = generate_to(eager_handle, prompt="a corgi", out=tmp_path / "a.mp4", progress=False, seed=3, num_frames=5)
    assert out1.stat().st_size > 0
    # an option Wan cannot use is a clear error naming the flag, before any work
    a, v = eager_handle.adapter, eager_handle.variant
    with pytest.raises(ValueError, match=r"cannot use --max-new-tokens.*takes --prompt, --out and --steps"):
        a.check_run(v, dict(max_new_tokens=4), tmp_path / "b.mp4")
    with pytest.raises(ValueError, match=r"cannot use --audio-out, --image"):
        a.check_run(v, dict(image="i.png", audio_out="s.wav"), tmp_path / "b.mp4")
    with pytest.raises(ValueError, match="--steps must be a positive integer, got 0"):
        a.check_run(v, dict(num_inference_steps=0), tmp_path / "b.mp4")
    with pytest.raises(ValueError, match=r"writes \.mp4 or \.gif"):
        a.check_run(v, {}, tmp_path / "b.png")
