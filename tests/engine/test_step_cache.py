"""The step_cache section: diffusers' caching hooks on tiny Wan and Flux pipelines, applied
after compile (wrapping the compiled blocks), counted by the engine's own region calls,
checked by the compile counters, undone exactly; bad input refused with what to do."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import magi_zoo
from magi_zoo import PlanError
from magi_zoo.engine import counters, remove
from magi_zoo.specs.step_cache_spec import METHODS, StepCacheSpec, parse_cli

STEPS = 6
WAN_BLOCKS = {"WanTransformerBlock": {"backend": "aot_eager", "fullgraph": True}}
FLUX_BLOCKS = {k: {"backend": "aot_eager", "fullgraph": True}
               for k in ("FluxTransformerBlock", "FluxSingleTransformerBlock")}
FENCED = {"text_encoder": False, "text_encoder_2": False, "vae": False}  # only the blocks compile


@pytest.fixture(scope="module")
def wan():
    return magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)


@pytest.fixture(scope="module")
def flux():
    return magi_zoo.load("flux-tiny", gpu="cpu", compile=False)


def _gen(h, steps=STEPS):
    out = h(prompt="a corgi", num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
            output_type="latent")
    return out[0]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _state(module):
    """What an exact undo must give back: every submodule's instance attributes. (An empty
    diffusers hook registry is left out: the pipelines' own `cache_context` creates one on
    the transformer at their first call.)"""
    def keys(m):
        reg = m.__dict__.get("_diffusers_hook")
        return sorted(k for k in m.__dict__ if k != "_diffusers_hook" or reg.hooks)

    return [(type(m).__name__, keys(m), m.__dict__.get("forward")) for m in module.modules()]


def _calls(rep, region):
    return next(r.calls for r in rep.regions if r.name == region)


def _plan(h, compile_blocks, step_cache=None):
    plan = {"compile": {**compile_blocks, **{k: v for k, v in FENCED.items() if k in h.modules}}}
    if step_cache is not None:
        plan["step_cache"] = {"transformer": step_cache}
    return plan


def test_wan_first_block_cache_skips_blocks_no_recompiles_and_undoes_exactly(wan, fresh_dynamo):
    t = wan.pipe.transformer
    before = _state(t)
    rep = magi_zoo.apply(wan.modules, _plan(wan, WAN_BLOCKS, {"method": "first_block", "threshold": 0.2}),
                         gpu="cpu")
    assert rep.step("step_cache").did.startswith("first_block on transformer (method=first_block, threshold=0.2")
    # FBC hooks all 4 blocks: the head (decides), 2 middle ones, the tail (stores the residual)
    assert rep.step("step_cache").details["transformer"]["hooked"] == 4
    c = counters.snapshot()
    cached = _gen(wan)
    # The hooks wrap the compiled blocks from outside: 4 blocks share 1 compiled frame, no break,
    # and skipping blocks on later steps recompiles nothing.
    counters.expect(counters.delta(c), frames=1, breaks=0, recompiles=0)
    n_cached = _calls(rep, "WanTransformerBlock")
    remove(wan.modules)
    assert _state(t) == before  # exact undo: no forward, hook registry or _cache_config left behind

    rep = magi_zoo.apply(wan.modules, _plan(wan, WAN_BLOCKS), gpu="cpu")
    full = _gen(wan)
    # 6 steps x 2 forwards (CFG: cond, uncond) x 4 blocks
    assert _calls(rep, "WanTransformerBlock") == STEPS * 2 * 4
    remove(wan.modules)
    # The head block runs on every forward (12 calls); steps 0 run everything; later ones
    # may skip blocks 1..3.
    assert STEPS * 2 < n_cached < STEPS * 2 * 4
    assert _rel(cached, full) < 0.1  # close to no-cache (random tiny weights: plumbing, not quality)


def test_flux_first_block_cache_over_both_block_stacks(flux, fresh_dynamo):
    t = flux.pipe.transformer
    before = _state(t)
    rep = magi_zoo.apply(flux.modules, _plan(flux, FLUX_BLOCKS), gpu="cpu")
    full = _gen(flux)
    # flux-dev is guidance-distilled: one forward per step; 2 double + 2 single blocks
    assert _calls(rep, "FluxTransformerBlock") == _calls(rep, "FluxSingleTransformerBlock") == STEPS * 2
    rep = magi_zoo.apply(flux.modules, _plan(flux, FLUX_BLOCKS, {"method": "first_block", "threshold": 0.3}),
                         gpu="cpu")  # replaces the plan above
    c = counters.snapshot()
    cached = _gen(flux)
    # same compiled code as the run above: skipping blocks recompiles nothing
    counters.expect(counters.delta(c), frames=0, breaks=0, recompiles=0)
    # head = transformer_blocks.0 (every step), tail = single_transformer_blocks.1
    n_double, n_single = _calls(rep, "FluxTransformerBlock"), _calls(rep, "FluxSingleTransformerBlock")
    assert STEPS <= n_double and n_double + n_single < STEPS * 4
    assert _rel(cached, full) < 0.1
    remove(flux.modules)
    assert _state(t) == before


def test_taylorseer_lite_hooks_whole_blocks_under_compile(wan):
    # Lite mode hooks the blocks themselves and proj_out: outside the compiled regions.
    rep = magi_zoo.apply(wan.modules, _plan(wan, WAN_BLOCKS, {
        "method": "taylorseer", "options": {"use_lite_mode": True, "cache_interval": 2}}), gpu="cpu")
    assert rep.step("step_cache").details["transformer"]["hooked"] == 5  # 4 blocks + proj_out
    remove(wan.modules)


def test_hooks_inside_compiled_blocks_are_refused_and_nothing_is_left(wan):
    t = wan.pipe.transformer
    before = _state(t)
    # PAB hooks the attention layers inside each block: dynamo would trace them.
    with pytest.raises(PlanError, match=r"method 'pab' hooks 4 module\(s\) inside the compiled region "
                                        r"'WanTransformerBlock' \(e.g. 'transformer.blocks.0.attn1'\).*enabled"):
        magi_zoo.apply(wan.modules, _plan(wan, WAN_BLOCKS, {"method": "pab", "options": {
            "spatial_attention_block_skip_range": 2}}), gpu="cpu")
    assert _state(t) == before
    # TaylorSeer's default patterns ('^blocks.*attn') match no Wan layer (attn1/attn2): said, not ignored.
    with pytest.raises(PlanError, match="hooked no module.*use_lite_mode=true"):
        magi_zoo.apply(wan.modules, _plan(wan, WAN_BLOCKS, {"method": "taylorseer"}), gpu="cpu")
    assert _state(t) == before
    with pytest.raises(PlanError, match="UMT5EncoderModel at 'text_encoder' has no enable_cache"):
        magi_zoo.apply(wan.modules, {"compile": {"": False}, "step_cache": {"text_encoder": "first_block"}},
                       gpu="cpu")
    # MagCache without the model's ratios: diffusers' own message, under the section's name
    with pytest.raises(ValueError, match="step_cache method 'mag_cache':.*mag_ratios"):
        magi_zoo.apply(wan.modules, _plan(wan, WAN_BLOCKS, {"method": "mag_cache"}), gpu="cpu")
    assert _state(t) == before


def test_pab_runs_with_the_blocks_eager(wan):
    """With the blocks fenced off PAB is allowed; its timestep comes from the model's own
    `timestep` argument (Wan: 0-1000), so attention is reused inside the range."""
    rep = magi_zoo.apply(wan.modules, _plan(wan, {"WanTransformerBlock": False}, {"method": "pab", "options": {
        "spatial_attention_block_skip_range": 2, "spatial_attention_timestep_skip_range": [0, 1001]}}),
        gpu="cpu")
    assert rep.step("step_cache").details["transformer"]["hooked"] == 4  # the blocks' self-attention
    attn = wan.pipe.transformer.blocks[0].attn1
    calls = []
    proc = attn.processor
    attn.processor = lambda *a, **k: calls.append(1) or proc(*a, **k)
    try:
        _gen(wan, steps=4)
    finally:
        attn.processor = proc
        remove(wan.modules)
    # 4 steps x 2 forwards (cond, uncond) = 8 calls of the layer. diffusers keeps one PAB state
    # per layer, not per CFG branch, and counts calls: with skip range 2 every other call
    # computes (the uncond call reuses the cond call's self-attention): 4.
    assert len(calls) == 4


def test_method_names_and_knobs_are_validated():
    with pytest.raises(ValueError, match="unknown step_cache method 'firstblock' -- did you mean 'first_block'"):
        StepCacheSpec(method="firstblock")
    with pytest.raises(ValueError, match="'teacache' is not exposed: diffusers 0.42.1 has no TeaCache"):
        StepCacheSpec(method="teacache")
    with pytest.raises(ValueError, match="threshold does not apply to method 'taylorseer'"):
        StepCacheSpec(method="taylorseer", threshold=0.1)
    with pytest.raises(ValueError, match="no option 'cache_intervall' -- did you mean 'cache_interval'"):
        StepCacheSpec(method="taylorseer", options={"cache_intervall": 3})
    # through load: refused before the model is built
    with pytest.raises(ValueError, match="did you mean 'first_block'"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", overrides={"step_cache": {"transformer": "firstblock"}})
    assert parse_cli("first_block:0.1") == {"method": "first_block", "threshold": 0.1}
    assert parse_cli("taylorseer:cache_interval=4,use_lite_mode=true") == {
        "method": "taylorseer", "options": {"cache_interval": 4, "use_lite_mode": True}}
    assert parse_cli("mag_cache:mag_ratios=[1,1.1],threshold=0.1")["options"] == {"mag_ratios": [1, 1.1]}
    for bad, msg in [("first_block:x", "a threshold"), ("first_block:thresold=1", "did you mean 'threshold'"),
                     ("sea_cache:threshold=-1", ">= 0")]:
        with pytest.raises(ValueError, match=msg):
            parse_cli(bad)


def test_knob_table_matches_diffusers():
    import diffusers.hooks as hooks

    for name, m in METHODS.items():
        if m.config is None:
            continue
        fields = {f.name for f in dataclasses.fields(getattr(hooks, m.config))}
        assert set(m.knobs) <= fields, (name, set(m.knobs) - fields)
        assert m.threshold == ("threshold" in fields), name


def test_cli_step_cache_flag(tmp_path, capsys):
    from magi_zoo.cli import main

    # refused before anything is built: exit status 2 and one line saying what to do
    out = str(tmp_path / "o.mp4")
    assert main(["run", "wan2.1-tiny", "--prompt", "x", "--out", out, "--gpu", "cpu",
                 "--step-cache", "firstblock"]) == 2
    assert "did you mean 'first_block'" in capsys.readouterr().err
    assert main(["run", "wan2.1-tiny", "--prompt", "x", "--out", out, "--gpu", "cpu", "--no-compile",
                 "--step-cache", "first_block"]) == 2
    assert "drop --no-compile" in capsys.readouterr().err
    assert main(["run", "bagel-tiny", "--prompt", "x", "--out", str(tmp_path / "o.png"), "--gpu", "cpu",
                 "--step-cache", "first_block"]) == 2
    assert "bagel-tiny has none (Wan and Flux models do)" in capsys.readouterr().err


def test_video_metrics_used_by_the_quality_benchmarks():
    from benchmarks import fp8_quality, step_cache  # noqa: F401  (both import on CPU)
    from benchmarks.video_quality import compare_videos, psnr, rel_l2, ssim

    g = torch.Generator().manual_seed(0)
    a = torch.rand(3, 3, 24, 24, generator=g)
    assert torch.isinf(psnr(a, a)).all() and torch.allclose(ssim(a, a), torch.ones(3))
    b = (a + 0.05 * torch.randn(a.shape, generator=g)).clamp(0, 1)
    mse = (a - b).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(psnr(b, a), 10 * torch.log10(1 / mse))
    assert (ssim(b, a) < 0.99).all() and (ssim(b, a) > 0).all()
    # a constant offset keeps the structure term: SSIM stays far above that of noise
    assert (ssim((a * 0.5 + 0.25), a * 0.5 + 0.3) > 0.95).all()
    r = compare_videos(b, a, chunk=2)
    assert len(r["psnr_per_frame_db"]) == 3 and r["identical_frames"] == 0 and 0 < r["ssim_mean"] < 1
    # the second argument is the reference: 2a against a is 100% off, a against 2a 50%
    assert rel_l2(2 * a, a) == pytest.approx(1.0) and rel_l2(a, 2 * a) == pytest.approx(0.5)


@pytest.mark.gpu
def test_gpu_first_block_cache_with_the_shipped_spec():
    """On a CUDA card with the shipped spec (inductor, the card's attention backend): the
    hooks wrap the compiled blocks, skip block work, recompile nothing."""
    h = magi_zoo.load("wan2.1-tiny", gpu="auto",
                      overrides={"step_cache": {"transformer": {"method": "first_block", "threshold": 0.2}}})
    _gen(h)  # compiles
    calls = _calls(h.report(), "WanTransformerBlock")
    c = counters.snapshot()
    _gen(h)
    counters.expect(counters.delta(c), frames=0, breaks=0, recompiles=0)
    assert STEPS * 2 < _calls(h.report(), "WanTransformerBlock") - calls < STEPS * 2 * 4
    remove(h.modules)


@pytest.mark.parametrize("root, cache_key, split_key", [
    ("pipeline", "transformer", "transformer"), ("pipeline", "transformer", ""),
    ("pipeline", "transformer", "transformer.blocks"),
    ("transformer", "", "blocks"),  # the cache on the root, the split inside: went through before
])
def test_step_cache_with_a_sequence_split_is_refused_whichever_holds_the_other(root, cache_key, split_key):
    # Each rank would decide to skip blocks from its own shard of the sequence; the refusal must
    # not depend on which of the two keys is the outer one. The step cache step runs before the
    # parallel step, so no process group is needed to see the refusal.
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    module = h.modules if root == "pipeline" else h.pipe.transformer
    plan = {"compile": {"": False}, "step_cache": {cache_key: {"method": "first_block", "threshold": 0.2}},
            "parallel": {split_key: {"ulysses_degree": 2}}}
    with pytest.raises(PlanError, match=r"step caching with sequence parallelism \(ulysses_degree=2\)"):
        magi_zoo.apply(module, plan, gpu="cpu")
    assert h.pipe.transformer.__dict__.get("_cache_config") is None  # nothing left enabled
