"""Z-Image: what the conformance suite does not already check. One block class at three sites
(the spec's per-path regions, each compiled once), CFG at guidance_scale > 0 (the adapter's
`cfg_threshold`), the RoPE table's limit on the image size, and parity with diffusers' own
ZImagePipeline loaded from the same checkpoint: one sequence (the fused q/k norm + rope path) and
CFG's padded, masked batch (diffusers' processor)."""

from __future__ import annotations

import pytest
import torch

import magi_zoo
from magi_zoo.engine import counters

SITES = ("transformer.noise_refiner.*", "transformer.context_refiner.*", "transformer.layers.*")


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.compiler.reset()
    built = magi_zoo.load("z-image-tiny", gpu="cpu", dtype="float32", compile=False)
    path = tmp_path_factory.mktemp("z-image-tiny")
    built.adapter.save_pretrained(built.pipe, path)
    return path


@pytest.mark.parametrize("guidance", [0.0, 2.0], ids=["one-sequence-fused", "cfg-padded-batch"])
def test_generation_matches_diffusers_and_each_site_compiles_once(saved, guidance):
    """Ours (the shipped CPU plan, regions on aot_eager) against diffusers' ZImagePipeline from
    the same directory, a 2-step generation. At guidance 0 (the Turbo default) each forward is
    one sequence and the attention takes the fused q/k norm + rope path; at 2.0 each step runs
    the prompt and the empty negative prompt as one padded batch (a key-padding mask in every
    attention, a rotary table per sequence), which is diffusers' own processor call."""
    import diffusers

    ref = diffusers.ZImagePipeline.from_pretrained(str(saved), local_files_only=True, dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    torch.compiler.reset()
    ours = magi_zoo.load("z-image-tiny", gpu="cpu", dtype="float32", weights=str(saved),
                         compile={k: {"backend": "aot_eager"} for k in SITES})
    call = dict(ours.call_defaults(), prompt="a corgi surfing a wave at sunset", guidance_scale=guidance,
                output_type="np")
    assert ours.adapter.runs_cfg(call, ours.variant) == (guidance > 0)
    want = ref(generator=torch.Generator().manual_seed(0), **call).images
    before = counters.snapshot()
    got = ours(generator=torch.Generator().manual_seed(0), **call).images
    assert got.shape == want.shape and abs(want).max() > 0
    assert rel(got, want) <= 1e-5
    # Three regions of one block class: each compiled once for its own site's inputs (the
    # steps after the first, and the second block of each site, reuse it), no recompile --
    # 3 frames in all, not the 1 + 2 recompiles of one shared code object.
    report = ours.report()
    for key in SITES:
        region = report.region(key)
        assert region.calls == 2 * 2 and (region.counters.frames, len(region.counters.recompiles)) == (1, 0), \
            report.details()
    assert counters.delta(before).frames == 3 and report.graph_breaks == 0
    torch.compiler.reset()


@pytest.mark.parametrize("batch", [1, 2])
def test_fused_attention_is_taken_for_one_sequence_and_equals_diffusers(saved, batch, monkeypatch):
    """The denoiser eager (the preparation and the marks installed) against diffusers' own transformer
    from the same directory: one sequence goes through the fused q/k norm + rope call in every
    attention (2 + 2 + 2 layers), a batch of two (a rotary table per sequence) through none."""
    import diffusers

    from magi_zoo.adapters.z_image import attention

    calls = []
    real = attention.joint_norm_rope_attention
    monkeypatch.setattr(attention, "joint_norm_rope_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = diffusers.ZImageTransformer2DModel.from_pretrained(str(saved), subfolder="transformer",
                                                             local_files_only=True, dtype=torch.float32).eval()
    # the shipped plan with its three block regions eager (the preparation and the marks are in)
    ours = magi_zoo.load("z-image-tiny", gpu="cpu", dtype="float32", weights=str(saved),
                         compile={k: {"enabled": False} for k in SITES})
    kw = ours.adapter.denoiser_inputs(ours.pipe, ours.variant, batch=batch)
    if batch == 2:  # the second caption shorter: a padded batch, as CFG's empty negative prompt makes
        kw["cap_feats"][1] = kw["cap_feats"][1][:40]
    with torch.no_grad():
        want, got = ref(**kw)[0], ours.adapter.denoiser(ours.pipe)(**kw)[0]
    assert all(rel(g, w) <= 1e-5 for g, w in zip(got, want, strict=True))
    assert len(calls) == (6 if batch == 1 else 0)


def test_one_class_key_over_the_three_sites_recompiles():
    """The counter that made the spec key each site by path: one class key is one region over
    the three sites, whose first call compiles the class's code once and recompiles it at each
    other site (the context refiner runs without modulation, the main layers on more tokens)."""
    torch.compiler.reset()
    h = magi_zoo.load("z-image-tiny", gpu="cpu", compile={"ZImageTransformerBlock": {"backend": "eager",
                                                                                     "fullgraph": True}})
    adapter = h.adapter
    module, method = adapter.entry(h.pipe, "denoise")
    with torch.no_grad():
        getattr(module, method)(**adapter.example_inputs(h.pipe, h.variant, "denoise"))
    region = h.report().region("ZImageTransformerBlock")
    assert region.counters.frames == 3 and len(region.counters.recompiles) == 2, h.report().details()
    torch.compiler.reset()


def test_cfg_runs_above_zero_guidance():
    """ZImagePipeline runs CFG at guidance_scale > 0 (not > 1 as Wan's and Flux's pipelines)."""
    adapter, variant = magi_zoo.adapters.lookup("z-image-turbo")
    assert not adapter.runs_cfg({"guidance_scale": 0.0}, variant)
    assert adapter.runs_cfg({"guidance_scale": 0.5}, variant)
    assert not adapter.runs_cfg(dict(variant.call_defaults), variant)  # Turbo: guidance-distilled


def test_fp8_is_refused_before_any_build():
    """Its spec lists the blocks for the q/k norm + rope fusion only (fp8 failed the quality gate
    on an H100: the spec's comment has the distances), so precision="fp8" is refused as the plan
    is read, before any weights exist."""
    from magi_zoo.overrides import spec_layers
    from magi_zoo.specs import get_profile

    adapter, _ = magi_zoo.adapters.lookup("z-image-turbo")
    with pytest.raises(ValueError, match="declares no fp8 regions"):
        spec_layers(adapter, get_profile("h100"), precision="fp8")


def test_image_side_past_the_rope_table_is_refused_before_any_work():
    adapter, variant = magi_zoo.adapters.lookup("z-image-turbo")
    limits = adapter.call_limits(variant)
    assert limits.pixel_multiple == 16 and limits.max_grid == 512
    from magi_zoo.adapters.call_checks import check_call

    check_call(variant.name, {"height": 1024, "width": 16 * 512}, limits)
    with pytest.raises(ValueError, match="RoPE table has 512 positions per image axis"):
        check_call(variant.name, {"height": 1024, "width": 16 * 513}, limits)
    with pytest.raises(ValueError, match="VAE 8x down x 2x2 patches"):
        check_call(variant.name, {"height": 1000, "width": 1024}, limits)
