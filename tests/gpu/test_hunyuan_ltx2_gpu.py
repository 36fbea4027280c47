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
    import importlib.util

    from magi_zoo.cli import generate_to

    # an .mp4 needs an encoder package (the `av` extra, or imageio-ffmpeg for frames only), which
    # a GPU image may lack; without it `run` refuses before generating (tested on the CPU)
    has = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
    if not (has("av") or (not name.startswith("ltx") and has("imageio_ffmpeg"))):
        pytest.skip(f"writing {name}'s .mp4 needs PyAV" + ("" if name.startswith("ltx") else " or imageio-ffmpeg"))

    h = magi_zoo.load(name, gpu="auto")
    wav = tmp_path / "a.wav" if name.startswith("ltx") else None
    written = generate_to(h, prompt="a drum solo", out=tmp_path / ("v" + suffix), audio_out=wav, progress=False)
    assert all(p.stat().st_size > 0 for p in written)
    if wav is not None:
        av = pytest.importorskip("av")
        with av.open(str(written[0])) as c:
            assert len(c.streams.video) == 1 and len(c.streams.audio) == 1


def test_ltx2_whole_call_in_cuda_graphs_equals_the_uncaptured_call(fresh_dynamo):
    # The Hopper plan captures the transformer's forward in CUDA graphs (ltx2.toml). A default
    # call runs it three ways per step (the CFG pair, the STG pass, the modality-isolation pass):
    # three graphs, each replayed at the later steps, with no call left uncaptured. The video and
    # the sound track equal the same plan with the graphs off, on the same weights.
    h = magi_zoo.load("ltx-2-tiny", gpu="auto")
    rep = h.report()
    calls = (rep.step("cuda_graphs").details or {}).get("graphed", {})
    if not calls:
        pytest.skip(f"the {rep.profile} plan captures no CUDA graphs")
    plain = magi_zoo.load("ltx-2-tiny", gpu="auto", overrides={"cuda_graphs": {"transformer": False}})
    assert not (plain.report().step("cuda_graphs").details or {}).get("graphed")
    weights = h.modules.state_dict()
    with torch.no_grad():
        for k, t in plain.modules.state_dict().items():
            t.copy_(weights[k])
    call = dict(prompt="a drum solo", output_type="np", num_inference_steps=3)
    got = h(generator=torch.Generator().manual_seed(0), **call)
    want = plain(generator=torch.Generator().manual_seed(0), **call)
    [stats] = [c.stats() for c in calls.values()]
    # 3 steps x 3 forwards (on the CPU the tiny call's forwards are 3 per step, 3 signatures):
    # every forward a replay of one of the three graphs
    assert (stats["graphs"], stats["replays"], stats["uncaptured"]) == (3, 9, {}), stats
    for a, b in ((got.frames[0], want.frames[0]), (got.audio[0], want.audio[0])):
        assert _rel(torch.as_tensor(a), torch.as_tensor(b)) < 1e-3
