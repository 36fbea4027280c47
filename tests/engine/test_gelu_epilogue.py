"""A linear followed by a tanh GELU as one GEMM (`magi_zoo::linear_gelu_tanh`, the precision
section's `gelu_epilogue`): the op's definition and backward, the precision step's swaps of
diffusers' GELU modules (Wan, Flux) and Flux's single-block MLP, `gelu_epilogue = false`, the
undo, compiled == eager with 0 graph breaks, and (GPU) cuBLASLt's epilogue against the definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import magi_zoo
from magi_zoo.engine import counters
from magi_zoo.engine.kernels import gelu_linear
from magi_zoo.engine.precision import GELU_EPILOGUE_MARK, GeluLinear
from magi_zoo.overrides import spec_layers

from helpers.fusion import assert_undone_exactly, count_calls, forward


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_op_is_gelu_of_the_linear_and_has_its_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 24, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 24, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, generator=g, dtype=torch.float64, requires_grad=True)
    y = gelu_linear.linear_gelu_tanh(x, w, b)
    want = F.gelu(F.linear(x, w, b), approximate="tanh")
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(y, (x, w, b), grad)
    ref = torch.autograd.grad(want, (x, w, b), grad)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)
    assert gelu_linear.linear_gelu_tanh(x.detach(), w.detach(), None).shape == (9, 40)  # no bias: the definition
    with pytest.raises(ValueError, match=r"x \(M, K\) and weight \(N, K\)"):
        gelu_linear.linear_gelu_tanh(x.detach(), w.detach()[:, :8], b.detach())


def test_backward_working_set_is_two_wide_tensors():
    # Eager backward (no compile to fuse it): the recomputed pre-activation and the gradient
    # through the GELU, each M x N in the input's dtype -- not fp32 temporaries per term of
    # the derivative (a Wan-1.3B up projection's are 1.17 GB each). Sizes by LiveBytes.
    from magi_zoo.engine.recompute import measure_peak

    m, k, n = 256, 32, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, dtype=torch.bfloat16, requires_grad=True)
    y = gelu_linear.linear_gelu_tanh(x, w, b)
    grad = torch.randn_like(y)
    (got, peak) = measure_peak(lambda: torch.autograd.grad(y, (x, w, b), grad))
    wide = m * n * 2
    assert peak <= 2 * wide + 2 * (m * k + n * k + n) * 2, (peak, wide)
    ref = torch.autograd.grad(F.gelu(F.linear(x.float(), w.float(), b.float()), approximate="tanh"),
                              (x, w, b), grad.float())
    for a, r in zip(got, ref):
        assert _rel(a, r) < 2e-2


class _FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(gelu_linear.apply(x, self.up)) + x


@pytest.mark.parametrize("save, op_runs", [(["matmuls"], 1), (["attention"], 2)])
def test_recompute_treats_the_op_as_a_matmul(save, op_runs):
    # Kept where an option keeps the matmuls, recomputed where it keeps attention only: as
    # compute-sensitive (kept by every option) it charged Wan-1.3B's "keep attention" 0.55 GiB
    # a block more and auto at 16 GiB fell back to full recompute.
    from magi_zoo.engine.compat.torch import TorchDispatchMode
    from magi_zoo.engine.recompute import is_down_projection, op_group

    op = torch.ops.magi_zoo.linear_gelu_tanh.default
    assert op_group(op) == "matmuls"
    up, down = torch.empty(4, 8), torch.empty(4, 32)
    assert not is_down_projection(op, (up, torch.empty(32, 8), None))  # K 8 -> N 32
    assert is_down_projection(op, (down, torch.empty(8, 32), None))    # K 32 -> N 8

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += func is op
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    net = nn.Sequential(_FFN(), _FFN())
    x = torch.randn(5, 8, requires_grad=True)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    magi_zoo.apply(net, {"recompute": {"_FFN": {"policy": "selective", "save": save}},
                         "compile": {"_FFN": {"enabled": False}}})
    with Count():
        net(x).sum().backward()
    assert Count.n == 2 * op_runs
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r)


def test_op_traces_whole_under_fullgraph(fresh_dynamo):
    lin = nn.Linear(16, 32)
    fn = torch.compile(lambda t: gelu_linear.apply(t, lin) * 2, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 16)
    before = counters.snapshot()
    out = fn(x)
    counters.expect(counters.delta(before), frames=1, breaks=0, recompiles=0)
    torch.testing.assert_close(out, 2 * F.gelu(lin(x), approximate="tanh"))


def _plan(blocks, **fields):
    return {"compile": {"": False}, "precision": {b: dict(fields) for b in blocks}}


BLOCKS = {"wan2.1-tiny": ["WanTransformerBlock"], "flux-tiny": ["FluxTransformerBlock", "FluxSingleTransformerBlock"]}


@pytest.mark.parametrize("family", ["wan2.1-tiny", "flux-tiny"])
def test_default_plan_runs_every_tanh_gelu_in_the_gemm_epilogue_and_undoes(family, monkeypatch):
    h = magi_zoo.load(family, gpu="cpu", compile=False)
    tr = h.pipe.transformer
    ref = forward(h)
    keys = list(tr.state_dict())
    gelus = sum(type(m).__name__ == "GELU" and hasattr(m, "proj") and m.approximate == "tanh" for m in tr.modules())
    singles = list(getattr(tr, "single_transformer_blocks", None) or [])
    rep = magi_zoo.apply(h.modules, _plan(BLOCKS[family]), gpu="cpu", preparations=h.adapter.preparations(h.pipe))
    did = rep.step("precision").did
    swapped = sum(isinstance(m, GeluLinear) for m in tr.modules())
    assert swapped == gelus and swapped > 0  # diffusers' GELU modules; Flux's single blocks' nn.GELU are marked
    assert f"{swapped} GELU module(s)" in did
    assert "RoPE in one pass" in did  # both families' processors fuse it (test_norm_rope.py)
    assert list(tr.state_dict()) == keys  # GeluLinear holds the same proj: no key moves
    calls = count_calls(monkeypatch, gelu_linear, "linear_gelu_tanh")
    out = forward(h)
    assert len(calls) == swapped + len(singles)  # Flux: each single block's proj_mlp fused too
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert_undone_exactly(h, ref, calls, lambda: [m for m in tr.modules() if isinstance(m, GeluLinear)
                                                  or GELU_EPILOGUE_MARK in m.__dict__])


def test_gelu_epilogue_false_leaves_the_gelus_alone(monkeypatch):
    h = magi_zoo.load("flux-tiny", gpu="cpu", compile=False)
    rep = magi_zoo.apply(h.modules, _plan(BLOCKS["flux-tiny"], gelu_epilogue=False), gpu="cpu",
                         preparations=h.adapter.preparations(h.pipe))
    assert "GELU in the GEMM epilogue" not in rep.step("precision").did
    calls = count_calls(monkeypatch, gelu_linear, "linear_gelu_tanh")
    forward(h)
    assert calls == [] and not any(isinstance(m, GeluLinear) for m in h.pipe.transformer.modules())


def test_compiled_wan_with_epilogues_equals_eager_without_breaks(fresh_dynamo):
    h = magi_zoo.load("wan2.1-tiny", gpu="cpu", compile=False)
    ref = forward(h)
    before = counters.snapshot()  # the shipped plan for the cpu profile: inductor, dynamic shapes
    rep = magi_zoo.apply(h.modules, layers=spec_layers(h.adapter, magi_zoo.get_profile("cpu")), gpu="cpu",
                         preparations=h.adapter.preparations(h.pipe))
    out = forward(h)
    assert "GELU in the GEMM epilogue" in rep.step("precision").did
    assert "RoPE in one pass" in rep.step("precision").did  # magi_zoo::rms_norm_rope traced too
    counters.expect(counters.delta(before), frames=1, breaks=0, recompiles=0)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n", [(4096, 3072, 12288), (1000, 1536, 8960), (7, 64, 48)])
def test_cublaslt_epilogue_equals_the_definition(m, k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    fp32 = gelu_linear.reference(x.float(), w.float(), b.float())
    got = gelu_linear.linear_gelu_tanh(x, w, b)
    unfused = gelu_linear.reference(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # the epilogue applies the GELU to the fp32 accumulator: no worse than the unfused bf16 path
    assert _rel(got, fp32) <= _rel(unfused, fp32) * 1.05 + 1e-4 and _rel(got, fp32) < 5e-3
