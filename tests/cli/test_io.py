"""`magi_zoo.io.atomic_write`: the target is the old file or the new one, never half of one."""

import os
import stat
import wave

import pytest

from magi_zoo.io import atomic_write, atomic_write_bytes, atomic_write_text


def test_writes_via_a_temp_with_the_same_suffix_in_the_same_dir(tmp_path):
    seen = []

    def writer(tmp):
        seen.append(tmp)
        assert tmp.parent == tmp_path / "sub"  # same filesystem: the rename cannot become a copy
        assert tmp.suffix == ".mp4"  # writers pick the format from the extension
        assert not (tmp_path / "sub" / "out.mp4").exists()  # nothing at the target yet
        tmp.write_bytes(b"video")

    assert atomic_write(tmp_path / "sub" / "out.mp4", writer) == tmp_path / "sub" / "out.mp4"
    assert (tmp_path / "sub" / "out.mp4").read_bytes() == b"video"
    assert not seen[0].exists()
    assert os.listdir(tmp_path / "sub") == ["out.mp4"]


def test_failing_writer_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    out = atomic_write_text(tmp_path / "out.txt", "old\n")

    def half_then_fail(tmp):
        tmp.write_text("half of the new")
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError, match="encoder crashed"):
        atomic_write(out, half_then_fail)
    assert out.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["out.txt"]


def test_writer_that_writes_nothing_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="did not write"):
        atomic_write(tmp_path / "x.png", lambda tmp: tmp.unlink())
    assert os.listdir(tmp_path) == []


def test_mode_is_a_normal_new_file_or_the_old_file_s(tmp_path):
    mask = os.umask(0o022)
    try:
        new = atomic_write_bytes(tmp_path / "a.bin", b"x")
        assert stat.S_IMODE(new.stat().st_mode) == 0o644  # 0o666 less the umask, not mkstemp's 0o600
        os.chmod(new, 0o640)
        atomic_write_bytes(new, b"y")
        assert stat.S_IMODE(new.stat().st_mode) == 0o640 and new.read_bytes() == b"y"
    finally:
        os.umask(mask)


def test_works_with_path_taking_writers(tmp_path):
    # what cli.write_wav / write_output hand it: libraries that open the path themselves
    def wav(tmp):
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(b"\0\0" * 160)

    out = atomic_write(tmp_path / "speech.wav", wav)
    with wave.open(str(out), "rb") as w:
        assert w.getnframes() == 160

    from PIL import Image

    img = atomic_write(tmp_path / "img.png", lambda tmp: Image.new("RGB", (4, 3)).save(tmp))
    assert Image.open(img).size == (4, 3) and Image.open(img).format == "PNG"


def test_video_as_gif_needs_no_ffmpeg(tmp_path, monkeypatch):
    """--out x.gif writes with Pillow alone (a machine without ffmpeg can still save video);
    an .mp4 without ffmpeg says what to install or to write .gif."""
    import numpy as np
    from PIL import Image

    from magi_zoo import cli
    from magi_zoo.adapters.base import Output

    frames = [np.full((8, 12, 3), i / 4, dtype=np.float32) for i in range(5)]
    out = cli.write_output(Output(kind="video", value=frames, fps=8), tmp_path / "v.gif")
    with Image.open(out[0]) as im:
        assert (im.n_frames, im.size) == (5, (12, 8))
        im.seek(4)
        assert im.convert("RGB").getpixel((0, 0)) == (255, 255, 255)  # frame values 0..1 -> 0..255

    from magi_zoo.cli import writers

    # Both encoders at the served preset (x264 writes its settings into the stream: "veryfast"
    # is subme=2 and rc_lookahead=10; x264's default "medium" would be subme=7, rc_lookahead=40).
    veryfast = (b"subme=2 ", b"rc_lookahead=10 ")
    cli.write_output(Output(kind="video", value=frames, fps=8), tmp_path / "i.mp4")  # imageio's ffmpeg
    assert all(s in (tmp_path / "i.mp4").read_bytes() for s in veryfast)

    def no_ffmpeg(*a, **k):
        raise RuntimeError("No ffmpeg exe could be found. Install ffmpeg on your system")

    monkeypatch.setattr(writers, "write_mp4_imageio", no_ffmpeg)
    if writers.can_mux_audio():  # no ffmpeg for imageio, PyAV installed: H.264 through PyAV
        cli.write_output(Output(kind="video", value=frames, fps=8), tmp_path / "p.mp4")
        import av

        with av.open(str(tmp_path / "p.mp4")) as f:
            got = [fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)]
            assert f.streams.video[0].codec_context.name == "h264"
        assert len(got) == 5 and got[0].shape == (8, 12, 3)
        assert abs(int(got[4][4, 6].mean()) - 255) <= 8  # the last frame is white
        assert all(s in (tmp_path / "p.mp4").read_bytes() for s in veryfast)
        # frame threads (VIDEO_THREADS): x264 runs more than one thread on a 64 x 64 clip where
        # PyAV's default slice threads leave it one
        import os
        import re

        writers.write_mp4_pyav([np.full((64, 64, 3), i / 4, dtype=np.float32) for i in range(5)], tmp_path / "t.mp4", 8)
        x264_threads = int(re.search(rb" threads=(\d+)", (tmp_path / "t.mp4").read_bytes()).group(1))
        assert x264_threads > 1 or (os.cpu_count() or 1) < 2, x264_threads
    monkeypatch.setattr(writers, "can_mux_audio", lambda: False)
    with pytest.raises(RuntimeError, match=r"writing v.mp4 needs ffmpeg \(pip install imageio-ffmpeg, or the `av` "
                                           r"extra\); or write v.gif"):
        cli.write_output(Output(kind="video", value=frames, fps=8), tmp_path / "v.mp4")
    assert not (tmp_path / "v.mp4").exists()


def test_mp4_writer_missing_names_what_to_install(monkeypatch):
    """Asked before work whose output is an .mp4 (benchmarks.whole_generation): None where
    imageio's ffmpeg wheel or PyAV is installed, else what to install."""
    import importlib.util

    from magi_zoo.cli import writers

    real = importlib.util.find_spec
    monkeypatch.setattr(writers, "can_mux_audio", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
    assert writers.mp4_writer_missing() == "needs ffmpeg: pip install imageio-ffmpeg, or the `av` extra"
    monkeypatch.setattr(writers, "can_mux_audio", lambda: True)  # PyAV alone writes H.264
    assert writers.mp4_writer_missing() is None
    monkeypatch.setattr(writers, "can_mux_audio", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert (writers.mp4_writer_missing() is None) == (real("imageio_ffmpeg") is not None)
