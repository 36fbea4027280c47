"""The `fa3` attention backend: plan resolution, the missing-kernel error and `auto` fallback,
training (FA3 forward + cuDNN's backward; on CPU the tensor-op backward), and one fullgraph
region through diffusers' dispatch.

The real kernel (`fa3_fwd_interface`, the `hopper` extra) needs CUDA. On CPU a stand-in
(`tests/helpers/fa3_standins.py`)
module of the same name is put in `sys.modules`: its `_flash_attn_forward` is a
`torch.library` custom op with a fake, like the real one, computing SDPA on CPU. It
counts its eager calls, so a count that grows on every compiled call proves the op sits
in the compiled graph as an opaque node (a Python side effect traced into a graph would
run once, at trace time). The GPU tests at the end use the real kernel.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import magi_zoo
from magi_zoo import PlanError
from magi_zoo.engine import counters, remove
from magi_zoo.engine.kernels import fa3
from helpers.fa3_standins import CALLS, install_fa3

# -- the CPU stand-in for fa3_fwd_interface (tests/helpers/fa3_standins.py) -----------------

@pytest.fixture
def registry():
    """Restore diffusers' `_flash_3` registry entry and the kernel module's op after a test."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry as R

    m = AttentionBackendName._FLASH_3
    saved = (R._backends.get(m), R._constraints.get(m), R._supported_arg_names.get(m), fa3._forward)
    yield R
    R._backends[m], R._constraints[m], R._supported_arg_names[m], fa3._forward = saved


@pytest.fixture
def kernel(monkeypatch, registry):
    """fa3 'installed': the stand-in module is what `import fa3_fwd_interface` finds."""
    return install_fa3(monkeypatch)


@pytest.fixture
def no_kernel(monkeypatch, registry):
    """fa3 not installed, whatever this machine has (None in sys.modules fails the import)."""
    monkeypatch.setitem(sys.modules, fa3.MODULE, None)


@pytest.fixture(scope="module")
def wan():
    # bf16 (FA3's dtype) on the CPU; the h100 profile is passed to apply where fa3 must run.
    return magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", compile=False)


H100 = magi_zoo.get_profile("h100")
FA3_FIRST = H100.model_copy(update={"attention_backends": ("fa3", "native")})
NO_COMPILE = {"": False}


def _backends(module):
    return [m.processor._attention_backend for m in module.modules()
            if hasattr(getattr(m, "processor", None), "_attention_backend")]


def _forward(h, grad=False):
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    with torch.set_grad_enabled(grad):
        return h.pipe.transformer(**kw)[0]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# -- plan resolution --------------------------------------------------------------------------

def test_fa3_dispatches_through_diffusers_registry(wan, kernel, registry):
    from diffusers.models.attention_dispatch import AttentionBackendName

    ref = _forward(wan)
    rep = magi_zoo.apply(wan.modules, {"attention": {"transformer": "fa3"}, "compile": NO_COMPILE}, gpu="h100")
    # the registered backend, not a patched model: processors name diffusers' _flash_3 member,
    # whose registry entry is the engine's function
    assert set(_backends(wan.pipe.transformer)) == {AttentionBackendName._FLASH_3}
    assert registry._backends[AttentionBackendName._FLASH_3] is fa3.fa3_attention
    assert ("fa3 (fa3_fwd_interface in diffusers' _flash_3 slot; with gradients, cuDNN's attention backward; "
            "calls with a mask or dropout on SDPA) on transformer (8 attention layers)") \
        in rep.step("attention").did
    out = _forward(wan)
    # 4 blocks x (self + cross attention) = 8 kernel calls in one forward
    assert CALLS["eager"] == 8
    assert _rel(out, ref) < 1e-2  # the stand-in is SDPA: only bf16 rounding differs
    remove(wan.modules)
    assert set(_backends(wan.pipe.transformer)) == {None}


def test_fa3_missing_is_an_error_naming_the_extra(wan, no_kernel):
    with pytest.raises(RuntimeError, match=r"attention backend 'fa3': the FlashAttention-3 kernel "
                                           r"\(fa3_fwd_interface, wheel fa3-fwd\) is not installed: "
                                           r"pip install 'magi-zoo\[hopper\]'"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "fa3"}, "compile": NO_COMPILE}, gpu="h100")
    assert set(_backends(wan.pipe.transformer)) == {None}  # nothing left behind


def test_fa3_installed_but_not_loadable(monkeypatch, registry):
    # what a CUDA-less machine with the wheel installed says (its .so needs libc10_cuda)
    def broken():
        raise ImportError("libc10_cuda.so: cannot open shared object file")

    monkeypatch.setattr(fa3, "_import_kernel", broken)
    assert "is installed but does not load here (ImportError: libc10_cuda.so" in fa3.missing_reason()
    with pytest.raises(RuntimeError, match="does not load here"):
        fa3.register()


def test_fa3_needs_a_cuda_profile(wan, kernel):
    with pytest.raises(PlanError, match="'fa3' runs on CUDA GPUs; profile 'cpu' is cpu"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "fa3"}, "compile": NO_COMPILE}, gpu="cpu")


def test_typo_suggests_fa3(wan):
    with pytest.raises(ValueError, match="'fa' is not a diffusers backend -- did you mean 'fa3'"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "fa"}}, gpu="h100")


# -- auto --------------------------------------------------------------------------------------

def test_auto_prefers_fa3_when_installed(wan, kernel):
    from diffusers.models.attention_dispatch import AttentionBackendName

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning
        rep = magi_zoo.apply(wan.modules, {"attention": {"transformer": "auto"}, "compile": NO_COMPILE},
                             gpu=FA3_FIRST)
    assert set(_backends(wan.pipe.transformer)) == {AttentionBackendName._FLASH_3}
    assert rep.step("attention").did.startswith("fa3 (")
    remove(wan.modules)


def test_auto_falls_back_with_one_warning(wan, no_kernel):
    from diffusers.models.attention_dispatch import AttentionBackendName

    # two regions say auto: the choice is made once per apply, so one warning
    plan = {"attention": {"transformer.blocks.0": "auto", "transformer.blocks.1": "auto"}, "compile": NO_COMPILE}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rep = magi_zoo.apply(wan.modules, plan, gpu=FA3_FIRST)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "'auto' on profile 'h100' uses 'native': 'fa3' skipped" in msgs[0]
    assert "pip install 'magi-zoo[hopper]'" in msgs[0]
    # 2 blocks x 2 attention layers set to native, the other 2 blocks' 4 untouched
    got = _backends(wan.pipe.transformer)
    assert got.count(AttentionBackendName.NATIVE) == 4 and got.count(None) == 4
    assert "native on transformer.blocks.0 (2 attention layers; auto: 'fa3' skipped" in rep.step("attention").did
    remove(wan.modules)


def test_auto_skips_fa3_on_a_cpu_profile(wan, kernel):
    cpu_fa3 = magi_zoo.get_profile("cpu").model_copy(update={"attention_backends": ("fa3", "native")})
    with pytest.warns(RuntimeWarning, match="'fa3' skipped: it needs a CUDA GPU"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "auto"}, "compile": NO_COMPILE}, gpu=cpu_fa3)
    remove(wan.modules)


def test_auto_with_nothing_usable_is_an_error(wan, no_kernel):
    only_fa3 = H100.model_copy(update={"attention_backends": ("fa3",)})
    with pytest.raises(RuntimeError, match=r"'auto' on profile 'h100': none of \['fa3'\] can run here"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "auto"}, "compile": NO_COMPILE}, gpu=only_fa3)


def test_profile_preferences():
    from diffusers.models.attention_dispatch import AttentionBackendName

    from magi_zoo.engine.attention import ENGINE_BACKENDS
    from magi_zoo.specs.gpu_profiles import PROFILES, GpuProfile

    valid = {*ENGINE_BACKENDS, *(b.value for b in AttentionBackendName)}
    for p in PROFILES.values():
        assert p.attention_backends and set(p.attention_backends) <= valid
        assert p.attention_backend == p.attention_backends[0]  # the preferred choice
    # Hopper prefers fa3 (measured on an H100: benchmarks/results/attention/attention_kernels_h100.md)
    assert H100.attention_backends == magi_zoo.get_profile("h200").attention_backends == ("fa3", "native")
    assert magi_zoo.get_profile("a100").attention_backends == ("native",)
    base = dict(name="x", device="cuda", memory_gib=80, bf16=True)
    assert GpuProfile(**base, attention_backends=("FA3", "native")).attention_backends == ("fa3", "native")
    with pytest.raises(ValueError, match="at least one backend"):
        GpuProfile(**base, attention_backends=())
    with pytest.raises(ValueError, match="cannot contain 'auto'"):
        GpuProfile(**base, attention_backends=("auto",))


# -- what FA3 forward refuses -----------------------------------------------------------------

def _grads(h, inputs):
    """Loss-free backward of the denoiser's output: the gradients of every parameter."""
    out = h.pipe.transformer(**inputs)[0]
    params = [p for p in h.pipe.transformer.parameters() if p.requires_grad]
    return out.detach(), torch.autograd.grad(out.float().pow(2).mean(), params)


def test_fa3_trains_with_the_attention_gradient(kernel):
    """With gradients, fa3 runs the custom op magi_zoo::fa3_attention: FA3's forward and an
    exact backward (on CPU the tensor-op one from the same LSE cuDNN's takes)."""
    fa3.register()
    g = torch.Generator().manual_seed(0)
    for causal in (False, True):
        q, k, v = (torch.randn(2, 24, 3, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        out, lse = fa3.fa3_attention_trainable(q, k, v, 0.3, causal)
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3,
                                             is_causal=causal).transpose(1, 2)
        go = torch.randn_like(out)
        got, want = (torch.autograd.grad(o, (q, k, v), go) for o in (out, ref))
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-6, causal
    # the backend itself, bf16, as diffusers dispatches it
    q, k, v = (torch.randn(1, 32, 2, 16, generator=g, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fa3.fa3_attention(q, k, v).float().square().sum().backward()
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q2, k2, v2))).transpose(1, 2) \
        .square().sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert _rel(a.grad, b.grad) < 2e-2
    with pytest.raises(ValueError, match="with gradients takes equal query and key/value head counts"):
        fa3.fa3_attention(q, k[:, :, :1], v[:, :, :1], enable_gqa=True)
    with pytest.raises(ValueError, match="equal lengths when causal"):
        fa3.fa3_attention(q[:, :8], k, v, is_causal=True)


def test_fa3_wan_gradients_equal_native(wan, kernel):
    inputs = wan.adapter.example_inputs(wan.pipe, wan.variant, "denoise")
    ref_out, ref = _grads(wan, inputs)
    magi_zoo.apply(wan.modules, {"attention": {"transformer": "fa3"}, "compile": NO_COMPILE}, gpu="h100")
    try:
        out, got = _grads(wan, inputs)
        assert CALLS["eager"] == 8  # the FA3 (stand-in) forward ran once per attention layer
        assert _rel(out, ref_out) < 1e-2
        assert max(_rel(a, b) for a, b in zip(got, ref)) < 3e-2  # bf16 weights and activations
        with torch.inference_mode():
            _forward(wan)
    finally:
        remove(wan.modules)


def test_qwen_image_batch_of_unequal_prompts_runs_on_fa3(kernel):
    """Qwen-Image's shipped h100 plan puts its joint attention on `auto` (fa3). One prompt is
    unmasked (the pipeline drops an all-ones mask) and takes the kernel; a batch of prompts of
    different lengths masks the shorter one's padding, and those calls run on SDPA: the same
    output as the model on its native backend, the kernel not called."""
    h = magi_zoo.load("qwen-image-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant, batch=2, text_len=8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # the second prompt is 3 tokens shorter
    blocks = len(h.pipe.transformer.transformer_blocks)
    with torch.no_grad():
        ref = h.pipe.transformer(**{**kw, "encoder_hidden_states_mask": mask})[0]
        magi_zoo.apply(h.modules, {"attention": {"transformer": "fa3"}, "compile": NO_COMPILE}, gpu="h100")
        try:
            got = h.pipe.transformer(**{**kw, "encoder_hidden_states_mask": mask})[0]
            assert CALLS["eager"] == 0  # every joint attention of the batch is masked
            torch.testing.assert_close(got, ref, rtol=0, atol=0)
            h.pipe.transformer(**kw)  # no mask: the kernel serves every block
            assert CALLS["eager"] == blocks
        finally:
            remove(h.modules)


def test_masked_calls_run_on_sdpa_and_the_rest_is_refused(kernel):
    """FA3's forward has no mask and no dropout: such a call runs on SDPA with them (exactly
    SDPA's output, the kernel not called), directly and through diffusers' dispatch as a model
    calls it -- a batch of Qwen-Image prompts of different lengths masks its padding under the
    shipped `auto` (fa3) plan. What FA3 cannot serve at all is refused, saying what to use."""
    fa3.register()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
    mask[..., 5:] = False  # three padded keys
    sdpa = fa3.sdpa_bshd(q, k, v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), attn_mask=mask).transpose(1, 2)
    assert _rel(sdpa, ref) < 1e-2  # the mask is applied: bf16 rounding apart, the fp32 masked result
    assert _rel(sdpa, fa3.sdpa_bshd(q, k, v)) > 5e-2  # and it matters here
    torch.testing.assert_close(fa3.fa3_attention(q, k, v, attn_mask=mask), sdpa, rtol=0, atol=0)
    assert fa3.fa3_attention(q, k, v, dropout_p=0.5).shape == q.shape
    assert CALLS["eager"] == 0  # neither call reached the kernel
    with pytest.raises(ValueError, match="SDPA returns no LSE"):
        fa3.fa3_attention(q, k, v, attn_mask=mask, return_lse=True)
    with pytest.raises(TypeError, match="bfloat16 only \\(got torch.float32\\)"):
        fa3.fa3_attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="context parallelism"):
        fa3.fa3_attention(q, q, q, _parallel_config=object())
    # through diffusers' dispatch, as a model calls it
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    got = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=AttentionBackendName._FLASH_3)
    torch.testing.assert_close(got, sdpa, rtol=0, atol=0)
    assert CALLS["eager"] == 0
    out, lse = fa3.fa3_attention(q, q, q, return_lse=True)
    assert out.shape == (1, 8, 2, 16) and lse.shape == (1, 8, 2)  # diffusers' (B, S, H) LSE


def test_official_fa3_slot_is_left_alone(monkeypatch, registry):
    # with the official flash_attn_interface installed, diffusers' own _flash_3 already runs
    # FA3: fa3 maps to it and the registry entry is not replaced
    from diffusers.models import attention_dispatch as ad

    before = registry._backends[ad.AttentionBackendName._FLASH_3]
    monkeypatch.setattr(ad, "_CAN_USE_FLASH_ATTN_3", True)
    monkeypatch.setitem(sys.modules, fa3.MODULE, None)
    assert fa3.missing_reason() is None and "diffusers' own _flash_3" in fa3.describe()
    assert fa3.register() is ad.AttentionBackendName._FLASH_3
    assert registry._backends[ad.AttentionBackendName._FLASH_3] is before


# -- fullgraph: one region, no break ----------------------------------------------------------

def test_fa3_region_compiles_fullgraph_without_breaks(kernel, fresh_dynamo):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    ref = _forward(h)
    # The shipped Wan plan (WanTransformerBlock, fullgraph=true) with fa3; aot_eager instead of
    # inductor: the claim is about tracing (dynamo + AOTAutograd through the fake), not codegen.
    rep = magi_zoo.apply(h.modules, {"attention": {"transformer": "fa3"},
                                     "compile": {"WanTransformerBlock": {"backend": "aot_eager",
                                                                         "fullgraph": True}}}, gpu="h100")
    out = _forward(h)
    # 4 blocks share one compiled code object: 1 frame, and fullgraph means 0 breaks (a break
    # would have raised); 0 recompiles from block 1 on (same shapes, no_grad everywhere)
    counters.expect(rep.region("WanTransformerBlock").counters, frames=1, breaks=0, recompiles=0)
    assert _rel(out, ref) < 1e-2
    # Eager calls of the op grow by 8 per compiled forward: it runs inside the graph at every
    # call (4 blocks x 2 attention layers), so it is an opaque node, not traced-through Python.
    n = CALLS["eager"]
    _forward(h)
    assert CALLS["eager"] - n == 8
    remove(h.modules)


@pytest.mark.parametrize("recompute,forwards", [("full", 16), ({"policy": "selective", "save": ["attention"]}, 8)])
def test_fa3_trains_in_compiled_recompute_regions(kernel, fresh_dynamo, recompute, forwards):
    """Training through fullgraph regions with recompute: magi_zoo::fa3_attention is one opaque
    node, "full" re-runs its forward in backward (2 x 8 calls), selective "attention" keeps
    its output (8); the gradients equal native eager's."""
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    h.pipe.transformer.train().requires_grad_(True)
    inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    ref_out, ref = _grads(h, inputs)
    rep = magi_zoo.apply(h.modules, {"attention": {"transformer": "fa3"},
                                     "recompute": {"WanTransformerBlock": recompute},
                                     "compile": {"WanTransformerBlock": {"backend": "aot_eager", "fullgraph": True}}},
                         gpu="h100", train=True)
    try:
        _grads(h, inputs)  # compiles
        CALLS["eager"] = 0
        out, got = _grads(h, inputs)
        assert CALLS["eager"] == forwards
        counters.expect(rep.region("WanTransformerBlock").counters, frames=1, breaks=0, recompiles=0)
        assert _rel(out, ref_out) < 1e-2
        assert max(_rel(a, b) for a, b in zip(got, ref)) < 3e-2
    finally:
        remove(h.modules)


# -- attention layers that are not diffusers': BAGEL's MoT attention ----------------------------

def test_fa3_on_bagel_mot_attention(kernel):
    """BAGEL's MoT attention declares ATTENTION_BACKENDS; fa3 serves its calls without a mask
    (denoising and decode steps, GQA native), the causal text prefill stays on SDPA, the
    output equals native, remove() restores; an undeclared backend is refused."""
    h = magi_zoo.load("bagel-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    pipe, model = h.pipe, h.pipe.model
    kw = dict(height=32, width=32, num_inference_steps=2, cfg_img_scale=1.0, seed=3, output_type="pt")
    ref = pipe("a red fox", **kw)
    ctx = model.prefill_text(model.empty_context(), pipe.text_ids("hi"))
    rep = magi_zoo.apply(h.modules, {"attention": {"MoTAttention": "fa3"}, "compile": NO_COMPILE}, gpu="h100")
    try:
        layers = [m for m in model.modules() if type(m).__name__ == "MoTAttention"]
        assert {m.attention_backend for m in layers} == {"fa3"}
        assert "fa3 (fa3_fwd_interface" in rep.step("attention").did
        assert f"on MoTAttention ({len(layers)} attention layers)" in rep.step("attention").did
        CALLS["eager"] = 0
        model.prefill_text(model.empty_context(), pipe.text_ids("hi"))
        assert CALLS["eager"] == 0  # a causal mask: SDPA
        out = pipe("a red fox", **kw)
        assert CALLS["eager"] > 0 and _rel(out, ref) < 2e-2
        n = CALLS["eager"]
        model.decode_step(torch.tensor([5]), torch.tensor([ctx.rope]), ctx.keys, ctx.values)
        assert CALLS["eager"] - n == len(layers)  # one token over the cache: no mask, fa3
    finally:
        remove(h.modules)
    assert {m.attention_backend for m in layers} == {"native"}
    with pytest.raises(PlanError, match=r"MoTAttention dispatches 'native', 'fa3' \(its ATTENTION_BACKENDS\), "
                                        r"not '_native_flash'"):
        magi_zoo.apply(h.modules, {"attention": {"MoTAttention": "_native_flash"}, "compile": NO_COMPILE}, gpu="h100")
    assert {m.attention_backend for m in layers} == {"native"}
    # a refusal part-way (the second key matches no attention layer) leaves the first unset
    with pytest.raises(PlanError, match="has no attention layer under it that takes a backend"):
        magi_zoo.apply(h.modules, {"attention": {"MoTAttention": "fa3", "model.vae2llm": "fa3"},
                                   "compile": NO_COMPILE}, gpu="h100")
    assert {m.attention_backend for m in layers} == {"native"}


def test_fa3_bagel_layers_compile_fullgraph(kernel, fresh_dynamo):
    """BAGEL's MoT layers with fa3 in one fullgraph region: the kernel is an opaque node (its
    eager calls grow on every compiled call), 0 graph breaks, and the image equals native."""
    h = magi_zoo.load("bagel-tiny", gpu="cpu", dtype="bfloat16", compile=False)
    kw = dict(height=32, width=32, num_inference_steps=2, cfg_img_scale=1.0, seed=3, output_type="pt")
    ref = h.pipe("a red fox", **kw)
    rep = magi_zoo.apply(h.modules, {"attention": {"MoTAttention": "fa3"},
                                     "compile": {"BagelMoTLayer": {"backend": "aot_eager", "fullgraph": True,
                                                                   "dynamic": True}}}, gpu="h100")
    try:
        h.pipe("a red fox", **kw)  # compiles
        CALLS["eager"] = 0
        out = h.pipe("a red fox", **kw)
        assert CALLS["eager"] > 0 and _rel(out, ref) < 2e-2
        r = rep.region("BagelMoTLayer").counters
        assert r.n_graph_breaks == 0 and r.frames >= 1
    finally:
        remove(h.modules)


# -- benchmark smoke --------------------------------------------------------------------------

def test_attention_kernels_benchmark_smoke(tmp_path, no_kernel):
    import json

    from benchmarks import attention_kernels

    attention_kernels.main(["--smoke", "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "attention_kernels_cpu.json").read_text())
    rows = {(r["shape"], r["kernel"]): r for r in rec["kernels"]}
    assert set(rows) == {(s, k) for s in attention_kernels.SHAPES for k in attention_kernels.KERNELS}
    sdpa = rows[("wan-1.3b", "sdpa")]
    assert sdpa["status"] == "ok" and sdpa["tflops"] > 0 and sdpa["runs"] == 5 and sdpa["rel_err_vs_fp32"] < 2e-2
    assert rows[("wan-1.3b", "fa3")]["status"] == "skipped: fa3 needs CUDA"
    model = {r["attention"]: r for r in rec["model"]}
    assert model["shipped"]["status"] == "ok" and model["shipped"]["median_ms"] > 0
    assert (model["shipped"]["frames"], model["shipped"]["graph_breaks"]) == (1, 0)
    assert model["fa3"]["status"] == "skipped: fa3 needs CUDA"
    assert (tmp_path / "attention_kernels_cpu.md").read_text().startswith("# Attention kernels")


def test_attention_kernels_benchmark_fa3_rows_with_standin(tmp_path, kernel, monkeypatch):
    # The fa3 code paths of the script, which only a GPU runs for real: the stand-in kernel on
    # CPU, planned for the h100 profile (bf16) so the attention step accepts fa3.
    import json

    from benchmarks import attention_kernels

    monkeypatch.setattr(attention_kernels, "_fa3_missing", lambda device: None)
    attention_kernels.main(["--smoke", "--gpu", "h100", "--shapes", "wan-1.3b", "--kernels", "sdpa,fa3,fa3_dispatch",
                            "--out", str(tmp_path)])
    rec = json.loads((tmp_path / "attention_kernels_cpu.json").read_text())
    rows = {r["kernel"]: r for r in rec["kernels"]}
    for k in ("fa3", "fa3_dispatch"):
        assert rows[k]["status"] == "ok" and rows[k]["rel_err_vs_fp32"] < 2e-2, rows[k]
    model = {r["attention"]: r for r in rec["model"]}
    assert model["fa3"]["status"] == "ok", model["fa3"]
    assert model["fa3"]["attention_step"].startswith("fa3 (") and model["fa3"]["graph_breaks"] == 0
    assert model["fa3"]["rel_err_vs_shipped"] < 2e-2 and model["fa3"]["speedup_vs_shipped"] > 0


# -- GPU: the real kernel ----------------------------------------------------------------------

def _need_fa3():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = fa3.missing_reason()
    if why:
        pytest.skip(why)


@pytest.mark.gpu
def test_fa3_kernel_matches_sdpa_on_cuda():
    _need_fa3()
    fa3.register()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    with torch.no_grad():
        out = fa3.fa3_attention(q, k, v)
        ref = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_fa3_training_gradients_match_cudnn_sdpa_on_cuda(causal):
    """FA3's forward + cuDNN's backward (fed FA3's output and LSE) against SDPA's own cuDNN
    forward + backward, and both against fp32."""
    _need_fa3()
    fa3.register()
    assert fa3.cudnn_backward_available(torch.device("cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4096, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    go = torch.randn(1, 4096, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    out = fa3.fa3_attention(q, k, v, is_causal=causal)
    got = torch.autograd.grad(out, (q, k, v), go)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)
    want = torch.autograd.grad(ref, (q, k, v), go)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref32 = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q32, k32, v32)),
                                           is_causal=causal).transpose(1, 2)
    exact = torch.autograd.grad(ref32, (q32, k32, v32), go.float())
    for a, b, e in zip(got, want, exact):
        assert _rel(a, e) < 2e-2 and _rel(a, e) < 1.5 * _rel(b, e) + 1e-3, (_rel(a, e), _rel(b, e))


@pytest.mark.gpu
def test_fa3_wan_tiny_matches_native_on_cuda():
    _need_fa3()
    h = magi_zoo.load("wan2.1-tiny", gpu="auto", compile=False)
    assert h.dtype == torch.bfloat16 and h.device.type == "cuda"
    h.pipe.transformer.requires_grad_(True)
    inputs = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    ref_out, ref = _grads(h, inputs)
    magi_zoo.apply(h.modules, {"attention": {"transformer": "fa3"}, "compile": NO_COMPILE}, gpu=h.profile)
    assert _rel(_forward(h), ref_out) < 2e-2
    out, got = _grads(h, inputs)  # with gradients: cuDNN's backward
    assert _rel(out, ref_out) < 2e-2 and max(_rel(a, b) for a, b in zip(got, ref)) < 5e-2
    remove(h.modules)


@pytest.mark.gpu
def test_fa3_wan_tiny_regional_fullgraph_on_cuda(fresh_dynamo):
    _need_fa3()
    # the shipped plan (WanTransformerBlock fullgraph, inductor) with fa3 on the transformer;
    # compile=False keeps it unapplied until the native eager reference is taken
    h = magi_zoo.load("wan2.1-tiny", gpu="auto", compile=False,
                      overrides={"attention": {"transformer": {"backend": "fa3"}}})
    ref = _forward(h)
    rep = h.apply_plan()
    out = _forward(h)
    assert "fa3 (" in rep.step("attention").did
    r = rep.region("WanTransformerBlock")
    assert (r.counters.frames, r.counters.n_graph_breaks, len(r.counters.recompiles)) == (1, 0, 0)
    assert _rel(out, ref) < 2e-2


def test_short_names_for_sdpa_kernels(wan):
    """'sdpa', 'cudnn' and 'efficient' name torch SDPA's kernels (diffusers' underscored
    names); the report shows what they resolved to; a typo still gets a did-you-mean."""
    from diffusers.models.attention_dispatch import AttentionBackendName as A

    for short, member in (("sdpa", A.NATIVE), ("cudnn", A._NATIVE_CUDNN), ("efficient", A._NATIVE_EFFICIENT)):
        rep = magi_zoo.apply(wan.modules, {"attention": {"transformer": short}, "compile": NO_COMPILE}, gpu="cpu")
        try:
            assert set(_backends(wan.pipe.transformer)) == {member}
            assert rep.step("attention").did.startswith(f"{member.value} on transformer")
        finally:
            magi_zoo.remove(wan.modules)
    with pytest.raises(ValueError, match="attention backend 'cudn' is not a diffusers backend -- did you mean 'cudnn'"):
        magi_zoo.apply(wan.modules, {"attention": {"transformer": "cudn"}, "compile": NO_COMPILE}, gpu="cpu")


@pytest.mark.gpu
def test_fa3_bagel_tiny_matches_native_on_cuda():
    _need_fa3()
    h = magi_zoo.load("bagel-tiny", gpu="auto", dtype="bfloat16", compile=False)
    kw = dict(height=64, width=64, num_inference_steps=2, cfg_img_scale=1.0, seed=3, output_type="pt")
    ref = h.pipe("a red fox", **kw)
    magi_zoo.apply(h.modules, {"attention": {"MoTAttention": "fa3"}, "compile": NO_COMPILE}, gpu=h.profile)
    try:
        assert _rel(h.pipe("a red fox", **kw), ref) < 2e-2
    finally:
        remove(h.modules)


# -- transformers' attention layers (Qwen3-Omni) -------------------------------------------

def _qwen_text_layers(h):
    from magi_zoo.engine.attention import transformers_layers

    return [m for m in transformers_layers(h.modules["thinker"]) if type(m).__name__.endswith("TextAttention")]


def test_transformers_layers_get_their_own_config_and_undo():
    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)
    layers = _qwen_text_layers(h)
    originals = [m.config for m in layers]
    model_impl = originals[0]._attn_implementation
    rep = magi_zoo.apply(h.modules, {"compile": {"": False}, "attention": {"Qwen3OmniMoeThinkerTextModel": "sdpa"}},
                         gpu="cpu")
    assert f"sdpa (transformers) on Qwen3OmniMoeThinkerTextModel ({len(layers)} attention layers)" in \
        rep.step("attention").did
    assert all(m.config is not o and m.config._attn_implementation == "sdpa" for m, o in zip(layers, originals))
    assert originals[0]._attn_implementation == model_impl  # the shared config is not touched
    magi_zoo.remove(h.modules)
    assert [m.config for m in layers] == originals


def test_transformers_layers_refuse_backends_they_cannot_take():
    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)
    with pytest.raises(PlanError, match="transformers attention layer; it takes 'native', 'fa3' or 'auto'"):
        magi_zoo.apply(h.modules, {"compile": {"": False},
                                   "attention": {"Qwen3OmniMoeThinkerTextModel": "cudnn"}}, gpu="cpu")
    with pytest.raises(PlanError, match="runs on CUDA GPUs"):
        magi_zoo.apply(h.modules, {"compile": {"": False},
                                   "attention": {"Qwen3OmniMoeThinkerTextModel": "fa3"}}, gpu="cpu")
    assert all(m.config._attn_implementation == "sdpa" for m in _qwen_text_layers(h))  # nothing left set


@pytest.mark.parametrize("case, want", [
    ("plain", True), ("mask", False), ("dropout", False), ("window", False), ("cpu", False),
    ("causal_prefix", False), ("decode", True), ("grad_gqa", False), ("grad_mha", True), ("bias", False),
    ("varlen", False),
])
def test_fa3_serves_only_calls_it_computes_as_sdpa(case, want, monkeypatch):
    """`serves` on the cases a transformers layer passes (on CPU the device check is patched out
    except in the "cpu" case)."""
    from magi_zoo.engine.kernels import fa3

    q = torch.randn(1, 4, 6, 8, dtype=torch.bfloat16)
    k = torch.randn(1, 4 if case != "grad_gqa" else 2, 1 if case == "decode" else 6, 8, dtype=torch.bfloat16)
    if case != "cpu":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    if case == "causal_prefix":
        k = torch.randn(1, 4, 9, 8, dtype=torch.bfloat16)
    if case == "decode":
        q = torch.randn(1, 4, 1, 8, dtype=torch.bfloat16)
        k = torch.randn(1, 4, 9, 8, dtype=torch.bfloat16)
    if case.startswith("grad"):
        q.requires_grad_(True)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool) if case == "mask" else None
    kwargs = {"window": {"sliding_window": 4}, "bias": {"position_bias": torch.zeros(1, 4, 6, 6)},  # T5's
              "varlen": {"cu_seq_lens_q": torch.tensor([0, 6])}}.get(case, {})
    causal = case != "decode"  # transformers_attention drops causality for one query token
    assert fa3.serves(q, k, mask, 0.1 if case == "dropout" else 0.0, causal, kwargs) is want


def test_transformers_function_falls_back_to_sdpa_exactly_on_cpu():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from magi_zoo.engine.kernels import fa3

    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)
    layer = _qwen_text_layers(h)[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 5, 16, generator=g) for n in (4, 2, 2))
    layer.num_key_value_groups = 2
    got, _ = fa3.transformers_attention(layer, q, k, v, None, scaling=0.25)
    want, _ = sdpa_attention_forward(layer, q, k, v, None, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_qwen_thinker_on_fa3_equals_sdpa():
    """The tiny thinker's text model, prompt-length prefill (unmasked: FA3 serves it) and a
    decode step (masked: SDPA), fa3 against native."""
    from magi_zoo.engine.kernels import fa3

    if not fa3.available():
        pytest.skip(fa3.missing_reason())
    outs = {}
    for backend in ("native", "fa3"):
        h = magi_zoo.load("qwen3-omni-tiny", gpu="h100", compile=False, dtype=torch.bfloat16)
        magi_zoo.apply(h.modules, {"compile": {"": False},
                                   "attention": {"Qwen3OmniMoeThinkerTextModel": backend}}, gpu="h100")
        calls = []
        real = fa3.fa3_attention
        fa3.fa3_attention = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            ids = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(0)).cuda()
            with torch.inference_mode():
                outs[backend] = h.modules["thinker"](input_ids=ids).logits.float()
        finally:
            fa3.fa3_attention = real
        assert bool(calls) == (backend == "fa3")
    err = (outs["fa3"] - outs["native"]).norm() / outs["native"].norm()
    assert err < 2e-2, err


def test_auto_maps_a_choice_transformers_layers_cannot_take_to_native():
    from magi_zoo.specs.gpu_profiles import GpuProfile

    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)
    # a profile whose first auto choice is a diffusers-only kernel (SDPA's cuDNN)
    profile = GpuProfile(name="cudnn-first", device="cpu", memory_gib=16, bf16=False,
                         attention_backends=("cudnn", "native"))
    from magi_zoo.engine.attention import auto_backend

    assert auto_backend(profile)[0] == "cudnn"  # what auto picks: diffusers' layers would take it
    rep = magi_zoo.apply(h.modules, {"compile": {"": False}, "attention": {"Qwen3OmniMoeThinkerTextModel": "auto"}},
                         gpu=profile)
    assert "sdpa (transformers) on Qwen3OmniMoeThinkerTextModel" in rep.step("attention").did
    assert all(m.config._attn_implementation == "sdpa" for m in _qwen_text_layers(h))


def test_auto_gives_transformers_layers_native_when_only_the_official_fa3_is_installed(no_kernel, monkeypatch):
    # The official flash_attn_interface serves diffusers' layers (auto picks fa3 for them), but
    # transformers' layers call the fa3-fwd wheel's op: without the wheel they get SDPA, with
    # one warning naming the wheel -- not an error halfway through apply.
    monkeypatch.setattr(fa3, "official_fa3", lambda: True)
    from magi_zoo.engine.attention import auto_backend

    assert auto_backend(FA3_FIRST)[0] == "fa3"
    h = magi_zoo.load("qwen3-omni-tiny", gpu="cpu", compile=False)
    with pytest.warns(RuntimeWarning, match="uses 'native' instead of 'fa3'.*fa3-fwd") as caught:
        rep = magi_zoo.apply(h.modules, {"compile": {"": False},
                                         "attention": {"Qwen3OmniMoeThinkerTextModel": "auto"}}, gpu=FA3_FIRST)
    assert len([w for w in caught if "instead of 'fa3'" in str(w.message)]) == 1  # once per region
    assert "sdpa (transformers; auto: 'fa3' skipped" in rep.step("attention").did
    assert all(m.config._attn_implementation == "sdpa" for m in _qwen_text_layers(h))
    # named explicitly, the same request is an error naming the extra
    with pytest.raises(RuntimeError, match="fa3-fwd"):
        magi_zoo.apply(h.modules, {"compile": {"": False},
                                   "attention": {"Qwen3OmniMoeThinkerTextModel": "fa3"}}, gpu=FA3_FIRST)
