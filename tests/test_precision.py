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
from magi_zoo.specs import PlanLayer, with_precision

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
    rep = magi_zoo.apply(wan.modules, layers=layers, gpu=CPU_FP8)
    # per Wan block: self-attention q, k, v, out + cross-attention q, k, v, out + FFN in, out = 10
    # linears, x 4 blocks = 40; all dims (32, 64) are multiples of 16
    assert rep.step("precision").details == {"fp8_linears": 40, "skipped": 0}
    assert "fp8 matmuls on WanTransformerBlock (40 linears)" in rep.step("precision").did
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


def test_fp8_refused_without_fp8_matmuls(wan):
    with pytest.raises(ValueError, match="precision='fp8' needs a card with fp8 matmuls.*profile 'cpu'"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", precision="fp8")
    with pytest.raises(ValueError, match="matmul='fp8' needs a card with fp8.*profile 'a100'"):
        magi_zoo.apply(wan.modules, {"precision": {"WanTransformerBlock": "fp8"}, "compile": {"": False}}, gpu="a100")
    assert not any(isinstance(m, Fp8Linear) for m in wan.pipe.transformer.modules())
    with pytest.raises(ValueError, match="choices: bf16, fp8"):
        magi_zoo.load("wan2.1-tiny", gpu="cpu", precision="fp16")
    with pytest.raises(ValueError, match="unknown field 'matmull' -- did you mean 'matmul'"):
        PlanLayer(precision={"WanTransformerBlock": {"matmull": "fp8"}})


def test_with_precision_needs_declared_regions_and_merges_over_user():
    with pytest.raises(ValueError, match="declares no \\[\\*.precision\\] regions"):
        with_precision([("model default", PlanLayer(compile={"Block": {}}))], "fp8")
    layers = [("model default", PlanLayer(precision={"Block": "bf16"})),
              ("user", PlanLayer(compile={"Block": {"dynamic": True}}))]
    out = with_precision(layers, "fp8")
    assert [n for n, _ in out] == ["model default", "user"]
    user = out[-1][1]
    assert user.entries("precision")["Block"].matmul == "fp8"
    assert [s.dynamic for _, _, s in user.items("compile")] == [True]
