"""HunyuanVideo-1.5 and LTX-2 on a CUDA card (skipped without one): the shipped plan for the
card (the h100 / h200 tables: static shapes) against eager in bf16, one compile for the
repeated blocks, and a whole generation written as `run` writes it (LTX-2: the .mp4 with its
sound track)."""

import pytest
import torch

import magi_zoo

pytestmark = pytest.mark.gpu

BLOCKS = {"hunyuanvideo-1.5-tiny": "HunyuanVideo15TransformerBlock", "ltx-2-tiny": "LTX2VideoTransformerBlock"}


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_tiny_bf16_plan_equals_eager_with_one_compile(name, fresh_dynamo):
    h = magi_zoo.load(name, gpu="auto", compile=False)
    assert h.dtype == torch.bfloat16 and h.device.type == "cuda"
    t = h.adapter.denoiser(h.pipe)
    kw = h.adapter.denoiser_inputs(h.pipe, h.variant)
    with torch.no_grad():
        ref = t(**kw)
        rep = h.apply_plan()
        out = t(**kw)
        again = t(**kw)
    for o, r in zip(out, ref):  # LTX-2: the video and the audio velocities
        assert _rel(o, r) < 1e-2  # bf16 tolerance (docs/testing.md)
    assert all(torch.equal(a, o) for a, o in zip(again, out))
    r = rep.region(BLOCKS[name])
    assert (r.counters.frames, len(r.counters.recompiles), r.counters.n_graph_breaks) == (1, 0, 0)


@pytest.mark.parametrize("name, suffix", [("hunyuanvideo-1.5-tiny", ".mp4"), ("ltx-2-tiny", ".mp4")])
def test_tiny_generation_is_written(name, suffix, tmp_path, fresh_dynamo):
    from magi_zoo.cli import generate_to, writers

    # an .mp4 needs an encoder package, which a GPU image may lack; without it `run` refuses
    # before generating (tested on the CPU). LTX-2's sound track needs PyAV itself.
    missing = ("needs PyAV: the `av` extra" if name.startswith("ltx") and not writers.can_mux_audio()
               else writers.mp4_writer_missing())
    if missing:
        pytest.skip(f"writing {name}'s .mp4 {missing}")

    h = magi_zoo.load(name, gpu="auto")
    wav = tmp_path / "a.wav" if name.startswith("ltx") else None
    written = generate_to(h, prompt="a drum solo", out=tmp_path / ("v" + suffix), audio_out=wav, progress=False)
    assert all(p.stat().st_size > 0 for p in written)
    if wav is not None:
        av = pytest.importorskip("av")
        with av.open(str(written[0])) as c:
            assert len(c.streams.video) == 1 and len(c.streams.audio) == 1
