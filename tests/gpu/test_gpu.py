"""GPU checks (run on a CUDA box; skipped in CI): compiled equals eager in bf16, and the
warm-start cache hits across processes with Triton kernels."""

import pytest
import torch

import magi_zoo

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_wan_tiny_bf16_compiled_equals_eager(fresh_dynamo):
    h = magi_zoo.load("wan2.1-tiny", gpu="auto", compile=False)
    assert h.dtype == torch.bfloat16 and h.device.type == "cuda"
    t = h.adapter.denoiser(h.pipe)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    with torch.no_grad():
        ref = t(**kw)[0]
        rep = h.apply_plan()
        out = t(**kw)[0]
    assert _rel(out, ref) < 1e-2  # bf16 tolerance (docs/testing.md)
    r = rep.region("WanTransformerBlock")
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)


def test_wan_tiny_pipeline_on_gpu(fresh_dynamo):
    h = magi_zoo.load("wan2.1-tiny", gpu="auto")
    frames = h(prompt="a corgi", output_type="np", **h.variant.call_defaults).frames
    assert frames.shape == (1, 9, 32, 32, 3)


def test_wan22_tiny_two_experts_on_gpu(fresh_dynamo):
    # Both experts run (boundary in the middle of 4 steps) and share one compiled block.
    h = magi_zoo.load("wan2.2-tiny", gpu="auto")
    frames = h(prompt="a corgi", output_type="np").frames  # the handle applies the tiny call defaults
    assert frames.shape[:2] == (1, 9)
    r = h.report().region("WanTransformerBlock")
    assert len(r.modules) == 8 and (r.counters.frames, len(r.counters.recompiles)) == (1, 0)
