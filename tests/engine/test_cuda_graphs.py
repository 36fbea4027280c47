"""The cuda_graphs section: whole calls captured in CUDA graphs around the compiled blocks.

CPU tests cover the plan (validation, refusals with what to do, exact undo) and the calls a
graph cannot serve (run uncaptured, counted with the reason, warned once). The capture
itself is CUDA-only: the gpu-marked tests check captured == uncaptured, outputs that
survive the next replay (CFG calls the denoiser twice), one graph per input signature,
`max_graphs`, and no recompiles from replays.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.engine import counters
from magi_zoo.engine.cuda_graphs import graphed
from magi_zoo.specs.cuda_graph_spec import CudaGraphSpec


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x, scale: float = 1.0):
        return self.b(torch.relu(self.a(x))) * scale


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- the spec ------------------------------------------------------------------------------

def test_spec_shorthand_and_validation():
    assert CudaGraphSpec.from_shorthand(True).enabled
    assert CudaGraphSpec().short() == "off"
    with pytest.raises(ValueError, match="max_graphs"):
        CudaGraphSpec(max_graphs=0)
    with pytest.raises(ValueError, match="unknown field 'max_graph' -- did you mean 'max_graphs'"):
        magi_zoo.apply(_Tiny(), {"cuda_graphs": {"": {"enabled": True, "max_graph": 2}}}, gpu="h100")


def test_unknown_key_lists_submodules():
    with pytest.raises(ValueError, match="'aa'"):
        magi_zoo.apply(_Tiny(), {"cuda_graphs": {"aa": True}}, gpu="h100")


# -- refusals at apply ---------------------------------------------------------------------

def test_cpu_profile_is_refused_with_the_fix():
    m = _Tiny()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA card.*profile 'cpu'.*gpu="):
        magi_zoo.apply(m, {"cuda_graphs": {"": True}})
    assert "forward" not in m.__dict__  # nothing installed


def test_training_apply_is_refused():
    with pytest.raises(ValueError, match="inference-only"):
        magi_zoo.apply(_Tiny(), {"compile": {"": False}, "cuda_graphs": {"": True}}, gpu="h100", train=True)


def test_nested_cuda_graphs_in_a_compile_region_are_refused():
    m = _Tiny()
    with pytest.raises(ValueError, match="captures CUDA graphs itself.*mode='reduce-overhead'.*do not nest"):
        magi_zoo.apply(m, {"compile": {"": {"mode": "reduce-overhead"}}, "cuda_graphs": {"": True}}, gpu="h100")
    assert "forward" not in m.__dict__  # the compile step's install was undone too


def test_step_caching_is_refused():
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    plan = {"compile": {"WanTransformerBlock": {}}, "step_cache": {"transformer": "first_block"},
            "cuda_graphs": {"transformer": True}}
    with pytest.raises(ValueError, match="step caching \\('first_block'.*use one or the other"):
        magi_zoo.apply(h.modules, plan, gpu="h100")


def test_a_shipped_default_yields_to_the_users_choice_and_says_so():
    from magi_zoo.specs.plan import PlanLayer

    shipped = ("gpu", PlanLayer.coerce({"compile": {"": False}, "cuda_graphs": {"": True}}))
    m = _Tiny()
    rep = magi_zoo.apply(m, layers=[shipped], gpu="h100", train=True)  # the user chose training
    did = rep.step("cuda_graphs").did
    assert did.startswith("none") and "<root> not captured (CUDA graph capture is inference-only" in did
    assert graphed(m) is None
    rep = magi_zoo.apply(m, layers=[shipped], gpu="h100")  # weights still on the CPU
    assert "<root> not captured (its weights are on cpu)" in rep.step("cuda_graphs").did
    assert rep.step("cuda_graphs").details["not_captured"] == ["<root> not captured (its weights are on cpu)"]
    # The same entry from the user is an error that says what to do.
    with pytest.raises(ValueError, match="inference-only.*drop the cuda_graphs entry"):
        magi_zoo.apply(m, {"compile": {"": False}, "cuda_graphs": {"": True}}, gpu="h100", train=True)


@pytest.mark.parametrize("model, key", [("flux.1-dev", "FluxTransformer2DModel"),
                                        ("flux.2-dev", "Flux2Transformer2DModel"),
                                        ("qwen-image", "QwenImageTransformer2DModel"),
                                        ("ltx-2", "LTX2VideoTransformer3DModel")])
def test_spec_captures_the_transformer_on_hopper_only(model, key):
    from magi_zoo.adapters import lookup
    from magi_zoo.specs import get_profile
    from magi_zoo.overrides import spec_layers

    adapter, _ = lookup(model)
    keys = lambda gpu: {k for _, layer in spec_layers(adapter, get_profile(gpu))  # noqa: E731
                        for k in layer.entries("cuda_graphs")}
    assert keys("h100") == keys("h200") == {key} and keys("cpu") == set()


# -- calls a graph cannot serve (CPU: inputs not on CUDA) -----------------------------------

def test_cpu_calls_run_uncaptured_counted_and_warned_once_then_undone():
    m = _Tiny()
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = m(x)
    rep = magi_zoo.apply(m, {"compile": {"": False}, "cuda_graphs": {"": {"enabled": True, "max_graphs": 2}}},
                         gpu="h100")
    assert "<root>.forward on 1 module(s) (enabled=True, max_graphs=2)" in rep.step("cuda_graphs").did
    call = graphed(m)
    assert call is rep.step("cuda_graphs").details["graphed"]["<root>"]
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="ran uncaptured: a tensor argument is on cpu"):
        out = m(x)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason warns once
        m(x)
    with pytest.warns(RuntimeWarning, match="autograd is on"):
        out_grad = m(x)  # autograd on: a reason of its own
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out_grad.detach(), ref)
    st = call.stats()
    assert st["graphs"] == 0 and st["replays"] == 0
    assert st["uncaptured"] == {"a tensor argument is on cpu (graphs capture CUDA work)": 2,
                                "autograd is on (call under torch.no_grad() or torch.inference_mode())": 1}
    magi_zoo.remove(m)
    assert "forward" not in m.__dict__ and graphed(m) is None


def test_bypassed_runs_the_method_itself_uncounted_then_replays_resume():
    from magi_zoo.engine.cuda_graphs import bypassed

    root = nn.ModuleDict({"t": _Tiny()})
    magi_zoo.apply(root, {"compile": {"": False}, "cuda_graphs": {"t": True}}, gpu="h100")
    call = graphed(root.t)
    ran = []
    hook = root.t.a.register_forward_hook(lambda *_: ran.append(1))
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # bypassed: no "ran uncaptured" warning
        with bypassed(root) as calls:
            out = root.t(x)
    assert calls == [call] and ran == [1]
    assert call.stats()["uncaptured"] == {} and call._bypass == 0
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="ran uncaptured"):
        torch.testing.assert_close(root.t(x), out)  # outside the block the graph serves (tries) again
    assert sum(call.stats()["uncaptured"].values()) == 1
    hook.remove()
    magi_zoo.remove(root)


def test_no_entry_means_nothing_installed():
    m = _Tiny()
    rep = magi_zoo.apply(m, {"compile": {"": False}}, gpu="h100")
    assert rep.step("cuda_graphs").did.startswith("none")
    assert graphed(m) is None


def test_harness_graph_strategies_are_one_change_each():
    from benchmarks.run import _zoo_kwargs
    from magi_zoo.adapters import lookup

    flux, _ = lookup("flux.1-dev")
    on, off = {"cuda_graphs": {"transformer": True}}, {"cuda_graphs": {"transformer": False}}
    assert _zoo_kwargs("magi_zoo_graphs", flux, "h100") == {"overrides": on}
    assert _zoo_kwargs("magi_zoo_nographs", flux, "h100") == {"overrides": off}
    assert _zoo_kwargs("magi_zoo_fp8_graphs", flux, "h100") == {"precision": "fp8", "overrides": on}
    assert _zoo_kwargs("magi_zoo_fp8_nographs", flux, "h100") == {"precision": "fp8", "overrides": off}
    off_fused = {"gelu_epilogue": False, "fuse_norm_rope": False, "fuse_norm_act": False}  # every fusion off
    assert _zoo_kwargs("magi_zoo_unfused", flux, "h100") == {"overrides": {"precision": {
        "FluxTransformerBlock": off_fused, "FluxSingleTransformerBlock": off_fused}}}
    bagel, _ = lookup("bagel-7b-mot")
    with pytest.raises(TypeError, match="key its step method"):
        _zoo_kwargs("magi_zoo_graphs", bagel, "h100")


# -- GPU: the capture itself -----------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
def test_graphed_module_equals_uncaptured_and_outputs_survive_the_next_replay():
    m = _Tiny().cuda()
    x1, x2 = torch.randn(4, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        r1, r2 = m(x1), m(x2)
    magi_zoo.apply(m, {"compile": {"": False}, "cuda_graphs": {"": {"enabled": True, "max_graphs": 2}}},
                   gpu="auto")
    call = graphed(m)
    with torch.no_grad():
        o1 = m(x1)
        o2 = m(x2)  # a replay: o1 must not change (it is a clone)
        o3 = m(x1, scale=2.0)  # a plain argument is part of the signature: a second graph
    torch.testing.assert_close(o1, r1)
    torch.testing.assert_close(o2, r2)
    torch.testing.assert_close(o3, 2 * r1)
    assert call.stats()["graphs"] == 2 and call.stats()["replays"] == 3
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="more input signatures than max_graphs=2"):
        o4 = m(torch.randn(2, 8, device="cuda"))
    assert o4.shape == (2, 8) and sum(call.stats()["uncaptured"].values()) == 1
    import numpy as np

    with torch.no_grad(), pytest.warns(RuntimeWarning, match="argument of type int64"):
        torch.testing.assert_close(m(x1, scale=np.int64(2)), 2 * r1)


@gpu
def test_a_replay_runs_no_hooks_so_units_are_timed_bypassed():
    # offload's per-unit timing hooks see nothing of a replayed forward; it refuses to return
    # an empty profile, and inside bypassed() the method itself runs and is timed
    from magi_zoo.engine import offload as off
    from magi_zoo.engine.cuda_graphs import bypassed

    m = _Tiny().cuda()
    magi_zoo.apply(m, {"compile": {"": False}, "cuda_graphs": {"": True}}, gpu="auto")
    x = torch.randn(4, 8, device="cuda")
    with torch.no_grad():
        m(x)  # captured
        with pytest.raises(RuntimeError, match="none of the 2 units ran through Python"):
            off.profile_units(m, ["a", "b"], lambda: m(x), "cuda")
        with bypassed(m):
            times = off.profile_units(m, ["a", "b"], lambda: m(x), "cuda")
    assert set(times) == {"a", "b"} and all(t > 0 for t in times.values())
    assert graphed(m).stats()["uncaptured"] == {}


@gpu
def test_flux_tiny_graphed_forward_equals_compiled_no_recompiles(fresh_dynamo):
    h = magi_zoo.load("flux-tiny", gpu="auto", overrides={"cuda_graphs": {"transformer": True}})
    plain = magi_zoo.load("flux-tiny", gpu="auto", overrides={"cuda_graphs": {"transformer": False}})
    t, tp = h.adapter.denoiser(h.pipe), plain.adapter.denoiser(plain.pipe)
    tp.load_state_dict(t.state_dict())
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    kw2 = h.adapter.denoiser_inputs(h.pipe, h.variant, seed=1)
    with torch.inference_mode():
        ref, ref2 = tp(**kw)[0], tp(**kw2)[0]
        before = counters.snapshot()
        out = t(**kw)[0]
        out2 = t(**kw2)[0]
        out_again = t(**kw)[0]
        d = counters.delta(before)
    assert _rel(out, ref) < 1e-3 and _rel(out2, ref2) < 1e-3
    assert torch.equal(out, out_again) and not torch.equal(out, out2)
    st = graphed(t).stats()
    assert st["graphs"] == 1 and st["replays"] == 3 and not st["uncaptured"]
    assert len(d.recompiles) == 0  # warm-up compiles once; replays never re-enter dynamo


@gpu
def test_wan_tiny_pipeline_with_graphed_denoiser(fresh_dynamo):
    kw = dict(prompt="a corgi", output_type="np", num_inference_steps=3,
              generator=None)
    h = magi_zoo.load("wan2.1-tiny", gpu="auto", overrides={"cuda_graphs": {"transformer": True}})
    plain = magi_zoo.load("wan2.1-tiny", gpu="auto")
    assert graphed(plain.pipe.transformer) is None  # Wan's spec does not capture (GPU-bound)
    plain.modules.load_state_dict(h.modules.state_dict())
    a = h(**{**kw, "generator": torch.Generator().manual_seed(0)}).frames
    b = plain(**{**kw, "generator": torch.Generator().manual_seed(0)}).frames
    assert abs(a - b).max() < 2e-2
    st = graphed(h.pipe.transformer).stats()
    assert st["graphs"] >= 1 and st["replays"] >= 3 and not st["uncaptured"]


@gpu
def test_flux_tiny_pipeline_shipped_spec_captures_and_matches_uncaptured(fresh_dynamo):
    h = magi_zoo.load("flux-tiny", gpu="auto")  # the h100/h200 spec captures the transformer
    if graphed(h.pipe.transformer) is None:
        pytest.skip(f"the {h.profile.name} spec does not capture the Flux transformer")
    plain = magi_zoo.load("flux-tiny", gpu="auto", overrides={"cuda_graphs": {"transformer": False}})
    plain.modules.load_state_dict(h.modules.state_dict())
    kw = dict(prompt="a corgi", output_type="np", num_inference_steps=3)
    a = h(**kw, generator=torch.Generator().manual_seed(0)).images
    b = plain(**kw, generator=torch.Generator().manual_seed(0)).images
    assert abs(a - b).max() < 2e-2
    st = graphed(h.pipe.transformer).stats()
    assert st["graphs"] == 1 and st["replays"] == 3 and not st["uncaptured"]
