"""FLUX.2 beyond the conformance suite: image-conditioned generation (`--image`), checked
before any work and driven end to end on the tiny variant, and the [klein] pipeline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import magi_zoo
from magi_zoo.adapters import lookup

from helpers import flux2_klein_tiny


def _png(path, w, h):
    Image.fromarray((np.random.default_rng(0).random((h, w, 3)) * 255).astype("uint8")).save(path)
    return path


def test_small_conditioning_image_is_refused_before_the_build(tmp_path, monkeypatch):
    from magi_zoo.cli import main

    adapter, variant = lookup("flux.2-tiny")
    small = _png(tmp_path / "small.png", 48, 40)

    def no_work(*a, **k):
        raise AssertionError("built the model before checking the image")

    monkeypatch.setattr(type(adapter), "build", no_work)
    with pytest.raises(ValueError, match="at least 64x64"):
        adapter.check_inputs(adapter.check_run(variant, {"image": str(small)}, tmp_path / "o.png"))
    argv = ["run", "flux.2-tiny", "--gpu", "cpu", "--prompt", "x", "--out", str(tmp_path / "o.png"), "--image", str(small)]
    assert main(argv) == 2
    # the API's PIL image by the same rule (the contract's min_image_side), and 64 itself passes
    with pytest.raises(ValueError, match=r"the input image: 63x80; flux2 takes input images of at least 64x64"):
        adapter.check_inputs({"image": Image.new("RGB", (63, 80))})
    adapter.check_inputs({"image": Image.new("RGB", (64, 64))})
    adapter.check_inputs({"image": str(_png(tmp_path / "ok.png", 64, 96))})


def test_image_conditioning_appends_its_tokens(tmp_path):
    """`--image`: the pipeline encodes the image and appends its packed latents to the image
    tokens: a 64x80 image is 64/16 x 80/16 = 20 more tokens than the 32x32 output's 2x2 = 4."""
    from magi_zoo.cli import generate_to

    h = magi_zoo.load("flux.2-tiny", gpu="cpu", compile=False)
    seen = []
    hook = h.pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)
    try:
        [out] = generate_to(h, prompt="a corgi", out=tmp_path / "o.png", progress=False,
                            image=str(_png(tmp_path / "in.png", 80, 64)))
        assert out.stat().st_size > 0
        # every step: the output's 4 tokens, then the image's 20 (text-to-image, in the
        # conformance suite, runs the 4 alone)
        assert seen == [4 + 20] * h.variant.call_defaults["num_inference_steps"], seen
    finally:
        hook.remove()


def test_klein_pipeline_runs_at_the_tiny_size():
    """FLUX.2 [klein]'s path -- Flux2KleinPipeline, a Qwen3 encoder through its chat template,
    three stacked hidden states, no guidance embedder (the denoiser gets guidance=None) -- at
    the tiny sizes (config.TINY_KLEIN, not registered: the conformance suite compiles the same
    blocks for flux.2-tiny)."""
    adapter, variant = flux2_klein_tiny()
    pipe = adapter.build(variant, weights="random", dtype=torch.float32, device=torch.device("cpu"))
    assert type(pipe).__name__ == "Flux2KleinPipeline" and type(pipe.text_encoder).__name__ == "Qwen3ForCausalLM"
    kwargs = adapter.example_inputs(pipe, variant, "denoise")
    assert kwargs["guidance"] is None
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["encoder_hidden_states"].shape), with_kwargs=True)
    try:
        image = pipe(prompt="a corgi", output_type="pil", **variant.call_defaults).images[0]
    finally:
        hook.remove()
    assert image.size == (32, 32)
    # joint_attention_dim = 3 stacked layers x the encoder's 32; CFG at guidance 4.0 (base): 2 calls a step
    assert seen == [torch.Size([1, 512, 96])] * 2 * variant.call_defaults["num_inference_steps"], seen


def test_only_klein_base_runs_cfg():
    """CFG parallel splits only the calls that run CFG: [klein] base at guidance_scale > 1, not
    FLUX.2-dev (its guidance is an embedding) nor the distilled [klein] (its pipeline ignores it)."""
    adapter, dev = lookup("flux.2-dev")
    base = adapter.variants["flux.2-klein-base-9b"]
    assert adapter.runs_cfg(dict(base.call_defaults), base)
    assert not adapter.runs_cfg(dict(base.call_defaults, guidance_scale=1.0), base)
    assert not adapter.runs_cfg(dict(dev.call_defaults), dev)
    distilled = adapter.variants["flux.2-klein-4b"]
    assert not adapter.runs_cfg(dict(distilled.call_defaults, guidance_scale=4.0), distilled)
    assert not adapter.runs_cfg(dict(base.call_defaults))  # no variant named: no CFG claimed
    _, tiny_base = flux2_klein_tiny()
    assert adapter.runs_cfg(dict(tiny_base.call_defaults, guidance_scale=4.0), tiny_base)
