"""The precision section: fp8 linears (row-wise scales, torch._scaled_mm) in the regions a
spec declares, refused on cards without fp8, traced whole, undone exactly. torch's CPU
build runs _scaled_mm too, so the real path is tested here; speed is a GPU benchmark."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import magi_zoo
from magi_zoo.engine import counters, remove
from magi_zoo.engine.precision import Fp8Linear, reference_linear
from magi_zoo.overrides import with_precision
from magi_zoo.specs import PlanLayer
from helpers.fa3_standins import fa3_fp8_forward

# The CPU profile with fp8 switched on: the step's checks pass and its ops run on the CPU.
CPU_FP8 = magi_zoo.get_profile("cpu").model_copy(update={"fp8": True})


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_linear_matches_its_definition_and_is_close_to_fp32():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    x = torch.randn(2, 5, 64)
    f = Fp8Linear(lin)
    assert f.weight_fp8.dtype == torch.float8_e4m3fn and f.weight_scale.shape == (1, 48)
    y = f(x)
    assert y.shape == (2, 5, 48) and y.dtype == x.dtype
    # exactly the product of the dequantized operands (fp32 accumulation)...
    torch.testing.assert_close(y, reference_linear(x, f), rtol=1e-5, atol=1e-5)
    # ...which is e4m3 rounding away from fp32: 3 mantissa bits, ~2^-4 relative per operand,
    # averaging down over the 64-long dot products to a few percent at most.
    assert _rel(y, lin(x)) < 5e-2


@pytest.fixture(scope="module")
def wan():
    return magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)


def _forward(h):
    kw = h.adapter.example_inputs(h.pipe, h.variant, "denoise")
    with torch.no_grad():
        return h.pipe.transformer(**kw)[0]


def test_fp8_region_swaps_block_linears_traces_whole_and_undoes(wan, fresh_dynamo):
    ref = _forward(wan)
    before = {k: v.clone() for k, v in wan.pipe.transformer.state_dict().items()}
    layers = with_precision([("model default", PlanLayer(precision={"WanTransformerBlock": "bf16"},
                                                         compile={"WanTransformerBlock": {"backend": "aot_eager",
                                                                                          "fullgraph": True}}))],
                            "fp8")
    with pytest.warns(RuntimeWarning, match="attention stays bf16: its attention layers use the library default"):
        rep = magi_zoo.apply(wan.modules, layers=layers, gpu=CPU_FP8)
    # per Wan block: self-attention q, k, v, out + cross-attention q, k, v, out + FFN in, out = 10
    # linears, x 4 blocks = 40; all dims (32, 64) are multiples of 16
    assert rep.step("precision").details == {"fp8_linears": 40, "skipped": 0, "fp8_attention_layers": 0,
                                           "gelu_epilogues": 0,  # the fp8 up projections: fuse_gelu, not the epilogue
                                           "norm_act_fusions": 0}
    # the 4 FFNs: GELU, bias and quantization of the down projection's input in one kernel
    assert "fp8 matmuls on WanTransformerBlock (40 linears, 4 FeedForward GELU(s) quantized in one pass)" \
        in rep.step("precision").did
    # fp8 attention runs on fa3 only; these layers use the library default and say so
    assert "attention on WanTransformerBlock stays bf16" in rep.step("precision").did
    assert sum(isinstance(m, Fp8Linear) for m in wan.pipe.transformer.modules()) == 40
    before_c = counters.snapshot()
    out = _forward(wan)
    # fullgraph blocks with _scaled_mm inside: 4 blocks, one compiled frame, no break
    counters.expect(counters.delta(before_c), frames=1, breaks=0, recompiles=0)
    # 40 fp8 matmuls in sequence stay within a few percent of fp32 here (the GPU
    # benchmark measures the real models against fp32)
    assert _rel(out, ref) < 1e-1
    remove(wan.modules)
    assert not any(isinstance(m, Fp8Linear) for m in wan.pipe.transformer.modules())
    after = wan.pipe.transformer.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # restored exactly
    torch.testing.assert_close(_forward(wan), ref, rtol=0, atol=0)


def test_fp8_attention_takes_fa3_for_layers_nobody_chose_a_backend_for(wan, monkeypatch):
    """Asking for fp8 attention asks for its kernel: layers on the library default move to fp8
    FA3 when fa3 can run (here: pretended), and back on undo; layers on a backend the plan
    chose stay bf16 with a warning."""
    from magi_zoo.engine import attention as att
    from magi_zoo.engine.kernels import fa3

    monkeypatch.setattr(att, "unavailable_reason", lambda name, profile: None)
    monkeypatch.setattr(fa3, "register_fp8", lambda: "fp8-slot")
    procs = att.processors(wan.pipe.transformer)
    assert procs and all(p._attention_backend is None for p in procs)
    layers = with_precision([("model default", PlanLayer(precision={"WanTransformerBlock": "bf16"},
                                                         compile={"": False}))], "fp8")
    rep = magi_zoo.apply(wan.modules, layers=layers, gpu=CPU_FP8)
    assert all(p._attention_backend == "fp8-slot" for p in procs)
    assert rep.step("precision").details["fp8_attention_layers"] == len(procs)
    assert (f"({len(procs)} layers, fa3 e4m3, per-head scales, K/V smoothed; {len(procs)} from the library default; "
            "a call with a mask or dropout runs bf16 on SDPA)") in rep.step("precision").did
    remove(wan.modules)
    assert all(p._attention_backend is None for p in procs)
    chosen = [("model default", PlanLayer(precision={"WanTransformerBlock": "bf16"}, compile={"": False},
                                          attention={"WanTransformer3DModel": {"backend": "native"}}))]
    with pytest.warns(RuntimeWarning, match="attention stays bf16: its attention layers use native"):
        rep = magi_zoo.apply(wan.modules, layers=with_precision(chosen, "fp8"), gpu=CPU_FP8)
    assert rep.step("precision").details["fp8_attention_layers"] == 0
    remove(wan.modules)


def test_fp8_refused_without_fp8_matmuls(wan):
    with pytest.raises(ValueError, match="precision='fp8' needs a card with fp8 matmuls.*profile 'cpu'"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", precision="fp8")
    with pytest.raises(ValueError, match="fp8 needs a card with fp8.*profile 'a100'"):
        magi_zoo.apply(wan.modules, {"precision": {"WanTransformerBlock": "fp8"}, "compile": {"": False}}, gpu="a100")
    assert not any(isinstance(m, Fp8Linear) for m in wan.pipe.transformer.modules())
    with pytest.raises(ValueError, match="choices: bf16, fp8"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", precision="fp16")
    with pytest.raises(ValueError, match="unknown field 'matmull' -- did you mean 'matmul'"):
        PlanLayer(precision={"WanTransformerBlock": {"matmull": "fp8"}})


def test_with_precision_needs_declared_regions_and_merges_over_user():
    with pytest.raises(ValueError, match="declares no fp8 regions"):
        with_precision([("model default", PlanLayer(compile={"Block": {}}))], "fp8")
    layers = [("model default", PlanLayer(precision={"Block": "bf16"})),
              ("user", PlanLayer(compile={"Block": {"dynamic": True}}))]
    out = with_precision(layers, "fp8")
    assert [n for n, _ in out] == ["model default", "user"]
    user = out[-1][1]
    assert user.entries("precision")["Block"].matmul == "fp8"
    assert [s.dynamic for _, _, s in user.items("compile")] == [True]


# -- fp8 attention ---------------------------------------------------------------------------

def _attn_inputs(offset: float):
    """(B, S, H, D) q, k, v with the structure real models have: K and V carry a per-channel
    offset shared by all tokens (what smoothing removes)."""
    g = torch.Generator().manual_seed(0)
    b, s, h, d = 1, 256, 2, 64
    q = torch.randn(b, s, h, d, generator=g)
    k = torch.randn(b, s, h, d, generator=g) + offset * torch.randn(1, 1, h, d, generator=g)
    v = torch.randn(b, s, h, d, generator=g) + offset * torch.randn(1, 1, h, d, generator=g)
    return q, k, v


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_fp8_attention_quantization_is_exact_where_promised_and_smoothing_helps():
    from magi_zoo.engine.kernels import fp8_scales

    q, k, v = _attn_inputs(offset=8.0)
    q8, qs, mean = fp8_scales.quantize_per_head(q, smooth=False)
    assert q8.dtype == torch.float8_e4m3fn and qs.shape == (1, 2) and mean is None
    # per-head scale: each head's largest element maps to the top of e4m3's range
    torch.testing.assert_close((q8.float().abs().amax(dim=(1, 3))), torch.full((1, 2), 448.0))
    ref = _sdpa(q, k, v)
    # smoothing K and V is an exact rewrite of attention (shown here without quantization)
    km, vm = k.mean(1, keepdim=True), v.mean(1, keepdim=True)
    torch.testing.assert_close(_sdpa(q, k - km, v - vm) + vm, ref, rtol=1e-4, atol=1e-5)
    # ... and it lets the per-head scales resolve the part that varies: error well below one
    # scale per tensor on the same inputs (docs/precision.md#fp8-attention; measured 5.4e-2 on the GPU)
    err_smooth = _rel(fp8_scales.fp8_reference(q, k, v), ref)

    def per_tensor(t):
        s = t.abs().amax() / 448.0
        return (t / s).to(torch.float8_e4m3fn).float() * s

    err_tensor = _rel(_sdpa(per_tensor(q), per_tensor(k), per_tensor(v)), ref)
    assert err_smooth < 3e-2 and err_smooth < err_tensor / 3, (err_smooth, err_tensor)


def test_smoothed_scale_from_one_pass_equals_the_two_pass_amax():
    """`quantize_per_head(smooth=True)` takes the scale from the per-channel mean, max and min
    (one reduction pass) instead of amax(|x - mean|) after the mean (two): the same bits."""
    from magi_zoo.engine.kernels import fp8_scales

    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(2, 257, 3, 32, generator=g) * torch.rand(1, 1, 3, 32, generator=g) * 10
             + torch.randn(1, 1, 3, 32, generator=g) * 5).bfloat16()
        mean = x.float().mean(dim=1, keepdim=True)
        two_pass = (x.float() - mean).abs().amax(dim=(1, 3)).clamp(min=1e-12) / fp8_scales.FP8_MAX
        q8, descale, m = fp8_scales.quantize_per_head(x, smooth=True)
        assert torch.equal(descale, two_pass) and torch.equal(m, mean)
        want = ((x.float() - mean) / two_pass[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(q8.view(torch.uint8), want.view(torch.uint8))


def test_fp8_attention_switches_fa3_layers_traces_whole_and_undoes(wan, monkeypatch, fresh_dynamo):
    """On the fa3 layers of an fp8 region the precision step swaps in fp8 FA3 (a CPU stand-in
    of the kernel here: FA3's op signature, dequantize-then-SDPA), fullgraph, undone exactly."""
    from diffusers.models.attention_dispatch import AttentionBackendName as A, _AttentionBackendRegistry as R

    from magi_zoo.engine.kernels import fa3

    monkeypatch.setattr(fa3, "register", lambda: A._FLASH_3)
    monkeypatch.setattr(fa3, "_forward", fa3_fp8_forward)
    saved = R._backends.get(A._FLASH_3_HUB), R._constraints.get(A._FLASH_3_HUB), R._supported_arg_names.get(A._FLASH_3_HUB)
    procs = [m.processor for m in wan.pipe.transformer.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    prior = [p._attention_backend for p in procs]
    try:
        for p in procs:  # what the attention step leaves when it chose fa3
            p._attention_backend = A._FLASH_3
        layers = with_precision([("model default", PlanLayer(
            precision={"WanTransformerBlock": "bf16"},
            compile={"WanTransformerBlock": {"backend": "aot_eager", "fullgraph": True}}))], "fp8")
        layers[-1][1].entries("precision")  # both fields flipped
        assert layers[-1][1].entries("precision")["WanTransformerBlock"].attention == "fp8"
        wb = wan.pipe.transformer.to(torch.bfloat16)
        rep = magi_zoo.apply(wan.modules, layers=layers, gpu=CPU_FP8)
        det = rep.step("precision").details
        assert det["fp8_attention_layers"] == 8 and "fp8 attention on WanTransformerBlock (8 layers" in rep.step("precision").did
        assert {p._attention_backend for p in procs} == {A._FLASH_3_HUB}
        assert R._backends[A._FLASH_3_HUB] is fa3.fa3_fp8_attention
        before_c = counters.snapshot()
        kw = wan.adapter.example_inputs(wan.pipe, wan.variant, "denoise")
        kw = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
        with torch.no_grad():
            out = wb(**kw)[0]
        counters.expect(counters.delta(before_c), frames=1, breaks=0, recompiles=0)
        assert torch.isfinite(out.float()).all()
        remove(wan.modules)
        assert [p._attention_backend for p in procs] == [A._FLASH_3] * len(procs)
    finally:
        for p, b in zip(procs, prior):
            p._attention_backend = b
        wan.pipe.transformer.to(torch.float32)
        R._backends[A._FLASH_3_HUB], R._constraints[A._FLASH_3_HUB], R._supported_arg_names[A._FLASH_3_HUB] = saved


def test_fp8_attention_hands_masked_calls_to_sdpa_in_one_graph(monkeypatch, fresh_dynamo):
    """A call FA3 cannot compute (a mask, dropout) runs bf16 on SDPA -- exactly SDPA's output,
    the fp8 kernel not called -- while an unmasked call takes the kernel (a CPU stand-in);
    both in one fullgraph compile. What LTX-2's blocks need: unmasked self-attention beside
    text cross-attention with the prompt mask. Context parallelism and LSE stay refused."""
    from magi_zoo.engine.kernels import fa3

    calls = []

    def standin(*args, **kwargs):
        calls.append(args[0].shape)
        return fa3_fp8_forward(*args, **kwargs)

    monkeypatch.setattr(fa3, "_forward", standin)
    q, k, v = (t.to(torch.bfloat16) for t in _attn_inputs(offset=0.0))
    mask = torch.ones(q.shape[0], 1, 1, k.shape[1], dtype=torch.bool)
    mask[..., k.shape[1] // 2:] = False  # half the keys padding

    def block(q, k, v, mask):
        return fa3.fa3_fp8_attention(q, k, v), fa3.fa3_fp8_attention(q, k, v, attn_mask=mask)

    before = counters.snapshot()
    unmasked, masked = torch.compile(block, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    counters.expect(counters.delta(before), frames=1, breaks=0, recompiles=0)
    assert len(calls) == 1  # the kernel was reached by the unmasked call only
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(masked, ref)
    # the masked call ignores the padded keys: not what attending them all gives
    assert _rel(masked, fa3.sdpa_bshd(q, k, v)) > 1e-2
    assert _rel(unmasked, _sdpa(q, k, v)) < 5e-2
    with pytest.raises(ValueError, match="no context parallelism and returns no LSE"):
        fa3.fa3_fp8_attention(q, k, v, return_lse=True)


def test_keep_bf16_keeps_named_linears_and_rejects_patterns_that_match_nothing(wan):
    plan = {"precision": {"WanTransformerBlock": {"matmul": "fp8", "keep_bf16": "ffn.net.2", "fast_accum": True}},
            "compile": {"": False}}
    rep = magi_zoo.apply(wan.modules, plan, gpu=CPU_FP8)
    try:
        blocks = wan.pipe.transformer.blocks
        assert all(type(b.ffn.net[2]) is nn.Linear and isinstance(b.ffn.net[0].proj, Fp8Linear) for b in blocks)
        assert all(b.attn1.to_q.fast_accum for b in blocks)
        assert "(36 linears, 4 kept bf16 by keep_bf16, fast accumulation)" in rep.step("precision").did
    finally:
        remove(wan.modules)
    with pytest.raises(ValueError, match=r"keep_bf16 pattern\(s\) \['ffn.net.9'\] match no linear under "
                                         r"WanTransformerBlock; its linears: attn1.to_k, "):
        magi_zoo.apply(wan.modules, {"precision": {"WanTransformerBlock": {"matmul": "fp8", "keep_bf16": ["ffn.net.9"]}},
                                     "compile": {"": False}}, gpu=CPU_FP8)
    assert not any(isinstance(m, Fp8Linear) for m in wan.pipe.transformer.modules())


def test_keep_originals_false_drops_the_bf16_linears_and_remove_keeps_the_fp8_ones():
    """A model built in host memory to stream (`load` passes keep_originals=False): no host copy
    of a swapped linear survives the apply (weak references to the originals die), the report
    says remove() keeps the fp8 linears, and a second apply adopts them as an fp8 checkpoint's."""
    import gc
    import weakref

    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    blocks = h.pipe.transformer.blocks
    originals = [weakref.ref(b.attn1.to_q.weight) for b in blocks]
    plan = {"precision": {"WanTransformerBlock": {"matmul": "fp8"}}, "compile": {"": False}}
    rep = magi_zoo.apply(h.modules, plan, gpu=CPU_FP8, keep_originals=False)
    gc.collect()
    assert all(r() is None for r in originals)  # dropped, not held for the undo
    assert rep.step("precision").details["fp8_linears"] == 40
    assert "the 40 bf16 originals were released" in rep.step("precision").did
    remove(h.modules)
    assert sum(isinstance(m, Fp8Linear) for m in h.pipe.transformer.modules()) == 40
    again = magi_zoo.apply(h.modules, plan, gpu=CPU_FP8)
    assert "40 already fp8 from the checkpoint" in again.step("precision").did
    remove(h.modules)
    # the default keeps them: the same apply on a fresh model restores bf16 exactly
    h2 = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    rep2 = magi_zoo.apply(h2.modules, plan, gpu=CPU_FP8)
    assert "released" not in rep2.step("precision").did
    remove(h2.modules)
    assert not any(isinstance(m, Fp8Linear) for m in h2.pipe.transformer.modules())


def test_fp8_attention_slot_is_refused_only_when_diffusers_hub_fa3_serves_it(monkeypatch):
    """`kernels` installed (transformers depends on it) does not block fp8 attention; diffusers
    having fetched its Hub FA3 into the `_flash_3_hub` slot in this process does, by name."""
    import diffusers.utils
    from diffusers.models import attention_dispatch as ad
    from diffusers.models.attention_dispatch import AttentionBackendName as A, _AttentionBackendRegistry as R

    from magi_zoo.engine.compat import diffusers as diffusers_compat
    from magi_zoo.engine.kernels import fa3

    monkeypatch.setattr(diffusers.utils, "is_kernels_available", lambda: True)
    monkeypatch.setattr(fa3, "_forward", fa3_fp8_forward)
    saved = R._backends.get(A._FLASH_3_HUB), R._constraints.get(A._FLASH_3_HUB), R._supported_arg_names.get(A._FLASH_3_HUB)
    try:
        assert not diffusers_compat.hub_kernel_loaded(A._FLASH_3_HUB)
        assert fa3.register_fp8() == A._FLASH_3_HUB
        assert diffusers_compat.registered_backend(A._FLASH_3_HUB) is fa3.fa3_fp8_attention
    finally:
        R._backends[A._FLASH_3_HUB], R._constraints[A._FLASH_3_HUB], R._supported_arg_names[A._FLASH_3_HUB] = saved
    config = ad._HUB_KERNELS_REGISTRY[A._FLASH_3_HUB]
    monkeypatch.setattr(config, "kernel_fn", lambda *a, **k: None)  # what a Hub fetch leaves there
    assert diffusers_compat.hub_kernel_loaded(A._FLASH_3_HUB)
    with pytest.raises(RuntimeError, match="Hub FA3 kernel already serves in this process"):
        fa3.register_fp8()
