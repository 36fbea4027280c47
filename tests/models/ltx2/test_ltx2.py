"""LTX-2: a generation is a video with its sound track. The contract's part (an `Output` video
with `audio`, muxed into the .mp4 and written to --audio-out as .wav) is checked on synthetic
frames and audio, without a model; the tiny pipeline's run is the conformance suite's."""

from __future__ import annotations

import types
import wave

import numpy as np
import pytest

from magi_zoo.adapters import base, lookup
from magi_zoo.adapters.base import Output
from magi_zoo.cli.writers import write_output

av = pytest.importorskip("av", reason="the av extra muxes the sound track")

FPS, RATE, FRAMES = 24, 24000, 9


def _output():
    t = np.arange(RATE * FRAMES // FPS) / RATE
    tone = 0.5 * np.sin(2 * np.pi * 440.0 * t)
    audio = np.stack([tone, -tone]).astype(np.float32)  # stereo: the vocoder's (2, samples)
    frames = [np.full((64, 64, 3), i / FRAMES, dtype=np.float32) for i in range(FRAMES)]
    return Output("video", frames, fps=FPS, audio=audio, sample_rate=RATE)


def test_mp4_carries_the_sound_track_and_wav_keeps_both_channels(tmp_path):
    out, wav = tmp_path / "v.mp4", tmp_path / "v.wav"
    assert write_output(_output(), out, wav) == [out, wav]
    with av.open(str(out)) as c:
        [video], [audio] = c.streams.video, c.streams.audio
        assert (video.codec_context.width, video.codec_context.height) == (64, 64)
        assert sum(1 for _ in c.decode(video=0)) == FRAMES
        assert audio.codec_context.sample_rate == RATE and audio.codec_context.channels == 2
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, RATE, RATE * FRAMES // FPS)
        pcm = np.frombuffer(w.readframes(4), dtype="<i2").reshape(-1, 2)
        assert (pcm[1:, 0] == -pcm[1:, 1]).all() and pcm[1:, 0].any()  # channels interleaved, not mixed


def test_generate_returns_frames_and_the_vocoders_track():
    import torch

    adapter, variant = lookup("ltx-2-tiny")
    seen = {}

    def call(**kw):
        seen.update(kw)
        return types.SimpleNamespace(frames=[np.zeros((FRAMES, 64, 64, 3))], audio=torch.zeros(1, 2, 7920))

    pipe = types.SimpleNamespace(vocoder=types.SimpleNamespace(config=types.SimpleNamespace(output_sampling_rate=RATE)),
                                 set_progress_bar_config=lambda **k: None)
    out = adapter.generate(_Handle(call, pipe, variant), prompt="a corgi", progress=False, seed=3, audio_out="a.wav")
    assert out.kind == "video" and len(out.value) == FRAMES and out.fps == 24
    assert out.audio.shape == (2, 7920) and out.sample_rate == RATE
    assert "audio_out" not in seen and seen["output_type"] == "np" and seen["generator"].initial_seed() == 3


class _Handle:
    def __init__(self, call, pipe, variant):
        self._call, self.pipe, self.variant, self.plan = call, pipe, variant, None

    def __call__(self, **kw):
        return self._call(**kw)

    def call_defaults(self):
        return dict(self.variant.call_defaults)


def test_mp4_without_pyav_is_refused_before_any_work(tmp_path, monkeypatch):
    adapter, variant = lookup("ltx-2-tiny")
    monkeypatch.setattr(base, "can_mux_audio", lambda: False)
    with pytest.raises(ValueError, match=r"sound track.*PyAV.*magi-zoo\[av\]"):
        adapter.check_run(variant, {}, tmp_path / "v.mp4")
    adapter.check_run(variant, {}, tmp_path / "v.gif")  # frames only: no muxer needed
    with pytest.raises(ValueError, match=r"--audio-out .*\.wav"):
        adapter.check_run(variant, {"audio_out": str(tmp_path / "a.mp3")}, tmp_path / "v.gif")


@pytest.mark.parametrize("name", ["ltx-2-tiny", "ltx-2"])
def test_call_defaults_give_finite_sigmas(name):
    """LTX-2's scheduler stretches its sigmas to end at shift_terminal 0.1: one step alone
    (sigma 1.0) divides 0 by 0, and the whole video is NaN. The call defaults avoid it."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    _, variant = lookup(name)
    d, sched = variant.call_defaults, FlowMatchEulerDiscreteScheduler(**variant.config["scheduler"])
    steps = d["num_inference_steps"]
    tokens = ((d["num_frames"] - 1) // 8 + 1) * (d["height"] // 32) * (d["width"] // 32)
    mu = calculate_shift(tokens, 1024, 4096, 0.95, 2.05)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    assert steps >= 2 and np.isfinite(sched.sigmas.numpy()).all()
