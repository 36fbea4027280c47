"""The engine as ordered steps on real diffusers models: the attention section, adapter
preparations, undo of every step by `remove`, and a failing step leaving nothing behind."""

from __future__ import annotations

import pytest
import torch

import magi_zoo
from magi_zoo import PlanError
from magi_zoo.engine import STEP_ORDER, remove


@pytest.fixture(scope="module")
def wan():
    return magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)


@pytest.fixture(scope="module")
def flux():
    return magi_zoo.load("flux-tiny", gpu="cpu", compile=False)


def _backends(module):
    return [m.processor._attention_backend for m in module.modules()
            if hasattr(getattr(m, "processor", None), "_attention_backend")]


def _forward(h):
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    with torch.no_grad():
        return h.pipe.transformer(**kw)[0]


def test_steps_run_in_the_documented_order(wan):
    rep = magi_zoo.apply(wan.modules, {"compile": {"WanTransformerBlock": {"backend": "eager"}}}, gpu="cpu")
    ran = [s.step for s in rep.steps]
    # steps with an engine module run, in STEP_ORDER (every step registered in this process)
    assert ran == [s for s in STEP_ORDER if s in ran]
    assert {"prepare", "attention", "precision", "compile", "step_cache", "offload"} <= set(ran)
    remove(wan.modules)


def test_attention_section_per_region_and_undo(wan):
    t = wan.pipe.transformer
    ref = _forward(wan)
    assert set(_backends(t)) == {None}  # library default
    # Only block 1's attention layers: per region, not model-wide. Math SDPA on CPU
    # computes the same attention as the default dispatch.
    rep = magi_zoo.apply(wan.modules, {"attention": {"transformer.blocks.1": {"backend": "_native_math"}},
                                       "compile": {"": False}}, gpu="cpu")
    got = _backends(t)
    # each Wan block has two attention layers (self and cross): 2 set, the other 3 blocks' 6 untouched
    assert [str(b.value) if b else None for b in got].count("_native_math") == 2 and got.count(None) == 6
    assert "_native_math on transformer.blocks.1 (2 attention layers)" in rep.step("attention").did
    torch.testing.assert_close(_forward(wan), ref, rtol=1e-5, atol=1e-6)
    remove(wan.modules)
    assert set(_backends(t)) == {None}  # undone exactly


def test_attention_auto_reads_the_profile(wan):
    prof = magi_zoo.get_profile("cpu").model_copy(update={"attention_backends": ("_native_math", "native")})
    rep = magi_zoo.apply(wan.modules, {"attention": {"transformer": "auto"}, "compile": {"": False}}, gpu=prof)
    assert "_native_math on transformer" in rep.step("attention").did
    assert {b.value for b in _backends(wan.pipe.transformer)} == {"_native_math"}
    remove(wan.modules)


def test_attention_errors(wan):
    with pytest.raises(ValueError, match="'flsh' is not a diffusers backend -- did you mean 'flash'"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "flsh"}}, gpu="cpu")
    # a region with no attention layer under it (diffusers', transformers', or one declaring
    # ATTENTION_BACKENDS) is an error, not a silent no-op
    with pytest.raises(PlanError, match="has no attention layer under it that takes a backend"):
        magi_zoo.apply(wan.modules, {"attention": {"vae": "native"}}, gpu="cpu")
    assert magi_zoo.engine.installed(wan.modules) == [] and set(_backends(wan.pipe.transformer)) == {None}


def test_preparation_is_a_step_and_is_undone(flux):
    block0 = flux.pipe.transformer.single_transformer_blocks[0]
    assert not block0._forward_pre_hooks  # compile=False: nothing prepared
    rep = flux.apply_plan()
    assert rep.step("prepare").details["preparations"] == ["single-stream views", "fused single-block MLP",
                                                            "fused q/k norm + rope"]
    assert len(block0._forward_pre_hooks) == 1
    assert type(block0.attn.processor).__name__ == "NormRopeFluxAttnProcessor"
    remove(flux.modules)
    assert not block0._forward_pre_hooks and magi_zoo.engine.installed(flux.modules) == []
    assert not any("forward" in b.__dict__ for b in flux.pipe.transformer.single_transformer_blocks)
    assert type(block0.attn.processor).__name__ == "FluxAttnProcessor"


def test_failing_step_undoes_the_earlier_ones(flux):
    block0 = flux.pipe.transformer.single_transformer_blocks[0]
    # prepare and attention succeed, then resolution of the compile key fails: the views
    # hook and the attention backend must not stay behind.
    with pytest.raises(PlanError, match="FluxTransformerBlok"):
        magi_zoo.apply(flux.modules, {"attention": {"transformer": "_native_math"},
                                      "compile": {"FluxTransformerBlok": {}}}, gpu="cpu",
                       preparations=flux.adapter.preparations(flux.pipe))
    assert not block0._forward_pre_hooks and set(_backends(flux.pipe.transformer)) == {None}
    assert "forward" not in block0.__dict__  # the fp8 proj_out preparation was undone too


def test_load_overrides_reach_every_section(fresh_dynamo):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", overrides={"attention": {"transformer": "_native_math"}},
                      compile={"WanTransformerBlock": {"backend": "eager"}})
    assert [layer for layer, _ in h.layers] == ["model default", "gpu", "user"]
    assert {b.value for b in _backends(h.pipe.transformer)} == {"_native_math"}
    assert h.report().region("WanTransformerBlock").spec.backend == "eager"
    assert h.report().region("WanTransformerBlock").spec.fullgraph is True  # from the spec file
